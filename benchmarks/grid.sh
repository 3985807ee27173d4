#!/usr/bin/env bash
# Benchmark of issue "No tuning": a grid of hand-tuned Pufferfish settings (warm-up epochs x rank
# ratio) next to the automatic recipe (--warmup-epochs auto --rank-ratio auto --keep auto), same
# data, epochs and seed, one process, plus the full-rank model as reference. Ends with
# `pufferfish report` over every run.
#   benchmarks/grid.sh CONFIG OUT_DIR [extra pufferfish-train flags...]
#   WARMUPS="1 2 4" RATIOS="0.125 0.25 0.5" (defaults) choose the grid; a run whose directory
#   holds a finished marker is not run again, so an interrupted grid resumes where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
config=$1; out=$2; shift 2
WARMUPS=${WARMUPS:-1 2 4}
RATIOS=${RATIOS:-0.125 0.25 0.5}
runs=()
run() {
  local name=$1; shift
  runs+=("$out/$name")
  [[ -e "$out/$name/.finished" ]] && { echo "=== $name (done before)"; return; }
  echo "=== $name"
  mkdir -p "$out"
  if .venv/bin/python -m pufferfish train --config "$config" --out "$out/$name" --overwrite \
      --no-progress "$@" \
      > "$out/$name.log" 2>&1; then
    touch "$out/$name/.finished"
  fi
  grep -E "^epoch|rror" "$out/$name.log" || true
}
run full "$@" --mode full  # the reference the grid is read against
for w in $WARMUPS; do
  for r in $RATIOS; do
    run "w$w-r$r" "$@" --mode pufferfish --warmup-epochs "$w" --rank-ratio "$r"
  done
done
run auto "$@" --mode pufferfish --warmup-epochs auto --rank-ratio auto --keep auto
.venv/bin/python -m pufferfish report "${runs[@]}" --out "$out"
