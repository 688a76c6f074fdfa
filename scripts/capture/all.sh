#!/usr/bin/env bash
# Capture this machine's fixture tree, every area in the order that keeps each other's files:
# pci.sh rebuilds sys/devices/pci*, and the disk and network captures add their links below it.
#
#   scripts/capture/all.sh [DEST]      (default: tests/fixtures/hosts/kvm-epyc-debian12)
set -euo pipefail
here=$(dirname "$0")
for area in pci disks network cgroup; do
    bash "$here/$area.sh" "${1:-tests/fixtures/hosts/kvm-epyc-debian12}"
done
