"""Finding what the TPU-MLIR toolchain needs on this host: CPython 3.10 (the native venv
gets everything else from requirements.lock) or a container base image. Cheap checks
only: the workflow runs them while it parses.
"""

import functools
import glob
import os
import shutil
import subprocess

from npuforge.errors import NpuforgeError

# Names the CPython 3.10 to build the native venv from (before PATH and pyenv).
PYTHON_ENV = "PYTHON310"
PYTHON310_IMAGE = "docker.io/library/python:3.10-slim-bookworm"


def _python_candidates():
    found = shutil.which("python3.10")
    if found:
        yield found
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    yield from sorted(glob.glob(f"{pyenv_root}/versions/3.10.*/bin/python3.10"), reverse=True)
    yield from ("/usr/local/bin/python3.10", "/usr/bin/python3.10")


def native_python(options) -> str:
    """The CPython 3.10 the native toolchain venv is built from.

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
    "TPU-MLIR needs CPython 3.10 exactly and none was found: install one (e.g. 'pyenv install "
    "3.10') and name it with $PYTHON310 (or 'python' in the target's options), or "
    "use a container runtime (toolchain_runtime=podman)"
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


def _container_reason(runtime: str, options) -> str | None:
    from npuforge import toolchain

    def exists(image):
        probe = subprocess.run(
            [runtime, "image", "inspect", image], capture_output=True, text=True, timeout=60
        )
        return probe.returncode == 0

    base = getattr(options, "python310_image", None) or PYTHON310_IMAGE
    if exists(toolchain.image_name("tpumlir")) or exists(base):
        return None
    return (
        f"the TPU-MLIR image needs a CPython 3.10 base image and {runtime} has none: "
        f"'{runtime} pull {base}' (or '{runtime} load' it where no registry is reachable), "
        "then prepare again (envs/tpumlir/Containerfile)"
    )


def unavailable_reason(runtime: str, options) -> str | None:
    """Why the TPU-MLIR toolchain cannot run here (one line, with the fix); None if it can."""
    if runtime in ("podman", "docker"):
        return _container_reason(runtime, options)
    if runtime != "native":
        return f"unknown toolchain runtime '{runtime}': choose native, podman or docker"
    try:
        python = native_python(options)
    except NpuforgeError as err:
        return str(err)
    version = _python_version(python)
    if version != "3.10":
        found = f"Python {version}" if version else "not runnable"
        return (
            f"TPU-MLIR needs CPython 3.10 exactly but {python} is {found}: name a 3.10 "
            "interpreter with $PYTHON310 (or 'python' in the target's options)"
        )
    return None
