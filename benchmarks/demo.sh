#!/usr/bin/env bash
# The main job: ResNet-18 (width 0.25) on real Fashion-MNIST, 2 processes under torchrun (gloo),
# full-rank DDP and Pufferfish side by side, then the comparison table. About 10 minutes on 2 CPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
PF=".venv/bin/python -m"
OUT=${OUT:-runs/demo}
COMMON=(--config configs/resnet18_fashion.toml --width 0.25 --train-subset 10000
        --test-subset 2000 --epochs 8 --warmup-epochs 1 --batch-size 64 --no-progress)
echo "=== pufferfish factorize --model resnet18 vgg19_bn   (width 1.0, CIFAR-10 shapes)"
$PF pufferfish factorize --model resnet18 vgg19_bn | grep -E "^==|^parameters|^MACs"
export OMP_NUM_THREADS=1
for mode in full pufferfish; do
  echo "=== $mode: torchrun --nproc-per-node 2 -m pufferfish train --mode $mode ${COMMON[*]}"
  $PF torch.distributed.run --nproc-per-node 2 --master-port $((29500 + RANDOM % 1000)) \
    -m pufferfish train "${COMMON[@]}" --mode "$mode" --out "$OUT/$mode" --overwrite 2>&1 \
    | grep -v -e "^W.*torch/distributed/run.py" -e "^\*\*\*"
done
echo "=== pufferfish report $OUT/full $OUT/pufferfish --out $OUT"
$PF pufferfish report "$OUT/full" "$OUT/pufferfish" --out "$OUT"
