#!/bin/bash
# Capture this host's files for the hang-diagnosis and hot-plug tests, laid out like a root so
# that Roots.under(DEST) reads them:
#
#   proc/locks                  with a contended lock made here: a python3 process holds a
#                               flock(2) lock on a temporary file while flock(1) waits on it
#                               (so the capture shows a real "->" waiter line), both stopped
#                               after;
#   proc/self/mountinfo, proc/self/mountstats (without the mounts below /mnt)
#   proc/<pid>/task/<tid>/{stat,wchan,comm} of the waiting flock (state S at flock_lock_inode_wait
#                               or similar) and of this shell;
#   sys/bus/pci/devices/<bdf>/uevent of every PCI function.
#
# usage: scripts/capture/hangs.sh [DEST]   (default tests/fixtures/hosts/kvm-epyc-debian12)
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$here/tests/fixtures/hosts/kvm-epyc-debian12}
work=$(mktemp -d)
holder=
waiter=
cleanup() {
    [ -n "$waiter" ] && kill "$waiter" 2>/dev/null || true
    [ -n "$holder" ] && kill "$holder" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

touch "$work/lockfile"
python3 -c 'import fcntl, sys, time
f = open(sys.argv[1], "r+"); fcntl.flock(f, fcntl.LOCK_EX); time.sleep(30)' "$work/lockfile" &
holder=$!
# wait_for PATTERN: until /proc/locks shows it (5 s at most).
wait_for() {
    local i
    for i in $(seq 50); do
        grep -q -- "$1" /proc/locks && return 0
        sleep 0.1
    done
    echo "no '$1' in /proc/locks" >&2
    exit 1
}
wait_for " $holder "
flock "$work/lockfile" true &
waiter=$!
wait_for "-> FLOCK.* $waiter "

mkdir -p "$dest/proc/self"
cat /proc/locks > "$dest/proc/locks"
# Mounts below /mnt are this machine's site-specific ones: left out.
grep -v ' /mnt/' /proc/self/mountinfo > "$dest/proc/self/mountinfo"
grep -v ' mounted on /mnt/' /proc/self/mountstats > "$dest/proc/self/mountstats"

# copy_tasks PID: the per-thread files of one process (the process itself may be gone).
copy_tasks() {
    local pid=$1 task tid
    for task in /proc/"$pid"/task/*; do
        tid=$(basename "$task")
        mkdir -p "$dest/proc/$pid/task/$tid"
        for f in stat wchan comm; do
            cat "$task/$f" > "$dest/proc/$pid/task/$tid/$f" 2>/dev/null || true
        done
    done
    cat /proc/"$pid"/comm > "$dest/proc/$pid/comm"
}
# The waiting flock(1) execs nothing: its pid is the waiter in /proc/locks.
copy_tasks "$waiter"
copy_tasks "$$"

for dev in /sys/bus/pci/devices/*; do
    bdf=$(basename "$dev")
    mkdir -p "$dest/sys/bus/pci/devices/$bdf"
    cat "$dev/uevent" > "$dest/sys/bus/pci/devices/$bdf/uevent"
done
echo "captured: locks (holder $holder, waiter $waiter), mountinfo, mountstats, tasks, uevent"
