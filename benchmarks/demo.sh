#!/usr/bin/env bash
# The main job, where Pufferfish is meant to win: data-parallel training whose step is limited by
# the network. ResNet-18 (width 0.25) on all 60,000 Fashion-MNIST images, two processes joined by
# an emulated link (network namespaces, a veth pair and `tc tbf`; needs root and iproute2),
# full-rank DDP and Pufferfish trained for real, side by side, then the table and the plot of test
# accuracy against wall-clock time. Without link emulation it says why, trains over loopback and
# projects the measured steps to slower links and more workers instead.
# About 14-16 minutes on 2 idle CPU cores with installation (docs/benchmarks.md). Settings: LINK (a rate, or
# loopback), EPOCHS, RECIPE (a train config for the other options), OUT, and EXTRA (more
# `pufferfish bench --train` flags, e.g. "--train-subset 2000" for a quick look).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/demo}
LINK=${LINK:-200mbit}
EPOCHS=${EPOCHS:-5}
RECIPE=${RECIPE:-configs/demo.toml}
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
echo "=== pufferfish bench --train ${MODEL[*]} --methods ddp,pufferfish --bandwidth $BW --epochs $EPOCHS --warmup-epochs 1 --train-config $RECIPE"
echo "    (all 60,000 training and 10,000 test images unless EXTRA says otherwise; 2 processes, one core each; each method"
echo "    trained over the same link; time = summed epoch times, evaluation excluded)"
$PY -m pufferfish bench --train "${MODEL[@]}" --methods ddp,pufferfish --bandwidth "$BW" \
  --epochs "$EPOCHS" --warmup-epochs 1 --train-config "$RECIPE" --out "$OUT" ${EXTRA:-}

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
from pufferfish.training.report import summarize_run
runs = Path(sys.argv[1])
full, puff = summarize_run(str(runs / "ddp")), summarize_run(str(runs / "pufferfish"))
gap = 100 * (puff["final"] - full["final"])
ratio = puff["total_time"] / full["total_time"]
print(f"full-rank DDP: {100 * full['final']:.2f}% in {full['total_time']:.0f} s, "
      f"{full['params'] / 1e6:.3f}M parameters")
print(f"Pufferfish:    {100 * puff['final']:.2f}% in {puff['total_time']:.0f} s, "
      f"{puff['params'] / 1e6:.3f}M parameters ({full['params'] / puff['params']:.2f}x fewer)")
print(f"accuracy {gap:+.2f} points ({'within' if gap >= -0.5 else 'NOT within'} 0.5 of full rank), "
      f"time {ratio:.2f}x ({1 / ratio:.2f}x faster)")
print(f"table and plots: {runs / 'report.md'}, {runs / 'accuracy.png'}")
cached = Path("benchmarks/results/resnet18-w1-fashion-e20-gpu")  # the paper's width, converged
pairs = [(cached / f"full-s{s}", cached / f"puff-s{s}") for s in (0, 1)]
if all((d / "metrics.jsonl").is_file() for pair in pairs for d in pair):
    gaps = [100 * (summarize_run(str(p))["final"] - summarize_run(str(f))["final"]) for f, p in pairs]
    print(f"for comparison, cached: at the paper's width (ResNet-18 width 1.0, 20 epochs, seeds 0 and 1, "
          f"one GPU) Pufferfish ended {sum(gaps) / len(gaps):+.3f} points from full rank "
          f"({', '.join(f'{g:+.2f}' for g in gaps)}); every claim: benchmarks/paper.sh")
EOF
