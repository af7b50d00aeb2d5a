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

One module per job: ``definitions`` (envs/<backend>/, runtimes, names, whether a
toolchain can run here), ``machine_cache`` (where environments live, eviction, disk
room), ``reporting`` (commands echoed as they run), ``venvs`` and ``images`` (building
each kind), ``stamps`` (preparing, reading, rebuilding), ``job_runner`` (running a
job, its container command line, its failure as one line). This package's names below
are the public ones.

This package is imported while Snakemake parses the workflow: keep it free of
heavy imports.
"""

from npuforge.toolchain.definitions import (
    BASE_IMAGE,
    CONTAINER_PYTHON,
    CONTAINER_RUNTIMES,
    REPO_ROOT,
    RUNTIMES,
    env_dir,
    env_hash,
    image_name,
    toolchain_options,
    unavailable_reason,
)
from npuforge.toolchain.images import (
    build_base_image,
    debian_package_digest,
    evict_older_images,
    image_exists,
)
from npuforge.toolchain.job_runner import (
    ADDR_NO_RANDOMIZE,
    container_command,
    job_failure,
    job_user,
    lent_to_job_user,
    run_job,
    seccomp_profile,
)
from npuforge.toolchain.machine_cache import (
    IMAGE_LAYER_COPIES,
    check_free_space,
    disk_full,
    image_marker,
    native_venv,
)
from npuforge.toolchain.stamps import environment_present, prepare, read_stamp

__all__ = [
    "ADDR_NO_RANDOMIZE",
    "BASE_IMAGE",
    "CONTAINER_PYTHON",
    "CONTAINER_RUNTIMES",
    "IMAGE_LAYER_COPIES",
    "REPO_ROOT",
    "RUNTIMES",
    "build_base_image",
    "check_free_space",
    "container_command",
    "debian_package_digest",
    "disk_full",
    "env_dir",
    "env_hash",
    "environment_present",
    "evict_older_images",
    "image_exists",
    "image_marker",
    "image_name",
    "job_failure",
    "job_user",
    "lent_to_job_user",
    "native_venv",
    "prepare",
    "read_stamp",
    "run_job",
    "seccomp_profile",
    "toolchain_options",
    "unavailable_reason",
]
