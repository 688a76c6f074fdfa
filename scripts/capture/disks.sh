#!/usr/bin/env bash
# Capture what the disks source reads (daemon/nodescope/sources/diskstats.py) from this host into a
# fixture tree laid out like a root, so that Roots.under(DEST) reads it:
#
#   proc/diskstats, proc/uptime
#   sys/block/<disk>            relative symlinks, exactly as sysfs has them
#   <disk dir>/dev, stat        and the disk's `device` link
#   NVMe: the controller's address/transport and its `device` link (PCI function); with native
#   multipath the nvme-subsystem class link and every controller of the subsystem.
#
# Only small attribute files are copied; serial numbers and other identifying files are not.
#
# usage: scripts/capture/disks.sh DEST    e.g. tests/fixtures/hosts/kvm-epyc-debian12
set -euo pipefail

dest=${1:?usage: $0 DEST_ROOT}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

# copy_file PATH: a pseudo-file's content (cat, because stat sizes of sysfs files lie).
copy_file() {
    local f=$1
    [ -r "$f" ] || return 0
    mkdir -p "$dest$(dirname "$f")"
    cat "$f" >"$dest$f"
}

# mirror_link PATH: recreate a sysfs symlink with its relative target and create the directory it
# points to, so realpath resolves inside the fixture as it does on the host.
mirror_link() {
    local link=$1 target real
    [ -L "$link" ] || return 0
    target=$(readlink "$link")
    case $target in
        /*) echo "absolute symlink $link -> $target: not mirrored" >&2; return 0 ;;
    esac
    mkdir -p "$dest$(dirname "$link")"
    ln -sfn "$target" "$dest$link"
    real=$(realpath "$link")
    mkdir -p "$dest$real"
}

# copy_controller DIR: an NVMe controller (…/nvme/nvmeN) and the PCI function it sits on.
copy_controller() {
    local ctrl=$1 p
    mkdir -p "$dest$ctrl"
    copy_file "$ctrl/address"
    copy_file "$ctrl/transport"
    mirror_link "$ctrl/device"
    # Hidden per-path namespaces (nvme<s>c<c>n<n>) say which controllers carry a shared namespace.
    for p in "$ctrl"/nvme*c*n*; do
        [ -d "$p" ] && mkdir -p "$dest$p"
    done
    return 0
}

copy_file /proc/diskstats
copy_file /proc/uptime

for entry in /sys/block/*; do
    [ -L "$entry" ] || continue
    mirror_link "$entry"
    disk=$(realpath "$entry")
    copy_file "$disk/dev"
    copy_file "$disk/stat"
    [ -L "$disk/device" ] || continue
    mirror_link "$disk/device"
    parent=$(realpath "$disk/device")
    case $(basename "$parent") in
        nvme-subsys[0-9]*)
            subsys=$(basename "$parent")
            mirror_link "/sys/class/nvme-subsystem/$subsys"
            for c in "$parent"/nvme[0-9]*; do
                case $(basename "$c") in
                    *[!0-9a-z]* | nvme*n*) continue ;;
                esac
                mirror_link "$c"
                copy_controller "$(realpath "$c")"
            done
            ;;
        nvme[0-9]*)
            copy_controller "$parent"
            ;;
    esac
done

echo "captured disks into $dest"
