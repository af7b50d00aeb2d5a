#!/usr/bin/env bash
# Install and configure rootful podman the way it works on our build machines:
# runc as the OCI runtime and explicit ulimits (the defaults fail inside our sandbox).
set -euo pipefail
# catatonit: the init that `podman run --init` puts before each job (signals reach it).
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null \
   || [ ! -x /usr/libexec/podman/catatonit ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap catatonit >/dev/null
fi
mkdir -p /etc/containers/containers.conf.d
cat > /etc/containers/containers.conf.d/50-npuforge.conf <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
CONF
podman info --format '{{.Host.OCIRuntime.Name}}' >/dev/null
