#!/usr/bin/env bash
# Slurm and munge for the cluster test: tests/test_slurm.py starts its own single-node
# cluster on loopback from a temp dir and stops it, so the packages' own services
# (munge, slurmctld, slurmd on the default ports) must not start on install.
set -euo pipefail
export PATH="$PATH:/usr/sbin"
if ! command -v munged >/dev/null || ! command -v slurmctld >/dev/null; then
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
slurmctld -V
