#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine: system packages the tests start for real,
# a virtual environment with the project and its test extra, then ruff, mypy and pytest.
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
echo "== pytest"
exec .venv/bin/python -m pytest "$@"
