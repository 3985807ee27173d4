#!/usr/bin/env bash
# The llama comparison at width 1.0 (GaLore's LLaMA-60M shape, 29.5M parameters at a 4,096-token
# BPE) on one lent GPU: full rank, Pufferfish, low rank from the start and GaLore, seeds 0 and 1,
# the whole KJV for EPOCHS epochs, one process each at batch 16 (the 2 x 8 of the CPU runs), fp16
# autocast, the llama defaults otherwise (the LR `llama_lr(1.0)`, extrapolated from the widths the
# budget study measured; Pufferfish switches at a quarter of the run). Runs share the GPU, SLOTS at
# a time, in priority order (the full-rank / Pufferfish pair of each seed first); whatever still runs after DEADLINE_S seconds is stopped, so
# its metrics.jsonl holds the epochs it finished. Then summary.md: each run's last row.
#
# Usage: benchmarks/gpu_llama.sh OUT [KJV_FILE] [more pufferfish train flags...]
#   KJV_FILE: the KJV one verse a line (default: OUT/kjv.txt, written from the `bible` command
#   here, so carry it to a machine without it). EPOCHS (3), SLOTS (4), DEADLINE_S (480).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=$1; shift
mkdir -p "$out"
kjv=$out/kjv.txt
if [ $# -gt 0 ] && [ -f "$1" ]; then kjv=$1; shift; fi
if [ ! -f "$kjv" ]; then
  $PY -c "from pufferfish.data.text import load_kjv; print('\n'.join(load_kjv()))" > "$kjv.tmp"
  mv "$kjv.tmp" "$kjv"
fi
EPOCHS=${EPOCHS:-3}
SLOTS=${SLOTS:-4}
DEADLINE_S=${DEADLINE_S:-480}
common=(--model llama --width 1.0 --data "$kjv" --seq-len 128 --vocab-size 4096 --batch-size 16
        --train-subset 0 --epochs "$EPOCHS" --eval-every-steps 200 --amp --bucket-mb torch
        --checkpoint-every-epochs 0 --no-progress "$@")
jobs_in_order=("full 0" "pufferfish 0" "full 1" "pufferfish 1" "lowrank 0" "galore 0" "lowrank 1" "galore 1")

# The tokenizer is trained once, before the runs share it (its cache sits beside the corpus).
$PY -c "from pufferfish.data.bpe import load_bpe_corpus; load_bpe_corpus('$kjv', vocab_size=4096)"


start=$SECONDS
for job in "${jobs_in_order[@]}"; do
  read -r mode seed <<< "$job"
  run=$out/$mode-s$seed
  [ -f "$run/metrics.jsonl" ] && { echo "cached: $run"; continue; }
  while [ "$(jobs -rp | wc -l)" -ge "$SLOTS" ]; do wait -n || true; done
  left=$((DEADLINE_S - (SECONDS - start)))
  [ "$left" -le 30 ] && { echo "no time left for $run"; break; }
  flags=(--mode "$mode" --seed "$seed")
  [ "$mode" = pufferfish ] && flags+=(--warmup-steps 0.25)
  echo "start: $run (deadline in ${left} s)"
  timeout --signal=TERM "$left" $PY -m pufferfish train "${common[@]}" "${flags[@]}" --out "$run" \
    > "$run.log" 2>&1 &
done
wait || true

{
  echo "# benchmarks/gpu_llama.sh on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'this machine')"
  echo
  echo "| run | epochs done | val ppl | train loss | tokens/s |"
  echo "|---|---|---|---|---|"
  for job in "${jobs_in_order[@]}"; do
    read -r mode seed <<< "$job"
    f=$out/$mode-s$seed/metrics.jsonl
    [ -f "$f" ] || { echo "| $mode-s$seed | 0 | - | - | - |"; continue; }
    tail -1 "$f" | $PY -c "import json,sys; r=json.load(sys.stdin); print(f\"| $mode-s$seed | {r['epoch']} | {r['val_ppl']:.2f} | {r['train_loss']:.3f} | {r['tokens_per_s']:.0f} |\")"
  done
} > "$out/summary.md"
cat "$out/summary.md"
