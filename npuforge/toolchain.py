"""Vendor toolchain environments: prepare them, check them, run jobs in them.

A vendor toolkit pins its own Python, numpy, onnx and torch, so it never runs
in the main environment. Each backend has ``envs/<backend>/`` with a
``requirements.lock``, a ``Containerfile`` and a ``versions.py``. A toolchain
is prepared once per (backend, runtime) and described by a *stamp* JSON file;
jobs then run as ``python <job_script> <spec.json>`` inside it.

Runtimes:
  native  a venv built from the lock in the machine's cache (``cache_root()``),
          shared by every checkout; the stamp names its python
  podman  an image built from the Containerfile (the stamp names the image)
  docker  the same with docker

This module is imported while Snakemake parses the workflow: keep it free of
heavy imports.
"""

import contextlib
import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from npuforge.cache import KEPT_VERSIONS, build_once, cache_root, entry_in_use, evict_older
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, write_json
from npuforge.jobs import job_stage

RUNTIMES = ("native", "podman", "docker")
# How to install each engine on Debian (Debian's "docker" is a window-manager dock); podman
# as our images need it (runc, explicit ulimits) comes from our own script.
ENGINE_INSTALL = {
    "podman": "as root: bash envs/base/setup-podman.sh",
    "docker": "apt-get install docker.io",
}
CONTAINER_RUNTIMES = ("podman", "docker")
ARCH_TEMPLATE = {"podman": "{{.Host.Arch}}", "docker": "{{.Architecture}}"}
BASE_IMAGE = "localhost/npuforge-base:bookworm"
REPO_ROOT = Path(__file__).resolve().parents[1]
# Where the python of a toolchain image lives; every Containerfile puts its venv here.
CONTAINER_PYTHON = "/opt/toolchain/bin/python"


def env_dir(backend: str, repo_root=None) -> Path:
    return Path(repo_root or REPO_ROOT) / "envs" / backend


def native_venv(backend: str, repo_root=None) -> Path:
    """One venv per (backend, envs/<backend>/ hash) in the machine's cache."""
    return cache_root() / "toolchains" / f"{backend}-native-{env_hash(backend, repo_root)}"


def env_hash(backend: str, repo_root=None) -> str:
    """Content hash of envs/<backend>/ (its lock, Containerfile, versions.py; not its docs):
    names the image and the venv, so an edit rebuilds and a README edit does not."""
    root = env_dir(backend, repo_root)
    if not root.is_dir():
        raise NpuforgeError(f"no toolchain definition for backend '{backend}': expected {root}/")
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".md"):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def image_name(backend: str, repo_root=None) -> str:
    return f"localhost/npuforge-{backend}:{env_hash(backend, repo_root)}"


def _backend_module(backend: str):
    try:
        return importlib.import_module(f"npuforge.backends.{backend}")
    except ModuleNotFoundError:
        return None


@functools.cache
def _engine_problem(engine: str) -> str | None:
    if shutil.which(engine) is None:
        return (
            f"container engine '{engine}' is not installed: install it (Debian: "
            f"{ENGINE_INSTALL.get(engine, f'apt-get install {engine}')}) or choose another "
            "toolchain runtime (toolchain_runtime=native in config)"
        )
    try:
        probe = subprocess.run(
            # podman's and docker's info structs name the architecture differently
            [engine, "info", "--format", ARCH_TEMPLATE.get(engine, "{{.Architecture}}")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return f"container engine '{engine}' did not answer in 60 s: check it with '{engine} info'"
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"container engine '{engine}' is installed but not usable ({reason}): start it or "
            "choose another toolchain runtime (toolchain_runtime=native in config)"
        )
    return None


def unavailable_reason(backend: str, runtime: str, target_options=None) -> str | None:
    """Why this toolchain cannot run here, as one line; None when it can.

    Cheap enough to call while the workflow is parsed, so that a missing
    toolchain stops the run before any job starts.
    """
    if runtime not in RUNTIMES:
        return f"unknown toolchain runtime '{runtime}': choose one of {', '.join(RUNTIMES)}"
    if runtime in CONTAINER_RUNTIMES:
        problem = _engine_problem(runtime)
        if problem:
            return problem
    module = _backend_module(backend)
    check = getattr(module, "unavailable_reason", None)
    if check is not None:
        try:
            options = _typed(module, target_options)
        except NpuforgeError as err:
            return str(err)
        return check(runtime, options)
    return None


def toolchain_options(backend: str, target_options) -> dict:
    """The part of a target's options that its backend's toolchain reads (its module's
    ``TOOLCHAIN_OPTIONS``: a native interpreter, an SDK path). One environment serves
    every target of a backend, so the rest (a SoC, a precision's float16 layers) must
    not make it look changed when another target of that backend is built."""
    module = _backend_module(backend)
    names = getattr(module, "TOOLCHAIN_OPTIONS", ())
    if target_options is not None and not isinstance(target_options, dict):
        # A backend's typed options (as its tests pass them): the set ones.
        typed = vars(_typed(module, target_options))
        target_options = {name: value for name, value in typed.items() if value is not None}
    return {name: target_options[name] for name in names if name in (target_options or {})}


def _typed(module, target_options):
    """What the backend's toolchain code sees of a target's options: an object with each
    of its ``TOOLCHAIN_OPTIONS`` (None when unset); None passes through (a toolchain
    prepared without a target)."""
    import types

    if target_options is None:
        return None
    names = getattr(module, "TOOLCHAIN_OPTIONS", ())
    if isinstance(target_options, dict):
        return types.SimpleNamespace(**{name: target_options.get(name) for name in names})
    return types.SimpleNamespace(**{name: getattr(target_options, name, None) for name in names})


def _native_base_python(backend: str, target_options) -> str:
    module = _backend_module(backend)
    chooser = getattr(module, "native_python", None)
    if chooser is not None:
        return chooser(_typed(module, target_options))
    return sys.executable


def _run(cmd, *, log, env=None, what):
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    result = subprocess.run(
        [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env, text=True
    )
    if result.returncode != 0:
        with open(log.name, encoding="utf-8", errors="replace") as written:
            written.seek(max(0, os.fstat(written.fileno()).st_size - 65536))
            full = disk_full(what, written.read())
        raise NpuforgeError(full or f"{what} failed (exit {result.returncode}): see {log.name}")


DISK_FULL = "No space left on device"


def disk_full(what: str, output: str) -> str | None:
    """One line for a step that filled the disk, naming where the space goes."""
    if DISK_FULL.lower() not in output.lower():  # podman's Go errors say it in lower case
        return None
    return (
        f"{what} ran out of disk space ({DISK_FULL}): free space for the machine's cache "
        f"({cache_root()}), the container store and the results directory, then run again "
        f"(a TPU-MLIR toolchain takes about 7 GB; older toolchain versions beyond "
        f"{KEPT_VERSIONS} per backend are removed as new ones are built)"
    )


def _waiting_reporter(log):
    """Says, in the build log and the step's output, that the step waits for another."""
    out = _Tee(log, sys.stdout)

    def say(message):
        out.write(message + "\n")
        out.flush()

    return say


class _Tee:
    """Writes to several text streams at once (a build log and the step's output)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


def _pip_environment() -> dict:
    """The host's pip settings that a build needs to reach the registry as set up here."""
    keep = (
        "PIP_CERT",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_FIND_LINKS",
        "PIP_DEFAULT_TIMEOUT",
    )
    return {k: os.environ[k] for k in keep if os.environ.get(k)}


def _pip_source_args() -> list[str]:
    """Build arguments that give pip in an image build the host's extra package sources.

    Local wheel directories (PIP_FIND_LINKS) are mounted read-only at the same path,
    so a lock pin such as torch==2.13.0+cpu resolves to the very file the native
    toolchain installed.
    """
    args = []
    links = [p for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
    local = [p for p in links if Path(p).is_dir()]
    for path in local:
        args += ["--volume", f"{Path(path).resolve()}:{Path(path).resolve()}:ro"]
    if links:
        args += ["--build-arg", f"PIP_FIND_LINKS={' '.join(links)}"]
    if os.environ.get("PIP_EXTRA_INDEX_URL"):
        args += ["--build-arg", f"PIP_EXTRA_INDEX_URL={os.environ['PIP_EXTRA_INDEX_URL']}"]
    return args


def _versions_native(python: str, backend: str, repo_root) -> dict:
    script = env_dir(backend, repo_root) / "versions.py"
    out = subprocess.run([python, str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise NpuforgeError(
            f"toolchain '{backend}' is broken: {script.name} failed: "
            + (out.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return json.loads(out.stdout)


def _prepare_native(backend, repo_root, target_options, log) -> dict:
    lock = env_dir(backend, repo_root) / "requirements.lock"
    if not lock.is_file():
        raise NpuforgeError(f"backend '{backend}' has no {lock}: cannot build a native toolchain")
    # Locks are complete (every package pinned), and some toolkits declare pins that the
    # lock deliberately overrides (rknn-toolkit2 asks for torch<=2.4): install exactly the lock.
    venv = native_venv(backend, repo_root)
    python = venv / "bin" / "python"
    # Older versions go first: their space may be what this build needs.
    others = [p for p in venv.parent.glob(f"{backend}-native-*") if p.is_dir() and p != venv]
    removed, busy = evict_older(others, shutil.rmtree)
    _report_eviction(backend, [e.name for e in removed], [e.name for e in busy], log)

    def build():
        log.write(f"building the {backend} toolchain venv in {venv}\n")
        log.flush()
        shutil.rmtree(venv, ignore_errors=True)
        check_free_space(backend, venv.parent)
        base = _native_base_python(backend, target_options)
        try:
            _run([base, "-m", "venv", venv], log=log, what=f"creating the {backend} venv")
            env = {**os.environ, **_pip_environment()}
            # Minutes for a large lock (TPU-MLIR's: ~4 GB): pip's lines go to the step's
            # output too, with a line every 10 s while pip is quiet.
            install = [python, "-m", "pip", "install", "--no-input", "--no-deps"]
            install += ["--no-cache-dir", "-r", lock]
            log.write(f"$ {' '.join(map(str, install))}\n")
            log.flush()
            code, output = _run_reporting(
                install, env, None, f"installing {lock.name}", out=_Tee(log, sys.stdout)
            )
            if code != 0:
                what = f"installing {lock}"
                full = disk_full(what, output)
                raise NpuforgeError(full or f"{what} failed (exit {code}): see {log.name}")
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        (venv / ".complete").write_text("ok\n")

    # Another checkout may be building the same venv: the second waits, then reuses it.
    build_once(venv, (venv / ".complete").exists, build, say=_waiting_reporter(log))
    return {"python": str(python), "versions": _versions_native(str(python), backend, repo_root)}


# What pip unpacks beside what it installs, as a share of the installed size.
BUILD_HEADROOM = 0.5


def check_free_space(backend: str, where: Path, *, layer_copies: int = 1) -> None:
    """Refuse to start a toolchain build that the disk under ``where`` cannot hold: the
    backend's measured size (``TOOLCHAIN_SIZE_MB``) ``layer_copies`` times (an image
    build holds it twice while the engine commits the container's layer) plus pip's
    headroom."""
    size_mb = getattr(_backend_module(backend), "TOOLCHAIN_SIZE_MB", 0)
    need_mb = int(size_mb * (layer_copies + BUILD_HEADROOM))
    existing = Path(where)
    while not existing.exists():
        existing = existing.parent
    free_mb = shutil.disk_usage(existing).free // 2**20
    if free_mb < need_mb:
        held = "" if layer_copies == 1 else f", {layer_copies} copies while an image commits"
        raise NpuforgeError(
            f"building the {backend} toolchain needs about {need_mb / 1024:.1f} GB free in "
            f"{existing} ({size_mb / 1024:.1f} GB once installed{held}, plus what pip "
            f"unpacks) and {free_mb / 1024:.1f} GB are: free space there and run again"
        )


# An image build's peak: the container's layer and the committed copy of it (podman
# filled the disk there, "writing blob: adding layer", with 1.5x the size free).
IMAGE_LAYER_COPIES = 2


def _image_store(engine: str) -> Path:
    """Where the engine keeps image layers (rootful podman: /var/lib/containers/storage)."""
    field = {"podman": "{{.Store.GraphRoot}}", "docker": "{{.DockerRootDir}}"}[engine]
    probe = subprocess.run([engine, "info", "--format", field], capture_output=True, text=True)
    return Path(probe.stdout.strip() or "/")


def _report_eviction(backend, removed, busy, log) -> None:
    for name in removed:
        log.write(f"removed an older {backend} toolchain from the machine's cache: {name}\n")
    for name in busy:
        log.write(f"kept an older {backend} toolchain that a running job uses: {name}\n")
    log.flush()


def build_base_image(engine: str, log) -> None:
    """Build the Debian bookworm base image from the configured apt mirror (no registry needed)."""
    script = REPO_ROOT / "envs" / "base" / "build-base-image.sh"
    _run(["bash", script, engine, BASE_IMAGE], log=log, what="building the base image")


def image_exists(engine: str, image: str) -> bool:
    if engine == "podman":
        return subprocess.run([engine, "image", "exists", image]).returncode == 0
    probe = subprocess.run([engine, "image", "inspect", image], capture_output=True)
    return probe.returncode == 0


# Image labels that name what an image was built from beyond envs/<backend>/.
INPUT_LABEL_PREFIX = "npuforge."


def image_marker(image: str) -> Path:
    """The cache entry standing for a toolchain image: its lock file records the image's
    last use and is held while the image is built or a job runs in it."""
    return cache_root() / "images" / image.rsplit("/", 1)[-1].replace(":", "-")


def _remove_image(engine: str, image: str) -> None:
    """Remove ``image`` and the untagged build layers only it used (podman keeps each
    build step as an image); a layer another image builds on stays."""

    def inspect(ref, field):
        probe = subprocess.run(
            [engine, "image", "inspect", "--format", field, ref], capture_output=True, text=True
        )
        return probe.stdout.strip() if probe.returncode == 0 else None

    parent = inspect(image, "{{.Parent}}")
    if subprocess.run([engine, "rmi", image], capture_output=True).returncode != 0:
        return
    while parent and inspect(parent, "{{len .RepoTags}}") == "0":
        above = inspect(parent, "{{.Parent}}")
        if subprocess.run([engine, "rmi", parent], capture_output=True).returncode != 0:
            return
        parent = above


def evict_older_images(backend, engine, image, log) -> None:
    """Remove the images of ``image``'s repository beyond the cache's kept versions,
    least recently used first (one never used by this npuforge counts as oldest)."""
    listed = subprocess.run(
        [engine, "images", "--format", "{{.Repository}}:{{.Tag}}", image.rsplit(":", 1)[0]],
        capture_output=True,
        text=True,
    )
    names = {image_marker(name): name for name in listed.stdout.split() if name != image}
    removed, busy = evict_older(list(names), lambda marker: _remove_image(engine, names[marker]))
    _report_eviction(backend, [names[m] for m in removed], [names[m] for m in busy], log)


def _prepare_container(backend, engine, repo_root, target_options, log) -> dict:
    image = image_name(backend, repo_root)
    evict_older_images(backend, engine, image, log)

    def build():
        check_free_space(backend, _image_store(engine), layer_copies=IMAGE_LAYER_COPIES)
        _build_image(backend, engine, image, repo_root, target_options, log)

    # Another checkout may be building the same image: the second waits, then reuses it.
    present = functools.partial(image_exists, engine, image)
    build_once(image_marker(image), present, build, say=_waiting_reporter(log))
    versions = _run_in_image(
        engine,
        image,
        [CONTAINER_PYTHON, "-"],
        "versions.py",
        stdin=(env_dir(backend, repo_root) / "versions.py").read_text(),
    )
    described = {
        "image": image,
        "versions": json.loads(versions),
        "debian_packages": debian_package_digest(
            _run_in_image(engine, image, DPKG_LISTING, "dpkg-query")
        ),
    }
    inputs = _image_input_labels(engine, image)
    if inputs:
        described["image_inputs"] = inputs
    return described


def _build_image(backend, engine, image, repo_root, target_options, log) -> None:
    if not image_exists(engine, BASE_IMAGE):
        build_base_image(engine, log)
    cmd = [engine, "build", "--network=host", "-t", image]
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        # pip inside the build trusts what the host's pip trusts.
        cmd += ["--volume", f"{cert}:/etc/npuforge-host-ca.crt:ro"]
        cmd += ["--build-arg", "PIP_CERT=/etc/npuforge-host-ca.crt"]
    cmd += _pip_source_args()
    cmd += ["-f", env_dir(backend, repo_root) / "Containerfile"]
    # A backend may need more than its envs/ directory (TPU-MLIR: a CPython 3.10).
    module = _backend_module(backend)
    contexts = getattr(module, "image_build_contexts", None)
    with tempfile.TemporaryDirectory(prefix=f"npuforge-{backend}-context-") as staging:
        if contexts is not None:
            named, labels = contexts(_typed(module, target_options), Path(staging))
            for name, path in named.items():
                cmd += ["--build-context", f"{name}={path}"]
            for key, value in labels.items():
                cmd += ["--label", f"{key}={value}"]
        cmd.append(env_dir(backend, repo_root))
        _run(cmd, log=log, what=f"building image {image}")


def _run_in_image(engine: str, image: str, argv, what: str, stdin=None) -> str:
    """Standard output of ``argv`` in a fresh offline container of ``image``; a failure
    says the image is broken, in one line."""
    cmd = [engine, "run", "--rm", "--network=none"] + (["-i"] if stdin is not None else [])
    ran = subprocess.run([*cmd, image, *argv], input=stdin, capture_output=True, text=True)
    if ran.returncode != 0:
        raise NpuforgeError(
            f"image {image} is broken: {what} failed: "
            + (ran.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return ran.stdout


def _image_input_labels(engine: str, image: str) -> dict:
    probe = subprocess.run(
        [engine, "image", "inspect", "--format", "{{json .Config.Labels}}", image],
        capture_output=True,
        text=True,
    )
    labels = json.loads(probe.stdout or "null") if probe.returncode == 0 else None
    return {
        key.removeprefix(INPUT_LABEL_PREFIX): value
        for key, value in sorted((labels or {}).items())
        if key.startswith(INPUT_LABEL_PREFIX)
    }


# One line per installed package, as name=version (architecture-qualified where multi-arch).
DPKG_LISTING = ["dpkg-query", "--show", "--showformat", "${binary:Package}=${Version}\n"]


def debian_package_digest(listing: str) -> dict:
    """The identity of a Debian userland: the sha256 of its sorted package=version lines.

    An image tag names the pinned inputs, but the base under them is whatever the apt
    mirror served the day it was built; this names that too.
    """
    lines = sorted({line.strip() for line in listing.splitlines() if line.strip()})
    text = "".join(f"{line}\n" for line in lines)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "count": len(lines)}


def prepare(backend, runtime, stamp_path, *, repo_root=None, target_options=None, log_path=None):
    """Build (or reuse) the toolchain environment and write its stamp JSON."""
    reason = unavailable_reason(backend, runtime, target_options)
    if reason:
        raise NpuforgeError(reason)
    stamp_path = Path(stamp_path)
    stamp_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path or stamp_path.with_suffix(".log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        described = _prepare_environment(backend, runtime, repo_root, target_options, log)
    stamp = {
        "backend": backend,
        "runtime": runtime,
        "env_hash": env_hash(backend, repo_root),
        # What rebuilds the same environment should the machine's cache lose it.
        "definition_root": str(Path(repo_root or REPO_ROOT).resolve()),
        "options": toolchain_options(backend, target_options or {}),
        **described,
    }
    write_json(stamp_path, stamp)
    return stamp


def _prepare_environment(backend, runtime, repo_root, target_options, log) -> dict:
    if runtime == "native":
        return _prepare_native(backend, repo_root, target_options, log)
    return _prepare_container(backend, runtime, repo_root, target_options, log)


def _environment_in_use(stamp: dict):
    """Hold the machine-cache entry of a stamp's environment while a job runs in it (an
    interpreter outside the cache is nobody's to evict)."""
    if stamp["runtime"] != "native":
        return entry_in_use(image_marker(stamp["image"]))
    venv = Path(stamp["python"]).parents[1]
    if venv.parent == cache_root() / "toolchains":
        return entry_in_use(venv)
    return contextlib.nullcontext()


def environment_present(stamp: dict) -> bool:
    """Whether the environment a stamp describes is still on this machine."""
    if stamp.get("runtime") == "native":
        return bool(stamp.get("python")) and Path(stamp["python"]).exists()
    engine = stamp.get("runtime")
    return bool(shutil.which(engine or "")) and image_exists(engine, stamp.get("image", ""))


# What a rebuilt environment must reproduce of its stamp to stand in for it.
DESCRIBING_KEYS = ("python", "image", "versions", "debian_packages", "image_inputs")


def _rebuild_environment(stamp: dict, stamp_path, log_path) -> None:
    """Build a stamp's environment again after the machine's cache lost it (evicted as an
    older version, or removed by hand), from this checkout's identical definition; a
    rebuild that comes out different (newer Debian packages) is refused."""
    backend, runtime = stamp["backend"], stamp["runtime"]
    again = f"rerun prepare_toolchain (delete {stamp_path}) to prepare it anew"
    root = stamp.get("definition_root")
    if "options" not in stamp or not root or env_hash(backend, root) != stamp.get("env_hash"):
        raise NpuforgeError(
            f"the {backend} toolchain that {stamp_path} names is gone from this machine and "
            f"this checkout defines another: {again}"
        )
    log_path = Path(log_path or Path(stamp_path).with_suffix(".log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"the {backend} toolchain is gone from this machine: building it again", flush=True)
    with open(log_path, "a", encoding="utf-8") as log:
        described = _prepare_environment(backend, runtime, root, stamp["options"], log)
    differs = [key for key in DESCRIBING_KEYS if described.get(key) != stamp.get(key)]
    if differs:
        raise NpuforgeError(
            f"the {backend} toolchain rebuilt for {stamp_path} differs from it "
            f"({', '.join(differs)}): {again}"
        )


def read_stamp(stamp_path) -> dict:
    try:
        return json.loads(Path(stamp_path).read_text())
    except FileNotFoundError:
        raise NpuforgeError(
            f"toolchain stamp {stamp_path} is missing: prepare the toolchain first "
            "(workflow_scripts/prepare_toolchain.py)"
        ) from None


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower():
            return line
    return lines[-1] if lines else "no output"


# personality(ADDR_NO_RANDOMIZE): jobs that need the same heap addresses every run
# (rknn-toolkit2 writes raw pointers into .rknn files) turn off address randomisation.
ADDR_NO_RANDOMIZE = 0x0040000
PODMAN_DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")


def seccomp_profile(default_profile=PODMAN_DEFAULT_SECCOMP) -> Path | None:
    """The engine's default seccomp profile plus one rule: personality(ADDR_NO_RANDOMIZE).

    Everything else the default refuses stays refused (unlike seccomp=unconfined).
    Returns None when the default profile is not on this machine.
    """
    default_profile = Path(default_profile)
    if not default_profile.is_file():
        return None
    profile = json.loads(default_profile.read_text())
    profile["syscalls"].append(
        {
            "names": ["personality"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": ADDR_NO_RANDOMIZE, "valueTwo": 0, "op": "SCMP_CMP_EQ"}],
        }
    )
    text = json.dumps(profile, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"npuforge-seccomp-{digest}.json"
    if not path.is_file():
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return path


# Container jobs never run as root: a root caller's jobs run as Debian's "nobody".
UNPRIVILEGED_UID = UNPRIVILEGED_GID = 65534


def job_user() -> tuple[int, int]:
    """The uid and gid a container job runs as: the caller's, unless the caller is root."""
    uid, gid = os.getuid(), os.getgid()
    return (UNPRIVILEGED_UID, UNPRIVILEGED_GID) if uid == 0 else (uid, gid)


def _chown_tree(paths, uid: int, gid: int) -> None:
    for top in paths:
        os.lchown(top, uid, gid)
        for parent, dirs, files in os.walk(top):
            for name in dirs + files:
                os.lchown(os.path.join(parent, name), uid, gid)


@contextlib.contextmanager
def lent_to_job_user(writable):
    """The job's writable directories (private stage directories of one job) belong to the
    job's uid while it runs, and to the caller again afterwards, whatever the outcome."""
    owner, caller = job_user(), (os.getuid(), os.getgid())
    if owner == caller:
        yield
        return
    _chown_tree(writable, *owner)
    try:
        yield
    finally:
        _chown_tree(writable, *caller)


def container_command(stamp, job_script, spec_path, *, read_only=(), writable=(), env=None):
    """The engine command line that runs one job; pure, so tests can check it."""
    engine = stamp["runtime"]
    job_script = Path(job_script).resolve()
    spec_path = Path(spec_path).resolve()
    # --init: a tiny PID 1 passes the engine's signals on; the job as PID 1 would ignore a
    # SIGTERM (no handler) and keep compiling after its step was stopped.
    cmd = [engine, "run", "--rm", "--init", "--network=none", "--tmpfs", "/tmp"]
    cmd += ["--workdir", "/tmp"]
    uid, gid = job_user()
    if engine == "podman" and os.getuid() != 0:
        cmd += ["--userns=keep-id"]
    cmd += ["--user", f"{uid}:{gid}", "-e", "HOME=/tmp"]
    profile = seccomp_profile() if engine == "podman" else None
    if profile is not None:
        cmd += ["--security-opt", f"seccomp={profile}"]
    for key, value in sorted((env or {}).items()):
        cmd += ["-e", f"{key}={value}"]
    mounts = {job_script.parent: "ro", spec_path: "ro"}
    for path in read_only:
        mounts.setdefault(Path(path).resolve(), "ro")
    for path in writable:
        mounts[Path(path).resolve()] = "rw"
    for path, mode in sorted(mounts.items()):
        cmd += ["--volume", f"{path}:{path}:{mode}"]
    cmd += [stamp["image"], CONTAINER_PYTHON, str(job_script), str(spec_path)]
    return cmd


def _run_reporting(cmd, env, cwd, what: str, *, quiet_s: float = 10.0, out=None):
    """Run ``cmd``; echo its output to ``out`` (default: stdout, the step's log) as it
    comes, and after every ``quiet_s`` seconds of silence say that it is still running and
    for how long (vendor compilers go quiet for minutes). Returns (exit code, output).

    The job writes into a regular file, read back as it grows: vendor compilers copy
    heap leftovers into their binaries, and a pipe in place of the file changes the heap
    history, hence the bytes (job_stage.py)."""
    out = out or sys.stdout
    with (
        tempfile.TemporaryFile("w+b") as captured,
        open(f"/dev/fd/{captured.fileno()}", "rb") as reader,
    ):
        # A process group of its own: stopping the job stops every process it started.
        process = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=captured,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            return _report_until_done(process, reader, out, what, quiet_s)
        except BaseException:
            # The step was stopped (SIGTERM, Ctrl-C): stop the job (a container engine
            # passes it on) rather than leave it compiling.
            _stop(process)
            raise


def _stop(process, grace_s: float = 30.0) -> None:
    """SIGTERM to the job's process group, SIGKILL after ``grace_s``."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


# The lines our jobs print to say what they are doing (qnn_job's log, tpumlir_job's
# steps and verify calls): a vendor library's warning printed after one is not the stage.
JOB_STAGE_LINE = re.compile(r"^(\[qnn_job\] |TPU-MLIR step |verify: call )")


def _report_until_done(process, reader, out, what: str, quiet_s: float):
    """Echo the job's output as it comes, and a line after every ``quiet_s`` seconds of
    silence; return (exit code, output) once it ends."""
    chunks, pending = [], b""
    start = last = time.monotonic()
    stage = ""

    def echo(data: bytes):
        nonlocal pending, stage
        pending += data
        *complete, pending = pending.split(b"\n")
        for line in complete:
            text = line.decode(errors="replace")
            out.write(text + "\n")
            if JOB_STAGE_LINE.match(text):
                stage = text.strip()[:120]
        out.flush()

    while True:
        try:
            process.wait(timeout=min(1.0, quiet_s))
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        data = reader.read()
        now = time.monotonic()
        if data:
            chunks.append(data)
            echo(data)
            last = now
        elif not finished and now - last >= quiet_s:
            said = b"".join(chunks).strip().rsplit(b"\n", 1)[-1][:120].decode(errors="replace")
            at = f"at: {stage}; " if stage and stage != said else ""
            out.write(
                f"{what} running for {now - start:.0f} s ({at}last output: {said or 'none yet'})\n"
            )
            out.flush()
            last = now
        if finished:
            break
    if pending:
        out.write(pending.decode(errors="replace") + "\n")
        out.flush()
    return process.returncode, b"".join(chunks).decode(errors="replace")


def run_job(
    stamp_path, job_script, spec_path, *, read_only=(), writable=(), env=None, log_path=None
):
    """Run ``python job_script spec_path`` in the toolchain; raise NpuforgeError on failure."""
    stamp = read_stamp(stamp_path)
    # Twice: an eviction may remove the environment between the check and the lock.
    for _ in range(2):
        if not environment_present(stamp):
            _rebuild_environment(stamp, stamp_path, log_path)
        with _environment_in_use(stamp):
            if environment_present(stamp):
                return _run_job_in(stamp, job_script, spec_path, read_only, writable, env, log_path)
    raise NpuforgeError(
        f"the {stamp['backend']} toolchain was removed again as its job started: another "
        "checkout on this machine keeps evicting it; run one build at a time"
    )


def _run_job_in(stamp, job_script, spec_path, read_only, writable, env, log_path):
    # A build tool sends nothing anywhere, and ONNX Runtime's telemetry thread would.
    env = {**job_stage.NO_TELEMETRY, **(env or {})}
    if stamp["runtime"] == "native":
        cmd = [stamp["python"], str(Path(job_script).resolve()), str(Path(spec_path).resolve())]
        full_env = {**os.environ, **env}
    else:
        for path in writable:
            Path(path).mkdir(parents=True, exist_ok=True)
        cmd = container_command(
            stamp, job_script, spec_path, read_only=read_only, writable=writable, env=env
        )
        full_env = None
    lent = writable if stamp["runtime"] in CONTAINER_RUNTIMES else ()
    # Toolkits drop debug files into their working directory: give them a scratch one.
    with (
        tempfile.TemporaryDirectory(prefix="npuforge-job-") as scratch,
        lent_to_job_user([Path(p).resolve() for p in lent]),
    ):
        returncode, output = _run_reporting(cmd, full_env, scratch, f"{stamp['backend']} job")
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {' '.join(map(str, cmd))}\n{output}")
    if returncode != 0:
        raise NpuforgeError(job_failure(stamp, returncode, output, log_path))
    return output


# What a job that ran out of memory prints (Python, glibc's loader, C++ toolkits).
OUT_OF_MEMORY = (
    "MemoryError",
    "Cannot allocate memory",
    "failed to map segment from shared object",
    "std::bad_alloc",
    "out of memory",
)


def job_failure(stamp: dict, returncode: int, output: str, log_path=None) -> str:
    """One line for a failed toolchain job: out of memory, a stop from outside (SIGTERM),
    a crash (killed by a signal: a negative exit code natively, 128 + the signal from a
    container engine), or an error."""
    import signal

    what = f"{stamp['backend']} job"
    where = f" (full log: {log_path})" if log_path else ""
    number = -returncode if returncode < 0 else 0
    if stamp.get("runtime") in CONTAINER_RUNTIMES and 128 < returncode < 128 + 65:
        number = returncode - 128
    elif returncode == 128 + signal.SIGTERM:  # a native job's own exit on SIGTERM
        number = signal.SIGTERM
    try:
        name = signal.Signals(number).name if number else None
    except ValueError:
        name = f"signal {number}"
    full = disk_full(f"{what} in the {stamp['runtime']} toolchain", output)
    if full:
        return full + where
    memory = [line.strip() for line in output.splitlines() if any(m in line for m in OUT_OF_MEMORY)]
    if memory or name == "SIGKILL":
        said = memory[-1] if memory else "killed by SIGKILL, as the kernel's OOM killer does"
        return (
            f"{what} ran out of memory in the {stamp['runtime']} toolchain ({said}); raise the "
            "target's compile_mem_mb in targets.yaml (the memory its compile jobs reserve) and "
            f"build where that much is free, or run fewer jobs at once (--cores){where}"
        )
    if name == "SIGTERM":
        return (
            f"{what} was stopped from outside (signal SIGTERM) in the {stamp['runtime']} "
            f"toolchain after: {_last_line(output)}; rerun the build to finish it{where}"
        )
    if name:
        return (
            f"{what} crashed ({name if name.startswith('signal') else f'signal {name}'}) in the "
            f"{stamp['runtime']} toolchain after: {_last_line(output)}; the vendor compiler "
            f"failed, not npuforge: rerun once, and report it with the log if it repeats{where}"
        )
    return f"{what} failed in the {stamp['runtime']} toolchain: {_last_error_line(output)}{where}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"
