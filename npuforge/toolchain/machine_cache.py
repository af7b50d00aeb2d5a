"""The machine's cache of toolchains: where native venvs and image markers live, what
eviction reports, whether the disk holds a build, and holding an environment in use."""

import contextlib
import shutil
from pathlib import Path

from npuforge.cache import KEPT_VERSIONS, cache_root, entry_in_use
from npuforge.errors import NpuforgeError
from npuforge.toolchain.definitions import backend_module, env_hash


def native_venv(backend: str, repo_root=None) -> Path:
    """One venv per (backend, envs/<backend>/ hash) in the machine's cache."""
    return cache_root() / "toolchains" / f"{backend}-native-{env_hash(backend, repo_root)}"


def image_marker(image: str) -> Path:
    """The cache entry standing for a toolchain image: its lock file records the image's
    last use and is held while the image is built or a job runs in it."""
    return cache_root() / "images" / image.rsplit("/", 1)[-1].replace(":", "-")


def report_eviction(backend, removed, busy, log) -> None:
    for name in removed:
        log.write(f"removed an older {backend} toolchain from the machine's cache: {name}\n")
    for name in busy:
        log.write(f"kept an older {backend} toolchain that a running job uses: {name}\n")
    log.flush()


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


# What pip unpacks beside what it installs, as a share of the installed size.
BUILD_HEADROOM = 0.5


def check_free_space(backend: str, where: Path, *, layer_copies: int = 1) -> None:
    """Refuse to start a toolchain build that the disk under ``where`` cannot hold: the
    backend's measured size (``TOOLCHAIN_SIZE_MB``) ``layer_copies`` times (an image
    build holds it twice while the engine commits the container's layer) plus pip's
    headroom."""
    size_mb = getattr(backend_module(backend), "TOOLCHAIN_SIZE_MB", 0)
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


def environment_in_use(stamp: dict):
    """Hold the machine-cache entry of a stamp's environment while a job runs in it (an
    interpreter outside the cache is nobody's to evict)."""
    if stamp["runtime"] != "native":
        return entry_in_use(image_marker(stamp["image"]))
    venv = Path(stamp["python"]).parents[1]
    if venv.parent == cache_root() / "toolchains":
        return entry_in_use(venv)
    return contextlib.nullcontext()
