#!/usr/bin/env bash
# The bandwidth probe on a machine with NVIDIA GPUs, every figure beside its link capacity.
#
#     scripts/gpu/probe-check.sh            # from the repository, after the README's setup
#
# Installs the probe extra (torch) into the project venv when torch is missing; torch must be
# a CUDA build there (PyPI's Linux wheels are; a +cpu wheel only measures the CPU stand-in,
# and the script says so). Runs `nodescope probe --quick` (timed: the target is 15 s on
# 8 GPUs), then the full sweep (8K..256M doubling) with what is left of two minutes, and
# prints per GPU: link, capacity, H2D and D2H peak with their fraction of the capacity (a
# healthy Gen4/Gen5 x16 link reaches about 0.8), the pair matrix with asymmetry, and the
# all-reduce busbw. Exit status: the full run's (0 passed, 1 a [probe] threshold failed).
# QUICK_JSON=FILE keeps the quick run's report there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
BUDGET=${BUDGET_SECONDS:-115}
start=$(date +%s)

if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "== installing the probe extra (torch) into $(dirname "$(dirname "$PY")")"
    "$PY" -m pip install -q -e ".[probe]"
fi
"$PY" - <<'PYEOF'
import warnings
warnings.filterwarnings("ignore")
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"== torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s) visible")
if n == 0:
    print("!! no CUDA device visible to torch: the probe will measure the CPU stand-in")
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    bdf = [getattr(p, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    print(f"   cuda:{i} {p.name} pci {bdf}")
PYEOF

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

show() {  # show REPORT.json: each figure beside the link capacity
    "$PY" - "$1" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
gb = lambda v: "-" if v is None else f"{v / 1e9:7.2f}"
fr = lambda v: "  -  " if v is None else f"{v:5.2f}"
print(f"backend={r['backend']} stand_in={r['stand_in']} quick={r['quick']}"
      f" duration={r['duration_seconds']:.1f}s passed={r['passed']}")
series = {(s["device"], s["direction"]): s for s in r["copies"]}
print(f"{'GPU':<20} {'link':<9} {'capacity':>8} {'current':>8} {'H2D':>7} {'frac':>5}"
      f" {'D2H':>7} {'frac':>5}   GB/s")
for d in r["devices"]:
    h, t = series.get((d["index"], "h2d")), series.get((d["index"], "d2h"))
    name = f"{d['index']} {d['pci_address'] or '?'}"
    print(f"{name:<20} {d['link'] or '-':<9} {gb(d['capacity_bytes_per_second']):>8}"
          f" {gb(d['current_capacity_bytes_per_second']):>8}"
          f" {gb(h and h['peak_bytes_per_second']):>7} {fr(h and h['fraction_of_capacity'])}"
          f" {gb(t and t['peak_bytes_per_second']):>7} {fr(t and t['fraction_of_capacity'])}")
for a in r["asymmetry"]:
    print(f"pair {a['a']}<->{a['b']}: bandwidth asymmetry {a['bandwidth_asymmetry']:.3f},"
          f" latency {a['latency_asymmetry']:.3f}, slower {a['slower']}"
          + ("  FLAG" if a["flagged"] else ""))
ar = r["allreduce"]
if ar:
    print(f"all-reduce {ar['backend']} x{ar['ranks']}: peak busbw"
          f" {gb(ar['peak_busbw_bytes_per_second'])} GB/s, avg {gb(ar['avg_busbw_bytes_per_second'])}")
for s in r["skipped"]:
    print(f"skipped: {s}")
for f in r["failures"]:
    print(f"FAILED: {f['message']}")
PYEOF
}

echo "== nodescope probe --quick"
q0=$(date +%s%N)
set +e
timeout 60 "$PY" -m nodescope.cli.main probe --quick --json >"$tmp/quick.json" 2>"$tmp/quick.err"
rc=$?
set -e
q1=$(date +%s%N)
echo "   exit $rc after $(( (q1 - q0) / 1000000 )) ms (target: 15 s on 8 GPUs, torch import included)"
cat "$tmp/quick.err" >&2
[ -s "$tmp/quick.json" ] && show "$tmp/quick.json"
if [ -n "${QUICK_JSON:-}" ] && [ -s "$tmp/quick.json" ]; then cp "$tmp/quick.json" "$QUICK_JSON"; fi

left=$(( BUDGET - ($(date +%s) - start) ))
if [ "$left" -lt 20 ]; then
    echo "== no time left for the full sweep ($left s)"
    exit "$rc"
fi
echo "== nodescope probe (full sweep, at most $left s)"
set +e
timeout "$left" "$PY" -m nodescope.cli.main probe --json >"$tmp/full.json" 2>"$tmp/full.err"
rc=$?
set -e
cat "$tmp/full.err" >&2
if [ -s "$tmp/full.json" ]; then
    show "$tmp/full.json"
    echo "== the table"
    "$PY" - "$tmp/full.json" <<'PYEOF'
import sys
from nodescope.model.probe import parse_report
from nodescope.probe.table import render
print(render(parse_report(open(sys.argv[1]).read())), end="")
PYEOF
else
    echo "== the full sweep gave no report (exit $rc)"
fi
echo "== total $(( $(date +%s) - start )) s, exit $rc"
exit "$rc"
