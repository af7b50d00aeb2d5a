#!/usr/bin/env bash
# qemu-user for the test that runs the QNN job's calibration on an emulated CPU of another
# instruction set (tests/test_qnn.py): the Q/DQ model must not follow the host's CPU.
set -euo pipefail
if ! command -v qemu-x86_64 >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user >/dev/null
fi
qemu-x86_64 --version | head -1
