#!/usr/bin/env bash
# The prepared GPU check (under ten minutes of a lent GPU), two parts:
# 1. `pufferfish bench` on the GPU (BENCH_TIMEOUT_S, 200 s): ddp, powersgd and pufferfish on
#    ResNet-18 (width 1) over loopback, bf16 autocast, every timed step synchronized, each method's
#    step split into compute, exposed communication and encode/decode, and results.md's verdict
#    (OUT/bench). Its projection section prints the measured compute per method as a
#    `--compute-ms ddp=MS,powersgd=MS,pufferfish=MS` flag for projections elsewhere. Both workers
#    share one GPU (gloo between them; NCCL needs a GPU per worker), so compute is a shared GPU's.
#    Needs Fashion-MNIST in FASHION_DIR (default /usr/share/datasets/fashion-mnist; carry a copy,
#    e.g. .gpu-data/fashion-mnist, to a machine without it); skipped, and said, otherwise.
# 2. benchmarks/gpu_suite.py within DEADLINE_S (280) seconds: step times of full-rank and factorized
#    ResNet-18 / VGG-19-BN (the paper's width) and llama (width 1.0) at batch 128-1024, eager and
#    torch.compile with CUDA graphs, fp16 and bf16 autocast; OUT/summary.md and OUT/steps.jsonl.
#    Those ratios replace the CPU's in `pufferfish bench --compute-ms full=MS,factorized=MS`.
# Usage: benchmarks/gpu_suite.sh OUT [more gpu_suite.py flags]
# CPU smoke test: BENCH_ARGS="--width 0.125 --batch-size 8 --steps 2 --compute-steps 2 --amp none" \
#   benchmarks/gpu_suite.sh /tmp/gs --device cpu --width 0.125 --batches 16 \
#   --models resnet18,llama --dtypes bfloat16 --modes eager --steps 2 --warmup 1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
out=$1; shift
fashion=${FASHION_DIR:-/usr/share/datasets/fashion-mnist}
if [ -d "$fashion" ]; then
    # shellcheck disable=SC2086  # BENCH_ARGS: extra flags, word-split on purpose
    timeout "${BENCH_TIMEOUT_S:-200}" $PY -m pufferfish bench --model resnet18 --width 1 \
        --methods ddp,powersgd,pufferfish --bandwidth loopback --batch-size 128 --amp bf16 \
        --rounds 2 --steps 10 --compute-steps 5 --warmup 3 --bucket-mb torch \
        --data-dir "$fashion" --out "$out/bench" --overwrite ${BENCH_ARGS:-} \
        || echo "gpu_suite: pufferfish bench failed or timed out (exit $?); see above"
else
    echo "gpu_suite: no Fashion-MNIST in $fashion (FASHION_DIR): the pufferfish bench part is skipped"
fi
exec $PY benchmarks/gpu_suite.py --out "$out" --deadline-s "${DEADLINE_S:-280}" "$@"
