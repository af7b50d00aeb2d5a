"""Finding what the TPU-MLIR toolchain needs on this host: CPython 3.10, from which the
native venv is built (everything else comes from requirements.lock) and which the
container image copies (Debian bookworm, the image's base, ships 3.11 only, and no
package registry serves a CPython build). Cheap checks only: the workflow runs them
while it parses.
"""

import functools
import glob
import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

from npuforge.errors import NpuforgeError

# Names the CPython 3.10 to build the native venv and the image from (before PATH and pyenv).
PYTHON_ENV = "PYTHON310"
# The Containerfile copies this build context (a CPython 3.10 prefix) into /usr/local.
PYTHON_CONTEXT = "python310"
# What the interpreter's prefix holds that the image does not take: packages installed
# into it on this machine, and bytecode (which embeds the source files' mtimes).
INSTALLED_PACKAGES = "lib/python3.10/site-packages"
BYTECODE = "__pycache__"


def _python_candidates():
    found = shutil.which("python3.10")
    if found:
        yield found
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    yield from sorted(glob.glob(f"{pyenv_root}/versions/3.10.*/bin/python3.10"), reverse=True)
    yield from ("/usr/local/bin/python3.10", "/usr/bin/python3.10")


def native_python(options) -> str:
    """The CPython 3.10 the native toolchain venv (and the image) is built from.

    ``python`` in the target options (or $PYTHON310) names it; otherwise the first
    python3.10 that runs, on PATH, under pyenv, or in /usr(/local)/bin.
    """
    named = getattr(options, "python", None) or os.environ.get(PYTHON_ENV)
    if named:
        return str(named)
    for candidate in _python_candidates():
        # A pyenv shim is on PATH even where its global version is another Python.
        if os.access(candidate, os.X_OK) and _python_version(candidate) == "3.10":
            return candidate
    raise NpuforgeError(_NO_PYTHON)


_NO_PYTHON = (
    "TPU-MLIR needs CPython 3.10 exactly (natively, and to build its image) and none was "
    "found: install one (e.g. 'pyenv install 3.10') and name it with $PYTHON310 (or "
    "'python' in the target's options)"
)


@functools.cache
def _python_version(python: str) -> str | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _image_built(runtime: str) -> bool:
    from npuforge import toolchain

    return toolchain.image_exists(runtime, toolchain.image_name("tpumlir"))


def _python310_problem(options, needed_for: str) -> str | None:
    """Why no CPython 3.10 can be used here, one line opening with ``needed_for``."""
    try:
        python = native_python(options)
    except NpuforgeError as err:
        return str(err)
    version = _python_version(python)
    if version == "3.10":
        return None
    found = f"Python {version}" if version else "not runnable"
    return (
        f"{needed_for} but {python} is {found}: name a 3.10 interpreter with $PYTHON310 "
        "(or 'python' in the target's options)"
    )


def _container_reason(runtime: str, options) -> str | None:
    if _image_built(runtime):
        return None
    return _python310_problem(options, "the TPU-MLIR image copies CPython 3.10 from this machine")


def _prefix_and_version(python: str) -> tuple[Path, str]:
    out = subprocess.run(
        [
            python,
            "-c",
            "import platform, sys; print(sys.base_prefix); print(platform.python_version())",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise NpuforgeError(f"{python} does not run: {out.stderr.strip()[-200:]}")
    prefix, version = out.stdout.splitlines()[-2:]
    return Path(prefix), version


def image_build_contexts(options, staging: Path):
    """The build contexts the TPU-MLIR image needs, staged under ``staging``, and the
    labels naming them: the prefix of the CPython 3.10 the native route would use
    (pyenv's, on our machines), without its site-packages and bytecode, and the sha256
    of that tree (paths, modes, symlink targets, contents)."""
    prefix, version = _prefix_and_version(native_python(options))
    target = staging / PYTHON_CONTEXT
    digest = hashlib.sha256()
    for path in sorted(prefix.rglob("*")):
        relative = path.relative_to(prefix).as_posix()
        if relative.startswith(INSTALLED_PACKAGES) or BYTECODE in path.parts:
            continue
        info = path.lstat()
        dest = target / relative
        digest.update(f"{relative}\0{stat.S_IMODE(info.st_mode):o}\0".encode())
        if stat.S_ISLNK(info.st_mode):
            link = os.readlink(path)
            digest.update(f"link:{link}\0".encode())
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(link, dest)
        elif stat.S_ISDIR(info.st_mode):
            dest.mkdir(parents=True, exist_ok=True)
        elif stat.S_ISREG(info.st_mode):
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            digest.update(path.read_bytes() + b"\0")
    labels = {
        "npuforge.python310.version": version,
        "npuforge.python310.sha256": digest.hexdigest(),
    }
    return {PYTHON_CONTEXT: target}, labels


def unavailable_reason(runtime: str, options) -> str | None:
    """Why the TPU-MLIR toolchain cannot run here (one line, with the fix); None if it can."""
    if runtime in ("podman", "docker"):
        return _container_reason(runtime, options)
    if runtime != "native":
        return f"unknown toolchain runtime '{runtime}': choose native, podman or docker"
    return _python310_problem(options, "TPU-MLIR needs CPython 3.10 exactly")
