#!/usr/bin/env bash
# Create .venv (Python 3.11) from the pinned main environment and install npuforge
# editable. Safe to rerun: packages are reinstalled only when the lock changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

lock=envs/main/requirements.lock
# Where Slurm is installed, the executor plugin for profiles/slurm too.
locks=("$lock")
if command -v sbatch >/dev/null; then
    locks+=(envs/cluster/requirements.lock)
fi
python=${PYTHON:-python3.11}
if ! command -v "$python" >/dev/null; then
    python=python3
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "error: setup.sh needs Python 3.11 ($python is $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
    exit 2
fi

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi

stamp=.venv/.npuforge-lock.sha256
wanted=$(sha256sum "${locks[@]}" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    for each in "${locks[@]}"; do
        .venv/bin/python -m pip install --quiet -r "$each"
    done
    .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
    echo "$wanted" >"$stamp"
fi
echo "npuforge environment ready: .venv ($(.venv/bin/python --version))"
