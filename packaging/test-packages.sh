#!/usr/bin/env bash
# Package test: builds both Debian packages (packaging/deb/build.sh), installs them with dpkg
# into a fresh Debian 12 root, and there
#   - runs the installed `nodescope --version` and `nodescope snapshot --json` (the root's
#     python3 and Debian packages, the vendored wheels; /proc, /sys and /dev are the host's),
#     also with only the capabilities the unit keeps,
#   - checks that DKMS built and installed nvlink_counter against the root's kernel headers,
#   - checks that the unit is enabled, `systemd-analyze verify` is silent on it and
#     `systemd-analyze security --offline=yes` scores it at or below MAX_EXPOSURE,
#   - reinstalls both packages (the upgrade path of the maintainer scripts), then purges them
#     and checks that nothing of theirs is left.
# Called by tests/integration/test_packages.py; runs alone too: bash packaging/test-packages.sh
#
# The root is debootstrap's minbase plus the packages' own Depends (read from the built .debs,
# so a dependency the code needs but the control file lacks fails here), linux-headers-amd64
# and systemd. It is made once and kept as a tar under build/pkgtest/cache (a new one when
# that package list changes); each run unpacks a fresh copy into a tmpfs, so only the first
# run needs deb.debian.org. Mounts live in a private mount namespace and vanish with it.
#
# Exit status: 0 passed, 1 failed, 77 cannot run here (not root, a tool missing).
# KEEP_ROOT=1 unpacks the root into build/pkgtest/root instead of a tmpfs and leaves it there.
# Needs (Debian): debootstrap, dpkg-dev's dpkg-deb (dpkg), util-linux (unshare), python3-pip
# or any python3 with pip (build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

MAX_EXPOSURE=${MAX_EXPOSURE:-3.0}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$repo/build/pkgtest

if [ "$(id -u)" -ne 0 ]; then
    echo "test-packages.sh: needs root (debootstrap, chroot, mounts)" >&2
    exit 77
fi
for tool in debootstrap dpkg-deb unshare chroot tar; do
    if ! command -v "$tool" >/dev/null; then
        echo "test-packages.sh: $tool is not installed" >&2
        exit 77
    fi
done

started=$SECONDS
step() { echo "== [$((SECONDS - started))s] $*"; }

step "building the packages"
rm -rf "$work/packages" "$work/out"
mkdir -p "$work/cache" "$work/out"
bash packaging/deb/build.sh "$work/packages"
debs=("$work"/packages/nodescope_*_all.deb "$work"/packages/nodescope-dkms_*_all.deb)
version=$(dpkg-deb -f "${debs[0]}" Version)

# The root's packages: each Depends' first alternative without its version, plus what the
# checks need, plus python3-ply: debootstrap does not resolve virtual packages, and
# python3-pycparser (python3-cffi's) depends on python3-ply-lex-3.10, which python3-ply provides.
include=$(for deb in "${debs[@]}"; do dpkg-deb -f "$deb" Depends; done |
    tr ',' '\n' | sed -e 's/|.*//' -e 's/(.*)//' -e 's/[[:space:]]//g' | sed '/^$/d' |
    cat - <(printf '%s\n' linux-headers-amd64 systemd python3-ply) | LC_ALL=C sort -u | paste -sd, -)
key=$(echo "$SUITE $MIRROR $include" | sha256sum | cut -c1-16)
base=$work/cache/$SUITE-$key.tar
if [ ! -f "$base" ]; then
    step "debootstrap $SUITE (minbase + $include); kept as $base"
    rm -rf --one-file-system "$work/bootstrap"
    # In its own mount namespace: debootstrap can leave the root's /proc mounted (when a
    # process started by a postinst still holds it), and the tar below must not archive it.
    unshare --mount --propagation private \
        debootstrap --variant=minbase --include="$include" "$SUITE" "$work/bootstrap" "$MIRROR" \
        >"$work/debootstrap.log" 2>&1 || {
        tail -20 "$work/debootstrap.log" >&2
        exit 1
    }
    rm -f "$work"/cache/"$SUITE"-*.tar
    tar -C "$work/bootstrap" --one-file-system -cf "$base.part" .
    mv "$base.part" "$base"
    rm -rf --one-file-system "$work/bootstrap"
fi

# What runs inside the root. Outputs go to /tmp/out there, copied to build/pkgtest/out.
cat >"$work/check.sh" <<'CHECK'
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive
version=$1 max_exposure=$2 started=$3
out=/tmp/out
mkdir -p "$out"
step() { echo "== [$((SECONDS + started))s] $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
unit=nodescoped.service
# The unit's capabilities, as setpriv spells them.
unit_caps=-all,+sys_ptrace,+dac_read_search,+syslog

install_both() {
    dpkg -i /tmp/debs/nodescope_*.deb /tmp/debs/nodescope-dkms_*.deb >"$out/dpkg-$1.log" 2>&1 ||
        { cat "$out/dpkg-$1.log"; fail "dpkg -i ($1)"; }
    grep -i "warning\|error" "$out/dpkg-$1.log" || true
}

step "dpkg -i (first installation)"
install_both install
kmod_version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"$/\1/p' /usr/src/nvlink_counter-*/dkms.conf)

step "nodescope --version"
nodescope --version | tee "$out/version.txt"
[ "$(cat "$out/version.txt")" = "nodescope ${version%-*}" ] || fail "version is not ${version%-*}"

step "nodescope snapshot --json"
nodescope snapshot --json >"$out/snapshot.json" 2>"$out/snapshot.err" ||
    { cat "$out/snapshot.err"; fail "snapshot --json"; }
# With only the unit's capabilities (CapabilityBoundingSet=), the same sources must succeed.
setpriv --bounding-set="$unit_caps" --inh-caps=-all nodescope snapshot --json \
    >"$out/snapshot-unit-caps.json" 2>"$out/snapshot-unit-caps.err" ||
    { cat "$out/snapshot-unit-caps.err"; fail "snapshot --json with the unit's capabilities"; }
python3 - "$out/snapshot.json" "$out/snapshot-unit-caps.json" <<'PY'
import json, sys
full, capped = (json.load(open(path)) for path in sys.argv[1:])
def states(snapshot):
    return {name: source["ok"] for name, source in snapshot["sources"].items()}
for name, ok in sorted(states(full).items()):
    error = full["sources"][name]["error"]
    print(f"  {name:12} {'ok' if ok else 'down: ' + str(error)}")
# No NVIDIA driver in CI: nvml may be down; every other source reads the host's files.
down = [name for name, ok in states(full).items() if not ok and name != "nvml"]
if down:
    sys.exit(f"FAIL: sources down: {down}")
if states(capped) != states(full):
    sys.exit(f"FAIL: with the unit's capabilities: {states(capped)} != {states(full)}")
PY

step "the unit's capabilities read a job's /proc/<pid>/environ, and need CAP_SYS_PTRACE for it"
setpriv --reuid=65534 --regid=65534 --clear-groups env -i NCCL_IB_HCA=mlx5_0 sleep 60 &
job=$!
trap 'kill "$job" 2>/dev/null || true' EXIT
sleep 0.2
setpriv --bounding-set="$unit_caps" --inh-caps=-all cat "/proc/$job/environ" |
    tr '\0' '\n' | grep -qx NCCL_IB_HCA=mlx5_0 || fail "environ unreadable with $unit_caps"
if setpriv --bounding-set=-all,+dac_read_search,+syslog --inh-caps=-all \
    cat "/proc/$job/environ" >/dev/null 2>&1; then
    fail "environ readable without CAP_SYS_PTRACE: the unit keeps a capability it does not need"
fi
kill "$job"
wait "$job" 2>/dev/null || true

step "Slurm hooks"
for hook in /usr/lib/nodescope/slurm/*; do
    [ -e "$hook" ] || continue
    [ -x "$hook" ] || fail "$hook is not executable"
    grep -qx 'NODESCOPE=/usr/bin/nodescope' "$hook" || fail "$hook does not call /usr/bin/nodescope"
    echo "  $hook"
done
if [ -e /usr/lib/nodescope/slurm/prolog ]; then
    nodescope slurm --help >/dev/null || fail "the hooks' command, nodescope slurm, is missing"
fi
if [ -e /usr/lib/nodescope/slurm/health ]; then
    nodescope slurm health --help >/dev/null || fail "nodescope slurm health is missing"
fi

step "DKMS built nvlink_counter against the root's headers"
kernels=$(for build in /lib/modules/*/build; do [ -e "$build/Makefile" ] && basename "${build%/build}"; done)
[ -n "$kernels" ] || fail "no kernel headers in the root"
dkms status | tee "$out/dkms-status.txt"
for kernel in $kernels; do
    grep -q "^nvlink_counter/$kmod_version, $kernel, [^:]*: installed" "$out/dkms-status.txt" ||
        fail "dkms status: nvlink_counter/$kmod_version not installed for $kernel"
    ko=$(find "/lib/modules/$kernel/updates/dkms" -name 'nvlink_counter.ko*' | head -1)
    [ -n "$ko" ] || fail "no nvlink_counter.ko under /lib/modules/$kernel/updates/dkms"
    vermagic=$(modinfo -F vermagic "$ko")
    echo "  $ko: vermagic $vermagic"
    case $vermagic in "$kernel "*) ;; *) fail "$ko was built for another kernel" ;; esac
done

step "the unit is enabled (no systemd runs here to start it)"
[ -L /etc/systemd/system/multi-user.target.wants/$unit ] || fail "$unit is not enabled"

step "systemd-analyze verify"
systemd-analyze verify /usr/lib/systemd/system/$unit >"$out/verify.txt" 2>&1 ||
    { cat "$out/verify.txt"; fail "systemd-analyze verify failed"; }
if [ -s "$out/verify.txt" ]; then
    cat "$out/verify.txt"
    fail "systemd-analyze verify is not silent"
fi

step "systemd-analyze security --offline=yes"
systemd-analyze security --offline=yes $unit >"$out/security.txt" 2>&1 || true
grep -v '^  ✓\|^✓' "$out/security.txt" | sed -n '2,$p'
score=$(sed -n "s/.*Overall exposure level for $unit: \([0-9.]*\).*/\1/p" "$out/security.txt")
[ -n "$score" ] || { cat "$out/security.txt"; fail "no exposure score"; }
echo "exposure score of $unit: $score (at most $max_exposure)"
awk -v s="$score" -v m="$max_exposure" 'BEGIN { exit !(s <= m) }' ||
    fail "exposure $score is over $max_exposure"

step "dpkg -i again (the upgrade path of the maintainer scripts)"
install_both upgrade
[ -L /etc/systemd/system/multi-user.target.wants/$unit ] || fail "$unit not enabled after upgrade"
grep -q "installed" <(dkms status nvlink_counter/"$kmod_version") || fail "dkms after upgrade"
nodescope --version >/dev/null

step "disabled by the operator, the unit stays disabled across an upgrade"
systemctl disable --quiet $unit
install_both upgrade-disabled
[ ! -e /etc/systemd/system/multi-user.target.wants/$unit ] || fail "upgrade re-enabled $unit"

step "dpkg --purge"
dpkg --purge nodescope nodescope-dkms >"$out/dpkg-purge.log" 2>&1 ||
    { cat "$out/dpkg-purge.log"; fail "dpkg --purge"; }
left=""
for path in /usr/lib/nodescope /etc/nodescope /var/lib/nodescope /usr/bin/nodescope \
    /usr/lib/systemd/system/$unit /etc/systemd/system/multi-user.target.wants/$unit \
    /usr/src/nvlink_counter-$kmod_version /var/lib/dkms/nvlink_counter; do
    [ ! -e "$path" ] && [ ! -L "$path" ] || left="$left $path"
done
for kernel in $kernels; do
    ko=$(find "/lib/modules/$kernel" -name 'nvlink_counter.ko*' | head -1)
    [ -z "$ko" ] || left="$left $ko"
done
[ -z "$left" ] || fail "left after purge:$left"
echo "purged: nothing left"
CHECK

# The root is a tmpfs in a private mount namespace (unless KEEP_ROOT=1 asks for a directory
# to look into afterwards): unpacking is fast, and it vanishes with the namespace however the
# checks end.
root=$work/root
rm -rf --one-file-system "$root"
mkdir -p "$root"
step "unpacking a fresh root and checking inside it"
status=0
# shellcheck disable=SC2016  # the inner script expands its own positional arguments
unshare --mount --propagation private /bin/bash -euc '
    root=$1 base=$2 work=$3 keep=$4
    shift 4
    [ -n "$keep" ] || mount -t tmpfs -o mode=755 nodescope-pkgtest "$root"
    tar -C "$root" -xf "$base"
    mkdir -p "$root/tmp/debs"
    cp "$work"/packages/*.deb "$root/tmp/debs/"
    cp "$work/check.sh" "$root/tmp/check.sh"
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    mount -t tmpfs -o mode=755 tmpfs "$root/run"
    status=0
    chroot "$root" /bin/bash /tmp/check.sh "$@" || status=$?
    cp -r "$root/tmp/out/." "$work/out/" 2>/dev/null || true
    exit "$status"
' check "$root" "$base" "$work" "${KEEP_ROOT:-}" \
    "$version" "$MAX_EXPOSURE" "$((SECONDS - started))" || status=$?
[ -n "${KEEP_ROOT:-}" ] || rmdir "$root"
if [ "$status" -eq 0 ]; then
    step "done: passed"
else
    step "done: FAILED${KEEP_ROOT:+ (root kept in $root)}; outputs in $work/out"
fi
exit "$status"
