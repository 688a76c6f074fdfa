#!/bin/sh
# Capture this machine's PCI sysfs (the files nodescope's pci source reads) as a fixture tree.
#
#   scripts/capture/pci.sh [DEST]      (default: tests/fixtures/hosts/kvm-epyc-debian12)
#
# Copies bus/pci/devices (relative symlinks as sysfs has them), the attribute files of each
# function under devices/pci*, the driver links, class/{nvme,infiniband} links, the names of
# network interfaces of each function, and devices/system/node. Run as root: unprivileged
# readers see only 64 bytes of `config`.
set -eu

SYS=${SYS:-/sys}
DEST=${1:-tests/fixtures/hosts/kvm-epyc-debian12}
OUT="$DEST/sys"

FILES="vendor device class revision subsystem_vendor subsystem_device numa_node local_cpulist
irq config current_link_speed current_link_width max_link_speed max_link_width
aer_dev_correctable aer_dev_fatal aer_dev_nonfatal aer_rootport_total_err_cor
aer_rootport_total_err_fatal aer_rootport_total_err_nonfatal power/runtime_status"

rm -rf "$OUT/bus/pci" "$OUT/class/nvme" "$OUT/class/infiniband" "$OUT/devices/system/node"
for d in "$OUT"/devices/pci*; do [ -e "$d" ] && rm -rf "$d"; done
mkdir -p "$OUT/bus/pci/devices" "$OUT/bus/pci/drivers"

for link in "$SYS"/bus/pci/devices/*; do
    bdf=$(basename "$link")
    ln -s "$(readlink "$link")" "$OUT/bus/pci/devices/$bdf"
    real=$(realpath "$link")
    rel=${real#"$SYS"/}
    mkdir -p "$OUT/$rel"
    for f in $FILES; do
        if [ -f "$real/$f" ] && [ -r "$real/$f" ]; then
            mkdir -p "$(dirname "$OUT/$rel/$f")"
            cat "$real/$f" > "$OUT/$rel/$f" 2>/dev/null || rm -f "$OUT/$rel/$f"
        fi
    done
    if [ -L "$real/driver" ]; then
        driver=$(basename "$(readlink "$real/driver")")
        mkdir -p "$OUT/bus/pci/drivers/$driver"
        ln -s "$(readlink "$real/driver")" "$OUT/$rel/driver"
    fi
    # Network interfaces of the function itself (virtio NICs hang them off a child device).
    if [ -d "$real/net" ]; then
        for iface in "$real"/net/*; do
            mkdir -p "$OUT/$rel/net/$(basename "$iface")"
        done
    fi
done

for cls in nvme infiniband; do
    [ -d "$SYS/class/$cls" ] || continue
    mkdir -p "$OUT/class/$cls"
    for entry in "$SYS/class/$cls"/*; do
        name=$(basename "$entry")
        ln -s "$(readlink "$entry")" "$OUT/class/$cls/$name"
        real=$(realpath "$entry")
        rel=${real#"$SYS"/}
        mkdir -p "$OUT/$rel"
        [ -L "$real/device" ] && ln -s "$(readlink "$real/device")" "$OUT/$rel/device"
    done
done

mkdir -p "$OUT/devices/system/node"
for f in online possible has_cpu has_memory; do
    [ -f "$SYS/devices/system/node/$f" ] && cat "$SYS/devices/system/node/$f" > "$OUT/devices/system/node/$f"
done
for node in "$SYS"/devices/system/node/node[0-9]*; do
    mkdir -p "$OUT/devices/system/node/$(basename "$node")"
    cat "$node/cpulist" > "$OUT/devices/system/node/$(basename "$node")/cpulist"
done
echo "captured PCI sysfs into $OUT"
