#!/usr/bin/env bash
# Every check of nodescope that needs a real NVIDIA GPU, in one run, its results in $OUT.
#
#     bash scripts/gpu/wheels.sh                       # first, where PyPI answers (.whl/)
#     OUT=/some/dir bash scripts/gpu/device-check.sh   # on the GPU machine, from this tree
#
# Runs from the tree itself with that machine's Python (python3; PYTHON picks another), after
# installing the wheels in .whl/ (WHEELS: another directory), if any, into a directory of its
# own. Each step has its own time limit and the next runs whatever it found; $OUT gets eight
# files:
#
#   log.txt          what every step printed: the machine (nvidia-smi, Python, packages), and
#                    each step's exit status and wall time
#   nvml-check.json  every NVML call the nvml source makes, per GPU: answer or error, and its
#                    cost (median of COST_REPEAT calls, microseconds)
#   nvml-source.txt  the nvml source itself over real NVML, every pynvml call traced
#   snapshot.json    `nodescope snapshot --json`: every source read twice, with rates
#   summary.json     `nodescope run` for RUN_SECONDS: CPU ms per cycle, RSS, series, sources
#   metrics.txt      the /metrics scraped at the end of that run
#   probe.json       `nodescope probe --quick --json` (its wall time is in log.txt)
#   probe-check.txt  the probe's figures beside each link's capacity, quick and full sweep
#
# The whole run takes about four minutes on one GPU. Exit status 0 when every step did.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-check-out}
PY=${PYTHON:-python3}
COST_REPEAT=${COST_REPEAT:-100}
RUN_SECONDS=${RUN_SECONDS:-30}
PROBE_BUDGET=${PROBE_BUDGET:-110}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
failed=0

say() { echo "$*" | tee -a "$LOG"; }

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/nodescope-site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/daemon:$PWD/exporters${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# step NAME LIMIT OUTFILE COMMAND...: run with a time limit, stdout to OUTFILE, stderr to the
# log; say how it ended.
step() {
    local name=$1 limit=$2 target=$3
    shift 3
    say "== $name: $*"
    local start end rc
    start=$(date +%s%N)
    timeout "$limit" "$@" >"$target" 2>>"$LOG"
    rc=$?
    end=$(date +%s%N)
    say "== $name: exit $rc after $(((end - start) / 1000000)) ms"
    [ "$rc" -eq 0 ] || failed=1
    return 0
}

say "== machine: $(uname -srm); $("$PY" --version 2>&1); $(date -u +%FT%TZ)"
{ nvidia-smi || echo "nvidia-smi: not found or failed"; } 2>&1 | head -30 >>"$LOG"
"$PY" -m pip list 2>/dev/null | grep -Ei '^(nvidia-ml-py|torch|psutil|cffi|pyudev|pyyaml) ' \
    >>"$LOG"

step nvml-check 480 "$OUT/nvml-check.json" \
    "$PY" scripts/gpu/nvml-check.py --json --cost "$COST_REPEAT"
step nvml-source 130 "$OUT/nvml-source.txt" "$PY" scripts/gpu/nvml-check.py --source
step snapshot 90 "$OUT/snapshot.json" "$PY" -m nodescope.cli.main snapshot --json
step run $((RUN_SECONDS + 120)) "$OUT/summary.json" \
    "$PY" scripts/gpu/daemon-check.py --seconds "$RUN_SECONDS" --metrics "$OUT/metrics.txt"
# probe-check.sh gives the quick run up to 60 s whatever its budget (the budget bounds the full
# sweep), after a torch import of its own: the step's limit leaves room for both, or a slow
# quick run (a loaded machine, a cold torch import) is cut off before it writes probe.json.
probe_limit=$(((PROBE_BUDGET > 60 ? PROBE_BUDGET : 60) + 40))
step probe-check "$probe_limit" "$OUT/probe-check.txt" \
    env PYTHON="$PY" BUDGET_SECONDS="$PROBE_BUDGET" QUICK_JSON="$OUT/probe.json" \
    bash scripts/gpu/probe-check.sh
grep -E "^   exit .* ms" "$OUT/probe-check.txt" | sed 's/^ */== probe --quick: /' | tee -a "$LOG"

say "== done: $(ls "$OUT" | tr '\n' ' ')"
exit "$failed"
