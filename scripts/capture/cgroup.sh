#!/bin/bash
# Capture this host's cgroup v2 view for the cgroup tests: the files at the top of the v2
# hierarchy and one level below it, and /proc/self/cgroup, laid out like a root so that
# Roots.under(DEST) reads it.
#
# usage: scripts/capture/cgroup.sh [DEST]   (default tests/fixtures/hosts/<this host's name>)
#
# Only the hybrid location (<cgroupfs>/unified) and the pure v2 one (<cgroupfs> itself) are
# captured; v1 hierarchies are left out. Cgroups created by the test suite
# (nodescope-test-*) are skipped.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$here/tests/fixtures/hosts/kvm-epyc-debian12}
cgroupfs=${CGROUPFS:-/sys/fs/cgroup}

if [ -f "$cgroupfs/cgroup.controllers" ]; then
    v2=$cgroupfs
    rel=sys/fs/cgroup
elif [ -f "$cgroupfs/unified/cgroup.controllers" ]; then
    v2=$cgroupfs/unified
    rel=sys/fs/cgroup/unified
else
    echo "no cgroup v2 hierarchy under $cgroupfs" >&2
    exit 1
fi

# copy_files SRC_DIR DST_DIR: the regular files of one cgroup. Write-only files and files the
# kernel refuses to read (cgroup.procs in a threaded cgroup) are left out, as they read as
# absent on the host too.
copy_files() {
    local src=$1 dst=$2 f name
    mkdir -p "$dst"
    for f in "$src"/*; do
        [ -f "$f" ] || continue
        name=$(basename "$f")
        if ! cat "$f" > "$dst/$name" 2>/dev/null; then
            rm -f "$dst/$name"
        fi
    done
}

rm -rf "${dest:?}/$rel"
copy_files "$v2" "$dest/$rel"
for d in "$v2"/*/; do
    [ -d "$d" ] || continue
    name=$(basename "$d")
    case $name in nodescope-test-*) continue ;; esac
    copy_files "$d" "$dest/$rel/$name"
done

mkdir -p "$dest/proc/self"
cat /proc/self/cgroup > "$dest/proc/self/cgroup"
echo "captured $v2 into $dest/$rel and /proc/self/cgroup into $dest/proc/self/cgroup"
