#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine: system packages the tests start for real,
# a virtual environment with the project and its test extra, then ruff, mypy and pytest.
#
# pytest runs in parallel workers (pytest-xdist): NODESCOPE_TEST_WORKERS of them, by default
# three for each core, since most of an integration test's time is spent waiting on the
# servers it started. A caller's own -n, --dist or -p no:xdist wins over that (one pytest
# run). The tests marked alone run after the workers, in one process (see below).
# --fast: the fast lane, in a few minutes (see the README's Development section): the tests
# of tests/unit and tests/golden that start no real server (not marked integration) and take
# no more than seconds (not marked slow), with at most 10 examples of each hypothesis property.
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
# The fast lane waits on no server: one worker a core is enough there.
workers=${NODESCOPE_TEST_WORKERS:-$(( (fast ? 1 : 3) * $(nproc) ))}
parallel=(-n "$workers" --dist loadgroup)
for arg in "${args[@]}"; do
    case $arg in
        -n | -n[0-9]* | -nauto | -nlogical | --numprocesses | --numprocesses=* | --dist | --dist=* \
            | no:xdist | -pno:xdist) parallel=() ;;
    esac
done
if [ $fast -eq 1 ]; then
    args=(-m "not integration and not slow" --max-examples=10 tests/unit tests/golden "${args[@]}")
fi
echo "== pytest"
if [ ${#parallel[@]} -eq 0 ]; then
    exec .venv/bin/python -m pytest "${args[@]}"
fi
# The tests marked alone prove a bound on wall-clock time (ready within 5 s, a scrape's p99
# within 50 ms) or that the host's own directories are left as they were: they run after the
# workers, in one process with the machine to itself.
# Exit status 5 is pytest's "no tests selected": a selection without such tests, or only them.
status=0
.venv/bin/python -m pytest "${parallel[@]}" --alone-tests=later "${args[@]}" || status=$?
echo "== pytest: the tests that run alone"
alone=0
.venv/bin/python -m pytest -p no:xdist --alone-tests=only "${args[@]}" || alone=$?
if [ $status -ne 0 ] && [ $status -ne 5 ]; then exit $status; fi
if [ $alone -ne 0 ] && [ $alone -ne 5 ]; then exit $alone; fi
if [ $status -eq 5 ] && [ $alone -eq 5 ]; then exit 5; fi
exit 0
