#!/usr/bin/env bash
# The main job, where Pufferfish is meant to win: data-parallel training whose step is limited by
# the network. ResNet-18 (width 0.25) on 30,000 of the 60,000 Fashion-MNIST training images
# (IMAGES=0 for all) and all 10,000 test images, two processes joined by an emulated 100 Mbit/s
# link (network namespaces, a veth pair and `tc tbf`; needs root and iproute2). Four methods are
# trained for real over the link: full-rank DDP for 3 epochs, and the methods whose steps ship
# fewer bytes for one more epoch in about the same wall-clock budget: PowerSGD (the compressor
# Pufferfish is compared with), Pufferfish (the paper's recipe: 1 full-rank warm-up epoch, then
# low rank) and Pufferfish + PowerSGD (the composition), at the image sweep's picks (PICKS).
# Then the table, the plot of test accuracy against wall-clock time, and the verdict: which
# method reached DDP's final accuracy - 0.5 points first. Without link emulation it says why,
# trains over loopback (where the extra epoch is not free) and projects the measured steps to
# slower links. 11-26 minutes on 2 idle CPU cores, by the CPU (docs/benchmarks.md#make-demo).
# Settings: LINK (a rate, or loopback), IMAGES (training images, 0: all), METHODS, EPOCHS (DDP's),
# MORE_EPOCHS (the others'), PICKS, BUCKETS, RECIPE (a train config for the other options), OUT,
# and EXTRA (more `pufferfish bench --train` flags).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
# The demo's own directory is trained again on every `make demo`; an OUT of yours is not
# replaced unasked (a bench there refuses: choose another OUT, or EXTRA=--overwrite).
OVERWRITE=$([ -z "${OUT:-}" ] && echo --overwrite || true)
case " ${EXTRA:-} " in *" --overwrite "*) OVERWRITE=--overwrite ;; esac
OUT=${OUT:-runs/demo}
LINK=${LINK:-100mbit}
IMAGES=${IMAGES:-30000}
METHODS=${METHODS:-ddp,powersgd,pufferfish,pufferfish+powersgd}
EPOCHS=${EPOCHS:-3}
MORE_EPOCHS=${MORE_EPOCHS:-$((EPOCHS + 1))}
# every method but DDP trains MORE_EPOCHS
EPOCH_MAP=$(echo "$METHODS" | tr ',' '\n' | grep -vx ddp | sed "s/\$/=$MORE_EPOCHS/" | paste -sd,)
RECIPE=${RECIPE:-}  # empty: the product's defaults, the paper's recipe
# PowerSGD's rank and Pufferfish's rank ratio: the image sweep's picks, each the fastest to DDP
# - 0.5 on validation (benchmarks/image_ranks.py: ResNet-18 width 0.25, 20 epochs, 2 seeds), with
# PowerSGD compressing from 10% of its steps as there (torch's advice); until the sweep has
# chosen, the product's defaults. PICKS="" (the defaults) or your own rank flags override them.
SWEEP=benchmarks/results/resnet18-w0.25-fashion-e20-ranks
START=()
if [ -z "${PICKS+set}" ]; then
  WHY=$(mktemp)
  if PICKS=$($PY benchmarks/image_ranks.py settings "$SWEEP" 2>"$WHY"); then
    TRAINED=$([ "$IMAGES" = 0 ] && echo 55000 || echo "$IMAGES")  # the bench holds 5,000 out
    START=(--powersgd-start-iter $(( (TRAINED / 128 * MORE_EPOCHS + 9) / 10 )))
    echo "=== the image sweep's picks: $PICKS ${START[*]}"
  else
    echo "=== the product's defaults (the image sweep has not chosen: $(head -c 300 "$WHY"))"
    PICKS=""
  fi
  rm -f "$WHY"
fi
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
TRAIN=(--train-subset "$IMAGES" --epochs "$EPOCHS" --method-epochs "$EPOCH_MAP"
       --warmup-epochs 1 --bucket-mb "${BUCKETS:-auto}" $PICKS ${START[@]+"${START[@]}"})
[ -n "$RECIPE" ] && TRAIN+=(--train-config "$RECIPE")
echo "=== pufferfish bench --train ${MODEL[*]} --methods $METHODS --bandwidth $BW ${TRAIN[*]}"
echo "    (the first $IMAGES training images (0: all 60,000) and all 10,000 test images; 2 processes, one core each; each method"
echo "    trained over the same link; time = summed epoch times, evaluation excluded)"
$PY -m pufferfish bench --train "${MODEL[@]}" --methods "$METHODS" --bandwidth "$BW" \
  "${TRAIN[@]}" --out "$OUT" $OVERWRITE ${EXTRA:-}

RUNS="$OUT/train/$BW"
if [ "$BW" = loopback ]; then
  echo "=== projection: the same accuracy per epoch, with step times measured here and modelled for slower links"
  RUNMAP=$(echo "$METHODS" | tr ',' '\n' | sed "s|.*|&=$RUNS/&|" | paste -sd,)
  # the steps timed as trained, every PowerSGD step compressed (its first plain ones are not
  # modelled: a slight advantage to PowerSGD)
  $PY -m pufferfish bench "${MODEL[@]}" $PICKS --methods "$METHODS" --bandwidth loopback --steps 6 \
    --warmup 2 --compute-steps 3 --rounds 2 --accuracy-runs "$RUNMAP" \
    --compute-ms 30 --out "$OUT/projection" $OVERWRITE > "$OUT/projection.log"
  sed -n '/^## Time to accuracy, PROJECTED/,/^!\[/p' "$OUT/projection/results.md" | grep -v '^!\['
  echo "(all of it: $OUT/projection/results.md and its plots)"
fi

echo "=== the verdict ($BW)"
$PY benchmarks/demo_verdict.py "$RUNS" "$METHODS"
