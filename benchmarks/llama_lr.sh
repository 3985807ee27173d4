#!/usr/bin/env bash
# The llama comparison per learning rate: one 2-process run per method, LR and seed, equal tokens.
# Usage: benchmarks/llama_lr.sh OUT_DIR [pufferfish train flags...]
#   e.g. LRS="0.006 0.012" benchmarks/llama_lr.sh runs/llama-lr --train-subset 0 --epochs 1
# LRS (default "0.001 0.003 0.006 0.012"), METHODS (default "full pufferfish lowrank galore") and
# SEEDS (default 0) pick the grid; a run whose metrics.jsonl exists is kept (cached), so the grid
# can grow. The model: llama width 0.25, 128-token sequences, 8 per process, 4,096-token BPE of the
# KJV, evaluated every 100 steps; Pufferfish switches at a quarter of the run.
set -euo pipefail
out=$1; shift
LRS=${LRS:-"0.001 0.003 0.006 0.012"}
METHODS=${METHODS:-"full pufferfish lowrank galore"}
SEEDS=${SEEDS:-0}
mkdir -p "$out"
for s in $SEEDS; do for lr in $LRS; do for m in $METHODS; do
  case $m in
    full|lowrank|galore) flags=(--mode "$m") ;;
    pufferfish) flags=(--mode pufferfish --warmup-steps 0.25) ;;
    *) echo "unknown method $m" >&2; exit 2 ;;
  esac
  run="$out/$m-lr$lr-s$s"
  [ -f "$run/metrics.jsonl" ] && { echo "cached: $run"; continue; }
  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m pufferfish train --model llama --data kjv --width 0.25 --seq-len 128 --vocab-size 4096 \
    --batch-size 8 --eval-every-steps 100 --bucket-mb torch "$@" "${flags[@]}" --lr "$lr" \
    --seed "$s" --threads 1 --no-progress --out "$run" > "$run.log" 2>&1 \
    || { echo "failed: $run (see $run.log)"; continue; }
  echo "done: $run $(tail -1 "$run/metrics.jsonl" | python -c 'import json,sys; r=json.load(sys.stdin); print("val_ppl", round(r["val_ppl"], 2), "epoch_time", round(r["epoch_time"]))')"
done; done; done
