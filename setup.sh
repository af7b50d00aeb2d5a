#!/usr/bin/env bash
# Create .venv (Python 3.11) from the pinned main environment and install npuforge
# editable. Safe to rerun: packages are reinstalled only when the lock changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

lock=envs/main/requirements.lock
cluster_lock=envs/cluster/requirements.lock
python=${PYTHON:-python3.11}
if ! command -v "$python" >/dev/null; then
    python=python3
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "error: setup.sh needs Python 3.11 ($python is $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
    exit 2
fi

# Vendor targets build in their toolchain images by default (toolchain_runtime: auto):
# as root on a Debian-like machine without podman, install it the way our images need
# (envs/base/setup-podman.sh: podman, runc, debootstrap, ulimits). NPUFORGE_NO_PODMAN=1 skips it.
if [ "$(id -u)" = 0 ] && [ -z "${NPUFORGE_NO_PODMAN:-}" ] && command -v apt-get >/dev/null \
    && ! command -v podman >/dev/null; then
    echo "installing rootful podman for the toolchain images (envs/base/setup-podman.sh; NPUFORGE_NO_PODMAN=1 skips it)"
    bash envs/base/setup-podman.sh
fi

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi

stamp=.venv/.npuforge-lock.sha256
wanted=$(sha256sum "$lock" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/python -m pip install --quiet -r "$lock"
    .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
    echo "$wanted" >"$stamp"
fi

# Where Slurm is installed, the executor plugin for profiles/slurm goes in its own
# directory, used through PYTHONPATH=.venv/cluster: Snakemake imports every executor
# plugin it can see on each run, and this one imports pandas and runs `which sacct`.
# Its dependencies are all in the main lock, hence --no-deps.
cluster_stamp=.venv/cluster/.npuforge-lock.sha256
if command -v sbatch >/dev/null \
    && [ "$(cat "$cluster_stamp" 2>/dev/null)" != "$(sha256sum <"$cluster_lock")" ]; then
    rm -rf .venv/cluster
    .venv/bin/python -m pip install --quiet --no-deps --target .venv/cluster -r "$cluster_lock"
    sha256sum <"$cluster_lock" >"$cluster_stamp"
    echo "Slurm executor plugin ready: PYTHONPATH=.venv/cluster .venv/bin/snakemake --workflow-profile profiles/slurm"
fi
echo "npuforge environment ready: .venv ($(.venv/bin/python --version))"
