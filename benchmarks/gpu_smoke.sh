#!/usr/bin/env bash
# The GPU code paths the CPU tests cannot reach, each a short real run with its own timeout
# (docs/benchmarks.md, Threats 8). On one GPU two processes share it (gloo between them, as
# distributed/env.py's join_group chooses); one process uses NCCL. Checks, each PASS or FAIL:
#   bench     `pufferfish bench`'s own workers on the GPU: results.md names the device
#   psgd      DDP + PowerSGD, checkpointed, then resumed (its memory loaded on the CPU, moved back)
#   diloco    DiLoCo's outer steps and its replicas' agreement check on GPU tensors
#   fsdp      FSDP2 + --amp through the switch under NCCL (rank 0's factors broadcast)
# Usage: benchmarks/gpu_smoke.sh OUT   (FASHION_DIR: the images, default the Debian package's;
# SMOKE_TIMEOUT_S per check, default 150). On a CPU the same checks run on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
out=$1
mkdir -p "$out"
limit=${SMOKE_TIMEOUT_S:-150}
data=(--data-dir "${FASHION_DIR:-/usr/share/datasets/fashion-mnist}")
small=(--model resnet18 --width 0.25 --batch-size 32 --train-subset 1024 --val-subset 256
       --test-subset 256 --threads 1 --no-progress "${data[@]}")
train=("$PY" -m torch.distributed.run --standalone --nproc-per-node)
failed=0

check() {  # NAME COMMAND...: runs it within the limit, its output in OUT/NAME.log
    local name=$1; shift
    if timeout "$limit" "$@" > "$out/$name.log" 2>&1; then
        echo "PASS $name"
    else
        echo "FAIL $name (exit $?): $out/$name.log"; tail -5 "$out/$name.log"; failed=1
    fi
}

check bench "$PY" -m pufferfish bench --model resnet18 --width 0.25 --batch-size 32 \
    --methods ddp,powersgd,pufferfish --bandwidth loopback --rounds 1 --steps 3 --warmup 2 \
    --compute-steps 2 --bucket-mb torch "${data[@]}" --out "$out/bench" --overwrite
grep -h "^Measured on:" "$out/bench/results.md" 2>/dev/null || { echo "FAIL bench: no device"; failed=1; }
check psgd "${train[@]}" 2 -m pufferfish train "${small[@]}" --mode pufferfish --epochs 2 \
    --warmup-epochs 1 --comm powersgd --powersgd-start-iter 2 --checkpoint-every-epochs 1 \
    --out "$out/psgd"
check psgd-resume "${train[@]}" 2 -m pufferfish train --resume "$out/psgd" --epochs 3 --threads 1
check diloco "${train[@]}" 2 -m pufferfish train "${small[@]}" --mode pufferfish --epochs 2 \
    --warmup-epochs 1 --sync diloco --inner-steps 4 --out "$out/diloco"
check fsdp "${train[@]}" 1 -m pufferfish train "${small[@]}" --mode pufferfish --epochs 2 \
    --warmup-epochs 1 --parallel fsdp --amp --out "$out/fsdp"
exit $failed
