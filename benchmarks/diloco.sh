#!/usr/bin/env bash
# DiLoCo against DDP, PowerSGD and Pufferfish: one 2-process run per method on loopback
# (time to a target loss over slower links comes from these curves, see benchmarks/diloco_tta.py).
# Usage: benchmarks/diloco.sh OUT_DIR [pufferfish train flags...]
#   e.g. benchmarks/diloco.sh runs/diloco-lm --config configs/transformer_kjv.toml --width 0.5
# METHODS (default: all below) picks some; H (default 10) is DiLoCo's --inner-steps.
set -euo pipefail
out=$1; shift
H=${H:-10}
METHODS=${METHODS:-"ddp powersgd pufferfish diloco pufferfish+diloco pufferfish+diloco-project"}
for m in $METHODS; do
  case $m in
    ddp) flags=(--mode full) ;;
    powersgd) flags=(--mode full --comm powersgd) ;;
    pufferfish) flags=(--mode pufferfish) ;;
    diloco) flags=(--mode full --sync diloco --inner-steps "$H") ;;
    pufferfish+diloco) flags=(--mode pufferfish --sync diloco --inner-steps "$H") ;;
    pufferfish+diloco-project) flags=(--mode pufferfish --sync diloco --inner-steps "$H"
                                      --outer-switch-momentum project) ;;
    *) echo "unknown method $m" >&2; exit 2 ;;
  esac
  [ -f "$out/$m/metrics.jsonl" ] && { echo "cached: $out/$m"; continue; }
  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m pufferfish train "$@" "${flags[@]}" --threads 1 --no-progress --out "$out/$m" \
    > "$out-$m.log" 2>&1 || { echo "failed: $m (see $out-$m.log)"; continue; }
  echo "done: $m"
done
