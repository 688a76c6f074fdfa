#!/usr/bin/env bash
# Capture what the network sources read from sysfs into a fixture tree laid out like a root, so
# that Roots.under(DEST) reads it:
#
#   sys/class/net/<if>              relative symlinks, exactly as sysfs has them
#   <if dir>/device                 the interface's `device` link (netdev source: PCI function)
#   sys/class/infiniband/<dev>      when present: the RDMA device link, its `device` link and
#                                   the small attribute and counter files of every port
#
# Interface counters and states come over rtnetlink, not from files, so they are not captured.
#
# usage: scripts/capture/network.sh DEST    e.g. tests/fixtures/hosts/kvm-epyc-debian12
set -euo pipefail

dest=${1:?usage: $0 DEST_ROOT}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

# copy_file PATH: a pseudo-file's content (cat, because stat sizes of sysfs files lie).
copy_file() {
    local f=$1
    [ -f "$f" ] && [ -r "$f" ] || return 0
    mkdir -p "$dest$(dirname "$f")"
    cat "$f" >"$dest$f" 2>/dev/null || rm -f "$dest$f"
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

for entry in /sys/class/net/*; do
    [ -L "$entry" ] || continue
    mirror_link "$entry"
    mirror_link "$(realpath "$entry")/device"
done

if [ -d /sys/class/infiniband ]; then
    for entry in /sys/class/infiniband/*; do
        [ -L "$entry" ] || continue
        mirror_link "$entry"
        dev=$(realpath "$entry")
        mirror_link "$dev/device"
        for f in node_guid fw_ver hca_type board_id "$dev"/hw_counters/*; do
            copy_file "$dev/${f#"$dev/"}"
        done
        for port in "$dev"/ports/*; do
            for f in state phys_state rate link_layer; do
                copy_file "$port/$f"
            done
            for f in "$port"/counters/* "$port"/hw_counters/*; do
                copy_file "$f"
            done
        done
    done
fi

echo "captured network into $dest"
