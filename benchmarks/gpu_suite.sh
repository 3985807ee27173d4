#!/usr/bin/env bash
# The prepared GPU check (about ten minutes of a lent GPU): step times of full-rank and factorized
# ResNet-18 / VGG-19-BN (the paper's width) and llama (width 1.0) at batch 128-1024, eager and
# torch.compile with CUDA graphs, fp16 and bf16 autocast (benchmarks/gpu_suite.py), within
# DEADLINE_S (480) seconds; OUT/summary.md and OUT/steps.jsonl. Those ratios replace the CPU's in
# `pufferfish bench --compute-ms full=MS,factorized=MS`.
# Usage: benchmarks/gpu_suite.sh OUT [more gpu_suite.py flags]
# CPU smoke test: benchmarks/gpu_suite.sh /tmp/gs --device cpu --width 0.125 --batches 16 \
#   --models resnet18,llama --dtypes bfloat16 --modes eager --steps 2 --warmup 1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
out=$1; shift
exec $PY benchmarks/gpu_suite.py --out "$out" --deadline-s "${DEADLINE_S:-480}" "$@"
