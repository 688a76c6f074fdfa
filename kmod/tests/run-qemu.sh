#!/usr/bin/env bash
# Build nvlink_counter.ko against Debian's kernel headers with warnings as errors, boot the
# matching Debian kernel under QEMU (TCG) with the host root shared read-only over 9p, load
# the module in the guest and run kmod/tests/test_guest.py there with the project's .venv.
#
# Fake registers for the mmio source: an ivshmem-plain device whose BAR2 is a file under
# /dev/shm that kmod/tests/host_registers.py (a host process) keeps writing.
#
# Needs root and: linux-headers-amd64 qemu-system-x86 busybox-static kmod cpio gcc make
# libc6-dev. Exit status 0 only when the guest printed "=== GUEST_RC=0" and the console shows
# no BUG:, WARNING: or Call Trace (QEMU itself exits 0 even when the guest panics).
#
# Environment: NVLC_WORK (work dir, default build/kmod), NVLC_TIMEOUT (guest seconds, 240),
# NVLC_PYTEST_ARGS (extra pytest arguments in the guest, e.g. "-k abi").
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${NVLC_WORK:-$REPO/build/kmod}
TIMEOUT=${NVLC_TIMEOUT:-240}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
LOG=$WORK/console.log

log() { echo "== run-qemu: $*" >&2; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

KVER=$(dpkg-query -W -f='${Depends}' linux-headers-amd64 | grep -o 'linux-headers-[^ ,]*' |
	head -1 | sed 's/^linux-headers-//')
KDIR=/usr/src/linux-headers-$KVER
[ -d "$KDIR" ] || { log "no headers at $KDIR"; exit 2; }

# 1. The module, built outside the source tree so the checkout stays clean.
t0=$(date +%s.%N)
rm -rf "$WORK/module"
mkdir -p "$WORK/module"
cp -r "$REPO/kmod/Kbuild" "$REPO/kmod/Makefile" "$REPO/kmod/include" "$REPO"/kmod/*.c \
	"$REPO"/kmod/*.h "$WORK/module/"
make -s -C "$WORK/module" KDIR="$KDIR" W=1 NVLC_EXTRA_CFLAGS=-Werror >"$WORK/build.log" 2>&1 || {
	cat "$WORK/build.log" >&2
	log "module build failed"
	exit 1
}
# -Werror turns any compiler warning into a failure above; the log must hold none either.
if grep -E 'warning:' "$WORK/build.log" >&2; then
	log "module build printed warnings"
	exit 1
fi
log "built nvlink_counter.ko against $KVER in $(since "$t0") s"

# 2. The matching kernel image, downloaded once (installing it would drag in initramfs-tools).
KROOT=$WORK/kernel-$KVER
if [ ! -f "$KROOT/boot/vmlinuz-$KVER" ]; then
	mkdir -p "$WORK/cache"
	if ! ls "$WORK/cache/linux-image-${KVER}_"*.deb >/dev/null 2>&1; then
		(cd "$WORK/cache" && apt-get download "linux-image-$KVER" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2)
	fi
	rm -rf "$KROOT.tmp"
	dpkg-deb -x "$WORK/cache/linux-image-${KVER}_"*.deb "$KROOT.tmp"
	depmod -b "$KROOT.tmp" "$KVER"
	mv "$KROOT.tmp" "$KROOT"
fi

# 3. A busybox initramfs: virtio/9p modules in dependency order and an /init that mounts the
#    host root and runs the guest script in a chroot.
INITRD=$WORK/initrd.cpio.gz
IR=$WORK/initramfs
rm -rf "$IR"
mkdir -p "$IR"/{bin,proc,sys,dev,host,modules}
cp /bin/busybox "$IR/bin/busybox"
for m in virtio_pci 9pnet_virtio 9p; do modprobe -d "$KROOT" -S "$KVER" --show-depends "$m"; done |
	awk '$1 == "insmod" {print $2}' | awk '!seen[$0]++' >"$WORK/modules.list"
: >"$IR/modules.order"
while read -r ko; do
	cp "$ko" "$IR/modules/"
	basename "$ko" >>"$IR/modules.order"
done <"$WORK/modules.list"
cat >"$IR/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod "/modules/$m" || echo "insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /host
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mount -t tmpfs run /host/run
mkdir -p /host/dev/shm
mount -t tmpfs shm /host/dev/shm
echo "=== GUEST_START $(cut -d' ' -f1 /proc/uptime)"
chroot /host /bin/sh "$guest_script"
rc=$?
echo "=== GUEST_RC=$rc"
poweroff -f
EOF
chmod 755 "$IR/init"
(cd "$IR" && find . | cpio -o -H newc --quiet | gzip -1) >"$INITRD"

# 4. Fake registers: a shared-memory file that a host process writes and the guest maps.
SHM=/dev/shm/nvlc-regs-$$
truncate -s 1M "$SHM"
PY=$REPO/.venv/bin/python
[ -x "$PY" ] || PY=python3
"$PY" "$REPO/kmod/tests/host_registers.py" "$SHM" >"$WORK/host_registers.log" 2>&1 &
WRITER=$!
cleanup() {
	kill "$WRITER" 2>/dev/null || true
	wait "$WRITER" 2>/dev/null || true
	rm -f "$SHM"
}
trap cleanup EXIT

# 5. Boot. /dev/kvm exists here but nested KVM does not work: always TCG.
log "booting $KVER under TCG (timeout ${TIMEOUT}s)"
t0=$(date +%s.%N)
set +e
timeout "$TIMEOUT" qemu-system-x86_64 \
	-accel tcg -machine pc -cpu max -smp 2 -m 1536 \
	-kernel "$KROOT/boot/vmlinuz-$KVER" -initrd "$INITRD" \
	-append "console=ttyS0 panic=-1 oops=panic panic_on_warn=1 slub_debug=FZPU guest_script=$REPO/kmod/tests/guest.sh nvlc_ko=$WORK/module/nvlink_counter.ko nvlc_pytest_args=$(echo "${NVLC_PYTEST_ARGS:-}" | tr " " ",")" \
	-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
	-object memory-backend-file,id=hw,size=1M,mem-path="$SHM",share=on \
	-device ivshmem-plain,memdev=hw \
	-nic none -nographic -no-reboot </dev/null 2>&1 | tee "$LOG"
qrc=${PIPESTATUS[0]}
set -e
log "qemu exited $qrc after $(since "$t0") s"

# 6. Verdict from the console.
status=0
if [ "$qrc" -ne 0 ]; then
	log "qemu failed or timed out (status $qrc)"
	status=1
fi
if grep -nE 'BUG:|WARNING:|Call Trace' "$LOG" >&2; then
	log "kernel console shows a BUG, WARNING or Call Trace"
	status=1
fi
if ! grep -q '^=== GUEST_RC=0' "$LOG"; then
	log "no success marker (=== GUEST_RC=0) on the console"
	status=1
fi
exit $status
