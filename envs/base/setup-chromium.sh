#!/usr/bin/env bash
# Headless Chromium for the report test (tests/test_report.py opens report.html in it).
set -euo pipefail
if ! command -v chromium >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
chromium --version
