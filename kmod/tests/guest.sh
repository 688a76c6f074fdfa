#!/bin/sh
# Runs inside the QEMU guest, chrooted into the host root (read-only over 9p): the kernel
# command line of run-qemu.sh gives nvlc_ko (the module to test) and nvlc_pytest_args.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export TMPDIR=/run PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/run PATH=/usr/sbin:/usr/bin:/sbin:/bin
export NVLC_KO="$nvlc_ko"
cd "$REPO" || exit 1
echo "guest: kernel $(uname -r), $(nproc) CPUs, module $NVLC_KO"
# shellcheck disable=SC2086 # the arguments come comma-separated from the command line
"$REPO/.venv/bin/python" -m pytest -p no:cacheprovider --color=no -q -rA --durations=6 \
	"$REPO/kmod/tests/test_guest.py" $(echo "${nvlc_pytest_args:-}" | tr ',' ' ')
rc=$?
exit $rc
