#!/usr/bin/env bash
# Build the Debian bookworm base image that every toolchain Containerfile starts FROM,
# without a container registry: debootstrap from the apt mirror this machine already uses,
# then import the root filesystem.
#   usage: build-base-image.sh [podman|docker] [image-name]
# With registry access the ordinary route is simply:
#   podman pull docker.io/library/debian:bookworm-slim
#   podman tag docker.io/library/debian:bookworm-slim localhost/npuforge-base:bookworm
set -euo pipefail
engine=${1:-podman}
image=${2:-localhost/npuforge-base:bookworm}

mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  # The first Debian archive URI that apt is configured with (deb822 or one-line format).
  mirror=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
fi
if [ -z "$mirror" ]; then
  mirror=$(grep -hsE '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -n1 || true)
fi
if [ -z "$mirror" ]; then
  echo "error: no Debian mirror configured for apt; set DEBIAN_MIRROR=<url> and retry" >&2
  exit 2
fi
command -v debootstrap >/dev/null || { echo "error: debootstrap is not installed: apt-get install debootstrap" >&2; exit 2; }

rootfs=$(mktemp -d /var/tmp/npuforge-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror"
# Same mirror inside the image, so Containerfiles can apt-get install.
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" > "$rootfs/etc/apt/sources.list"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar --numeric-owner -C "$rootfs" -c . | "$engine" import - "$image"
