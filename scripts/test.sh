#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine: system packages the tests start for real,
# a virtual environment with the project and its test extra, then ruff, mypy and pytest.
#
# pytest runs in parallel workers (pytest-xdist): NODESCOPE_TEST_WORKERS of them, by default
# three for each core, since most of an integration test's time is spent waiting on the
# servers it started. A caller's own -n, --dist or -p no:xdist wins over that.
# --fast: the fast lane, in a few minutes (see the README's Development section): the tests
# that start no real process (not marked integration) of tests/unit, tests/golden and
# tests/adversarial, with hypothesis' "fast" profile (fewer examples per property).
set -euo pipefail
# Root is needed (Debian packages, and for the tests cgroups and namespaces): started as a
# user, run again under sudo.
if [ "$(id -u)" -ne 0 ]; then exec sudo bash "$0" "$@"; fi
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_apt_packages "${TEST_APT_PACKAGES[@]}"
ensure_venv .venv ".[test,probe]"
echo "== ruff"
.venv/bin/ruff check daemon exporters tests scripts
echo "== mypy (strict)"
.venv/bin/mypy
args=()
fast=0
for arg in "$@"; do
    if [ "$arg" = --fast ]; then fast=1; else args+=("$arg"); fi
done
workers=${NODESCOPE_TEST_WORKERS:-$(( 3 * $(nproc) ))}
parallel=(-n "$workers" --dist loadgroup)
for arg in "${args[@]}"; do
    case $arg in
        -n | -n[0-9]* | -nauto | -nlogical | --numprocesses | --numprocesses=* | --dist | --dist=* \
            | no:xdist | -pno:xdist) parallel=() ;;
    esac
done
if [ $fast -eq 1 ]; then
    args=(-m "not integration" --hypothesis-profile=fast tests/unit tests/golden tests/adversarial
        "${args[@]}")
fi
echo "== pytest"
exec .venv/bin/python -m pytest "${parallel[@]}" "${args[@]}"
