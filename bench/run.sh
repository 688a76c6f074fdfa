#!/usr/bin/env bash
# nodescope's overhead benchmark (docs/performance.md): `bash bench/run.sh [ARGS]`.
# Installs what it needs when missing — Debian's prometheus-node-exporter (the comparison),
# the project's virtual environment .venv, py-spy in it (the profile phase) — then runs
# bench/run.py with ARGS (default: every phase; `--help` lists them). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_apt_packages prometheus-node-exporter
ensure_venv .venv ".[test]"
[ -x .venv/bin/py-spy ] || .venv/bin/python -m pip install -q py-spy
echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"
exec .venv/bin/python bench/run.py "$@"
