#!/usr/bin/env bash
# Evidence of issue "Reliability" (no process aborts at exit): the comm-hook tests, the 2-process
# training tests and a short `pufferfish bench` each run N times in a row while a load process keeps
# every core busy; prints a tally of runs, failures and aborts (SIGABRT, exit 134, or "terminate
# called" in the output). Logs of failed runs are kept under --workdir.
#   benchmarks/no_abort.sh [N (30)] [--workdir DIR (/tmp/pufferfish-no-abort)]
#                          [--suites comm-hooks,training-2proc,bench (all)]
#                          [--external-load]  (another job already keeps every core busy: start
#                                              no busy processes; the load average is logged anyway)
# About 2 hours with N=30 on 2 loaded CPUs, 25 minutes for the bench alone (docs/reliability.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
N=${1:-30}
WORK=/tmp/pufferfish-no-abort
SUITES=comm-hooks,training-2proc,bench
EXTERNAL_LOAD=0
shift || true
while [ $# -gt 0 ]; do
  case $1 in
    --workdir) WORK=$2; shift 2 ;;
    --suites) SUITES=$2; shift 2 ;;
    --external-load) EXTERNAL_LOAD=1; shift ;;
    *) echo "no_abort.sh: unknown argument '$1': allowed N, --workdir DIR, --suites LIST, --external-load" >&2; exit 2 ;;
  esac
done
mkdir -p "$WORK"

# The load: one busy process per core, at normal priority, for the whole campaign (unless another
# job provides it); each round logs the 1-minute load average so the tally shows the cores were busy.
LOAD=()
if [ "$EXTERNAL_LOAD" = 0 ]; then
  for _ in $(seq "$(nproc)"); do "$PY" -c "while True: pass" & LOAD+=($!); done
  trap 'kill "${LOAD[@]}" 2>/dev/null' EXIT
fi

declare -A RUNS FAILED ABORTS
suite() {  # name, command...
  local name=$1; shift
  [[ ",$SUITES," == *",$name,"* ]] || return 0
  local log="$WORK/$name-$i.log"
  "$@" >"$log" 2>&1
  local rc=$?
  RUNS[$name]=$(( ${RUNS[$name]:-0} + 1 ))
  if [ $rc -eq 134 ] || [ $rc -eq 250 ] || grep -q "terminate called\|SIGABRT\|Signals.SIGABRT\|exitcode  *: -6" "$log"; then
    ABORTS[$name]=$(( ${ABORTS[$name]:-0} + 1 )); echo "ABORT $name #$i (rc $rc): $log"
  elif [ $rc -ne 0 ]; then
    FAILED[$name]=$(( ${FAILED[$name]:-0} + 1 )); echo "FAIL $name #$i (rc $rc): $log"
  else
    rm -f "$log"
  fi
}

start=$(date +%s)
for i in $(seq "$N"); do
  suite comm-hooks "$PY" -m pytest -q -p no:cacheprovider tests/test_comm_hooks.py tests/test_teardown.py
  suite training-2proc "$PY" -m pytest -q -p no:cacheprovider tests/test_training.py \
    -k "two_process or replicas or switch_keeps or resume_gives"
  suite bench "$PY" -m pufferfish bench --model resnet18 --width 0.25 --methods ddp,powersgd,pufferfish \
    --steps 4 --warmup 2 --compute-steps 2 --batch-size 16 --no-probe --out "$WORK/bench-out" --overwrite
  echo "round $i/$N done at $(( $(date +%s) - start )) s, load average $(cut -d' ' -f1 /proc/loadavg)"
done

echo
echo "| suite | runs | aborts | other failures |"
echo "|---|---|---|---|"
for name in ${SUITES//,/ }; do
  echo "| $name | ${RUNS[$name]:-0} | ${ABORTS[$name]:-0} | ${FAILED[$name]:-0} |"
done
if [ "$EXTERNAL_LOAD" = 0 ]; then load="$(nproc) busy processes"; else load="external"; fi
echo "load: $load; $(( $(date +%s) - start )) s in all"
