"""Stamps: the JSON that names a prepared toolchain. Preparing one builds (or reuses) its
environment; a stamp whose environment the machine's cache lost is rebuilt from the same
definition, or refused."""

import json
import shutil
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import write_json
from npuforge.toolchain.definitions import (
    REPO_ROOT,
    env_hash,
    toolchain_options,
    unavailable_reason,
)
from npuforge.toolchain.images import image_exists, prepare_container
from npuforge.toolchain.venvs import prepare_native


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
        return prepare_native(backend, repo_root, target_options, log)
    return prepare_container(backend, runtime, repo_root, target_options, log)


def environment_present(stamp: dict) -> bool:
    """Whether the environment a stamp describes is still on this machine."""
    if stamp.get("runtime") == "native":
        return bool(stamp.get("python")) and Path(stamp["python"]).exists()
    engine = stamp.get("runtime")
    return bool(shutil.which(engine or "")) and image_exists(engine, stamp.get("image", ""))


# What a rebuilt environment must reproduce of its stamp to stand in for it.
DESCRIBING_KEYS = ("python", "image", "versions", "debian_packages", "image_inputs")


def rebuild_environment(stamp: dict, stamp_path, log_path) -> None:
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
