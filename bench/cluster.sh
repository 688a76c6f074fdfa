#!/usr/bin/env bash
# What the cluster view costs a real Prometheus (docs/cluster.md): `bash bench/cluster.sh
# [--nodes 8 32] [--interval 15] [--window 180]`. Installs Debian's prometheus and the
# project's virtual environment when missing, then runs bench/cluster.py. Not part of the
# tests: it runs for minutes and keeps the machine busy.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_apt_packages prometheus
ensure_venv .venv ".[test]"
echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"
exec .venv/bin/python bench/cluster.py "$@"
