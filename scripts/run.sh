#!/usr/bin/env bash
# Run the nodescope daemon on this machine, serving /metrics on 127.0.0.1:9839 (see README).
# Creates or refreshes its own virtual environment. Extra arguments go to `nodescope run`.
set -euo pipefail
# Root is needed (Debian packages, and for the tests cgroups and namespaces): started as a
# user, run again under sudo.
if [ "$(id -u)" -ne 0 ]; then exec sudo bash "$0" "$@"; fi
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_venv .venv-run "."
exec .venv-run/bin/nodescope run "$@"
