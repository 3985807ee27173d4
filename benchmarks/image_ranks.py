"""Each image baseline at its best: PowerSGD's rank, Pufferfish's rank ratio and the compositions.

ResNet-18 width 0.25 on Fashion-MNIST's 60,000 training images (5,000 held out for validation,
choices made there), 20 epochs, 2 processes x 64 images, the paper's SGD recipe (LR 0.1, steps at
50% and 75%), seeds 0 and 1, every method's seed 0 before any seed 1:

- DDP (full rank, plain all-reduce): the reference and its targets, DDP - 0.5 and DDP - 1 points
  of mean test accuracy (docs/benchmarks.md, "Each baseline at its best", fixed before the runs);
- PowerSGD at ranks 1, 2, 4, 8 (torch's advice: an exponential grid from 1), compression from
  step 860, 10% of the 8,600 steps (torch's advice for ``start_powerSGD_iter``);
- Pufferfish at rank ratios 1/8, 1/4, 1/2 (2-epoch full-rank warm-up, the paper's);
- Pufferfish (1/4) + fp16, and Pufferfish (1/4) + PowerSGD at PowerSGD's best rank: the lowest
  rank whose mean validation accuracy is within 0.5 points of DDP's, else the most accurate
  (queued once PowerSGD's grid has finished).

    python benchmarks/image_ranks.py run OUT [--dry-run]

Runs go through ``benchmarks/sweep.py`` (cached, resumed from checkpoints); about 80 minutes a
run on 2 CPU cores, 24 runs in all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import sweep  # benchmarks/ is not a package: its folder on the path

BASE = ("--config", "resnet18_fashion", "--width", "0.25", "--batch-size", "64", "--epochs", "20",
        "--warmup-epochs", "2", "--threads", "1", "--no-progress", "--checkpoint-every-epochs", "1")
START_ITER = 860  # 10% of 20 epochs x 430 steps (55,000 images / 128 a step)
PSGD_RANKS = (1, 2, 4, 8)
RATIOS = ("0.125", "0.25", "0.5")
SEEDS = (0, 1)
PSGD = ("--comm", "powersgd", "--powersgd-start-iter", str(START_ITER))
METHODS: dict[str, tuple[str, ...]] = {
    "ddp": ("--mode", "full"),
    **{f"psgd-r{r}": ("--mode", "full", *PSGD, "--powersgd-rank", str(r)) for r in PSGD_RANKS},
    **{f"puff-r{x}": ("--mode", "pufferfish", "--rank-ratio", x) for x in RATIOS},
    "puff-fp16": ("--mode", "pufferfish", "--rank-ratio", "0.25", "--comm", "fp16"),
}


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / f"{method}-s{seed}"


def mean_val(out: Path, method: str) -> float | None:
    """Mean final validation accuracy over the seeds; None until every seed has finished."""
    rows = [sweep.finished(run_dir(out, method, s)) for s in SEEDS]
    if any(r is None or "val_acc" not in r for r in rows):
        return None
    return sum(r["val_acc"] for r in rows) / len(rows)  # type: ignore[index]


def best_psgd_rank(out: Path) -> int | None:
    """The lowest PowerSGD rank within 0.5 points of DDP's mean validation accuracy, else the most
    accurate rank; None until DDP and every rank have all their seeds."""
    ddp = mean_val(out, "ddp")
    vals = {r: mean_val(out, f"psgd-r{r}") for r in PSGD_RANKS}
    if ddp is None or None in vals.values():
        return None
    close = [r for r in PSGD_RANKS if vals[r] >= ddp - 0.005]  # type: ignore[operator]
    return close[0] if close else max(vals, key=vals.__getitem__)  # type: ignore[arg-type]


def runs(out: Path) -> list[sweep.Run]:
    """Every run of the study known so far, in trial order."""
    methods = dict(METHODS)
    if (rank := best_psgd_rank(out)) is not None:
        methods["puff-psgd"] = ("--mode", "pufferfish", "--rank-ratio", "0.25", *PSGD,
                                "--powersgd-rank", str(rank))
    return [sweep.Run(run_dir(out, m, s), (*BASE, *flags, "--seed", str(s)))
            for s in SEEDS for m, flags in methods.items()]


def main() -> int:
    args = sweep.parser(__doc__)[0].parse_args()
    sweep.run_all(runs(args.out), dry_run=args.dry_run)
    if not args.dry_run:  # a finished grid queues the composition at PowerSGD's best rank
        sweep.run_all(runs(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
