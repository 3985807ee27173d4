#!/usr/bin/env bash
# The main job, where Pufferfish is meant to win: data-parallel training whose step is limited by
# the network. ResNet-18 (width 0.25) on 45,000 of the 60,000 Fashion-MNIST training images (all
# of them take about 16 minutes; IMAGES=0 for all) and all 10,000 test images, two processes joined by
# an emulated 100 Mbit/s link (network namespaces, a veth pair and `tc tbf`; needs root and
# iproute2). Full-rank DDP and Pufferfish (the paper's recipe) are trained for real over the link,
# under about the same wall-clock budget: DDP for 3 epochs, Pufferfish, whose low-rank steps ship
# 3.3x fewer bytes, for 4 (1 full-rank warm-up + 3 low-rank) in less time. Then the table and the
# plot of test accuracy against wall-clock time. Without link emulation it says why, trains over
# loopback (where the extra epoch is not free) and projects the measured steps to slower links.
# About 11 minutes on 2 idle CPU cores with installation (docs/benchmarks.md). Settings: LINK (a
# rate, or loopback), IMAGES (training images, 0: all), EPOCHS (DDP's), PUFFERFISH_EPOCHS, BUCKETS, RECIPE
# (a train config for the other options), OUT, and EXTRA (more `pufferfish bench --train` flags).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/demo}
LINK=${LINK:-100mbit}
IMAGES=${IMAGES:-45000}
EPOCHS=${EPOCHS:-3}
PUFFERFISH_EPOCHS=${PUFFERFISH_EPOCHS:-$((EPOCHS + 1))}
RECIPE=${RECIPE:-}  # empty: the product's defaults, the paper's recipe
MODEL=(--model resnet18 --width 0.25 --batch-size 64)

echo "=== pufferfish factorize --model resnet18 vgg19_bn   (the paper's models: width 1.0, CIFAR-10 shapes)"
$PY -m pufferfish factorize --model resnet18 vgg19_bn | grep -E "^==|^parameters|^MACs"

why=$($PY -c "from pufferfish.bench.netns import netns_available; print(netns_available() or '')")
if [ "$LINK" = loopback ] || [ -z "$why" ]; then
  BW=$LINK
else
  BW=loopback
  echo "=== no emulated link here ($why): training over loopback, then projecting to slow links"
fi
# BUCKETS: DDP's gradient buckets, `auto` (the product's default: timed and chosen for each run's
# model, again after the switch), `torch` (torch's default) or a cap in MiB.
TRAIN=(--train-subset "$IMAGES" --epochs "$EPOCHS" --method-epochs "pufferfish=$PUFFERFISH_EPOCHS"
       --warmup-epochs 1 --bucket-mb "${BUCKETS:-auto}")
[ -n "$RECIPE" ] && TRAIN+=(--train-config "$RECIPE")
echo "=== pufferfish bench --train ${MODEL[*]} --methods ddp,pufferfish --bandwidth $BW ${TRAIN[*]}"
echo "    (the first $IMAGES training images (0: all 60,000) and all 10,000 test images; 2 processes, one core each; each method"
echo "    trained over the same link; time = summed epoch times, evaluation excluded)"
$PY -m pufferfish bench --train "${MODEL[@]}" --methods ddp,pufferfish --bandwidth "$BW" \
  "${TRAIN[@]}" --out "$OUT" ${EXTRA:-}

RUNS="$OUT/train/$BW"
if [ "$BW" = loopback ]; then
  echo "=== projection: the same accuracy per epoch, with step times measured here and modelled for slower links"
  $PY -m pufferfish bench "${MODEL[@]}" --methods ddp,pufferfish --bandwidth loopback --steps 6 \
    --warmup 2 --compute-steps 3 --rounds 2 --accuracy-runs "ddp=$RUNS/ddp,pufferfish=$RUNS/pufferfish" \
    --compute-ms 30 --out "$OUT/projection" > "$OUT/projection.log"
  sed -n '/^## Time to accuracy, PROJECTED/,/^!\[/p' "$OUT/projection/results.md" | grep -v '^!\['
  echo "(all of it: $OUT/projection/results.md and its plots)"
fi

echo "=== the verdict ($BW)"
$PY - "$RUNS" <<'EOF'
import sys
from pathlib import Path
from pufferfish.bench.accuracy import time_to_accuracy
from pufferfish.training.report import summarize_run
runs = Path(sys.argv[1])
full, puff = summarize_run(str(runs / "ddp")), summarize_run(str(runs / "pufferfish"))
gap = 100 * (puff["final"] - full["final"])
ratio = puff["total_time"] / full["total_time"]


def reach(run, target):  # training seconds until the run first reaches target
    seconds = time_to_accuracy(run["rows"], target)
    return "never" if seconds is None else f"{seconds:.0f} s"


print(f"full-rank DDP: {100 * full['final']:.2f}% after {full['epochs']} epochs in "
      f"{full['total_time']:.0f} s, {full['params'] / 1e6:.3f}M parameters")
print(f"Pufferfish:    {100 * puff['final']:.2f}% after {puff['epochs']} epochs in "
      f"{puff['total_time']:.0f} s, {puff['params'] / 1e6:.3f}M parameters "
      f"({full['params'] / puff['params']:.2f}x fewer)")
print(f"accuracy {gap:+.2f} points ({'within' if gap >= -0.5 else 'NOT within'} 0.5 of full rank), "
      f"time {ratio:.2f}x (" + (f"{1 / ratio:.2f}x faster)" if ratio < 1 else f"{ratio:.2f}x slower)"))
for points in (0.5, 0.0):
    target = full["final"] - points / 100
    print(f"time to {100 * target:.2f}% (DDP's final" + (f" - {points}" if points else "") + "): "
          f"DDP {reach(full, target)}, Pufferfish {reach(puff, target)}")
print(f"table and plots: {runs / 'report.md'}, {runs / 'accuracy.png'}")
cached = Path("benchmarks/results/resnet18-w1-fashion-e20-gpu")  # the paper's width, converged
pairs = [(cached / f"full-s{s}", cached / f"puff-s{s}") for s in (0, 1)]
if all((d / "metrics.jsonl").is_file() for pair in pairs for d in pair):
    gaps = [100 * (summarize_run(str(p))["final"] - summarize_run(str(f))["final"]) for f, p in pairs]
    print(f"for comparison, cached: at the paper's width (ResNet-18 width 1.0, 20 epochs, seeds 0 and 1, "
          f"one GPU) Pufferfish ended {sum(gaps) / len(gaps):+.3f} points from full rank "
          f"({', '.join(f'{g:+.2f}' for g in gaps)}); every claim: benchmarks/paper.sh")
EOF
