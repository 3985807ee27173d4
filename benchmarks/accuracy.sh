#!/usr/bin/env bash
# Accuracy benchmark of issue "The main job": full-rank vs Pufferfish vs low-rank from the start
# (the paper's no-warm-up ablation), same data, epochs and seed, 2 processes under torchrun.
#   benchmarks/accuracy.sh CONFIG OUT_DIR [extra pufferfish-train flags...]
# Example (docs/benchmarks.md):
#   benchmarks/accuracy.sh configs/resnet18_fashion.toml runs/bench-resnet18 --train-subset 8000 ...
set -euo pipefail
cd "$(dirname "$0")/.."
config=$1; out=$2; shift 2
MODES=${MODES:-full pufferfish lowrank}
export OMP_NUM_THREADS=1
for mode in $MODES; do
  echo "=== $mode"
  .venv/bin/python -m torch.distributed.run --nproc-per-node 2 --master-port $((29500 + RANDOM % 1000)) \
    -m pufferfish train --config "$config" --mode "$mode" --out "$out/$mode" --overwrite \
    --no-progress "$@" 2>&1 \
    | grep -E "^epoch|^parameters|^MACs|error" || true
done
runs=(); for mode in $MODES; do runs+=("$out/$mode"); done
.venv/bin/python -m pufferfish report "${runs[@]}" --out "$out"
