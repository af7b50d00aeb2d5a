"""What a toolchain is: its definition in envs/<backend>/, its runtimes and names, and
whether it can run here (cheap enough to ask while the workflow is parsed)."""

import functools
import hashlib
import importlib
import shutil
import subprocess
from pathlib import Path

from npuforge.errors import NpuforgeError

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
REPO_ROOT = Path(__file__).resolve().parents[2]
# Where the python of a toolchain image lives; every Containerfile puts its venv here.
CONTAINER_PYTHON = "/opt/toolchain/bin/python"


def env_dir(backend: str, repo_root=None) -> Path:
    return Path(repo_root or REPO_ROOT) / "envs" / backend


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


def backend_module(backend: str):
    try:
        return importlib.import_module(f"npuforge.backends.{backend}")
    except ModuleNotFoundError:
        return None


@functools.cache
def engine_problem(engine: str) -> str | None:
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
        problem = engine_problem(runtime)
        if problem:
            return problem
    module = backend_module(backend)
    check = getattr(module, "unavailable_reason", None)
    if check is not None:
        try:
            options = typed_options(module, target_options)
        except NpuforgeError as err:
            return str(err)
        return check(runtime, options)
    return None


def toolchain_options(backend: str, target_options) -> dict:
    """The part of a target's options that its backend's toolchain reads (its module's
    ``TOOLCHAIN_OPTIONS``: a native interpreter, an SDK path). One environment serves
    every target of a backend, so the rest (a SoC, a precision's float16 layers) must
    not make it look changed when another target of that backend is built."""
    module = backend_module(backend)
    names = getattr(module, "TOOLCHAIN_OPTIONS", ())
    if target_options is not None and not isinstance(target_options, dict):
        # A backend's typed options (as its tests pass them): the set ones.
        typed = vars(typed_options(module, target_options))
        target_options = {name: value for name, value in typed.items() if value is not None}
    return {name: target_options[name] for name in names if name in (target_options or {})}


def typed_options(module, target_options):
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
