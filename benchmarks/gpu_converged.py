"""Issue 12's converged runs at the paper's width, packed into one short lease of one GPU.

    python benchmarks/gpu_converged.py --out OUT --budget-s 520 --fashion-dir DIR --kjv FILE

Every run is a plain ``pufferfish train`` (one process, batch 128, fp16 autocast; under torchrun
when it names a comm hook, which needs a process group); this script
only schedules them. It first times one short epoch of each model alone (which is also the smoke
test: a failure stops everything at once), then picks the largest epoch budget at which the
ResNet-18 pair (full rank and Pufferfish, two seeds) fits the time left, and adds the other runs in
priority order while they still fit. Runs share the GPU (time-sliced, at most ``--slots`` at once;
the LSTMs, which leave the GPU idle most of the time, run beside them); whatever still runs at
the deadline is stopped, so its ``metrics.jsonl`` holds the epochs it finished. Run directories
land in OUT without checkpoints, and ``summary.md`` lists each run's last epoch.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pufferfish.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
STEPS_PER_EPOCH = 60_000 // 128
# Runs sharing the GPU fill each other's launch gaps: on an H200 (2026-12-04) four ResNet-18s beside
# two LSTMs trained 1.75x the epochs per second of one alone (1.0 planned 20 epochs for the core
# four only; they ended at 228 s of 492).
CONCURRENCY_GAIN = 1.5

RESNET = ["--config", "configs/resnet18_fashion.toml", "--width", "1.0"]
VGG = ["--config", "configs/vgg19_fashion.toml", "--width", "1.0"]
AUTO = ["--warmup-epochs", "auto", "--rank-ratio", "auto", "--keep", "auto"]
# (name, model flags, mode flags, which calibration times it): priority order
CONVNET_JOBS = [
    ("resnet18-full-s0", RESNET, ["--mode", "full", "--seed", "0"], "resnet18"),
    ("resnet18-puff-s0", RESNET, ["--mode", "pufferfish", "--seed", "0"], "resnet18"),
    ("resnet18-full-s1", RESNET, ["--mode", "full", "--seed", "1"], "resnet18"),
    ("resnet18-puff-s1", RESNET, ["--mode", "pufferfish", "--seed", "1"], "resnet18"),
    ("resnet18-lowrank-s0", RESNET, ["--mode", "lowrank", "--seed", "0"], "resnet18"),
    ("vgg19-full-s0", VGG, ["--mode", "full", "--seed", "0"], "vgg19"),
    ("vgg19-puff-s0", VGG, ["--mode", "pufferfish", "--seed", "0"], "vgg19"),
    ("resnet18-auto-s0", RESNET, ["--mode", "pufferfish", "--seed", "0", *AUTO], "resnet18"),
    ("resnet18-lowrank-s1", RESNET, ["--mode", "lowrank", "--seed", "1"], "resnet18"),
    ("vgg19-full-s1", VGG, ["--mode", "full", "--seed", "1"], "vgg19"),
    ("vgg19-puff-s1", VGG, ["--mode", "pufferfish", "--seed", "1"], "vgg19"),
    # The second GPU loan (2026-12-04): PowerSGD at the paper's width, Pufferfish with fp16 gradients (the two compose),
    # auto's second seed.
    ("resnet18-psgd-s0", RESNET, ["--mode", "full", "--seed", "0", "--comm", "powersgd"], "resnet18"),
    ("resnet18-pufffp16-s0", RESNET, ["--mode", "pufferfish", "--seed", "0", "--comm", "fp16"],
     "resnet18"),
    ("resnet18-auto-s1", RESNET, ["--mode", "pufferfish", "--seed", "1", *AUTO], "resnet18"),
    ("resnet18-psgd-s1", RESNET, ["--mode", "full", "--seed", "1", "--comm", "powersgd"], "resnet18"),
]
CORE = 4  # the first four must fit, or the epoch budget shrinks


def train(out: Path, name: str, flags: list[str], common: list[str]) -> list[str]:
    launcher = [sys.executable, "-m", "pufferfish"]
    if "--comm" in flags:  # a comm hook needs a process group: torchrun with one process
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "1", "-m", "pufferfish"]
    return [*launcher, "train", *flags, *common,
            "--out", str(out / name), "--no-progress", "--threads", "2",
            "--checkpoint-every-epochs", "0", "--overwrite"]


def calibrate(out: Path, common: list[str], subset: int,
              models: set[str]) -> dict[str, tuple[float, float]]:
    """Seconds per full-data epoch (full rank, low rank) of each convnet, each run alone.

    Three short epochs with the switch after two: the first pays CUDA's first-call set-up, the second
    times full rank, the third low rank (and proves the switch works under autocast on CUDA).
    """
    times = {}
    for key, flags in (("resnet18", RESNET), ("vgg19", VGG)):
        if key not in models:
            continue
        extra = ["--epochs", "3", "--warmup-epochs", "2", "--mode", "pufferfish", "--seed", "0",
                 "--train-subset", str(subset), "--test-subset", "2000"]
        start = time.perf_counter()
        proc = subprocess.run(train(out, f"calib-{key}", [*flags, *extra], common),
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"calibration of {key} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                     f"\n{proc.stderr[-3000:]}")
        per_step = [r["epoch_time"] / (subset // 128) for r in read_metrics(out / f"calib-{key}")]
        times[key] = (per_step[1] * STEPS_PER_EPOCH, per_step[2] * STEPS_PER_EPOCH)
        print(f"calibration {key}: {time.perf_counter() - start:.1f} s wall; ms per step "
              + ", ".join(f"{p * 1000:.1f}" for p in per_step), flush=True)
    return times


def plan(times: dict[str, tuple[float, float]], left_s: float, wanted: list) -> tuple[int, list]:
    """The largest epoch budget at which the core runs fit, then as many more as still fit."""
    def cost(job: tuple, epochs: int) -> float:
        full, low = times[job[3]]
        mode = job[2][1]
        if mode == "full":
            return 1.1 * epochs * full
        if mode == "lowrank":
            return 1.1 * epochs * low
        warm = max(1, round(epochs * 0.1)) + (1 if "auto" in job[2] else 0)
        return 1.1 * (warm * full + (epochs - warm) * low)
    capacity = left_s * CONCURRENCY_GAIN
    for epochs in (20, 16, 12, 10, 8):
        if sum(cost(j, epochs) for j in wanted[:CORE]) <= capacity:
            break
    chosen, used = [], 0.0
    for job in wanted:
        if len(chosen) < CORE or used + cost(job, epochs) <= capacity:
            chosen.append(job)
            used += cost(job, epochs)
    print(f"plan: {epochs} epochs, {len(chosen)} convnet runs, ~{used:.0f} s of GPU time for "
          f"{left_s:.0f} s left", flush=True)
    return epochs, chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=520.0, help="stop every run this long after start")
    p.add_argument("--fashion-dir", required=True)
    p.add_argument("--kjv", required=True, help="the KJV as a text file (one verse a line)")
    p.add_argument("--slots", type=int, default=4, help="convnet runs at once")
    p.add_argument("--calib-subset", type=int, default=6400)
    p.add_argument("--lstm-epochs", type=int, default=10)
    p.add_argument("--only", default="", help="comma-separated run names (default: all, by priority)")
    p.add_argument("--lstm-runs", default="full-s0,pufferfish-s0,puff10pct-s0",
                   help="comma-separated LSTM runs, VARIANT-sSEED (variants: full, pufferfish, "
                        "puff10pct; empty: none)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags for every run")
    args = p.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    common = ["--data-dir", args.fashion_dir, "--amp", *args.extra]
    lm = ["--config", "configs/lstm_kjv.toml", "--width", "1.0", "--data", args.kjv, "--amp",
          *args.extra]
    wanted = [j for j in CONVNET_JOBS if not args.only or j[0] in args.only.split(",")]
    times = calibrate(out / "calibration", common, args.calib_subset, {j[3] for j in wanted})
    epochs, jobs = plan(times, deadline - time.perf_counter(), wanted)
    # Pufferfish switches at the first LR drop (the LSTM config's choice), beside the paper's 10%.
    variants = {"full": ("full", []),
                "pufferfish": ("pufferfish", ["--warmup-epochs", str(args.lstm_epochs // 2)]),
                "puff10pct": ("pufferfish",
                              ["--warmup-epochs", str(max(1, round(args.lstm_epochs * 0.1)))])}
    lstm = []
    for run in filter(None, args.lstm_runs.split(",")):
        name, seed = run.rsplit("-s", 1)
        lstm.append((f"lstm-{run}", lm, ["--mode", variants[name][0], "--seed", seed,
                                         "--epochs", str(args.lstm_epochs), *variants[name][1]]))
    queue = []
    for name, flags, mode, _ in jobs:
        if "--warmup-epochs" not in mode:
            mode = [*mode, "--warmup-epochs", str(max(1, round(epochs * 0.1)))]
        queue.append((name, flags, [*mode, "--epochs", str(epochs)], common))
    running: list[tuple[str, subprocess.Popen, bool]] = []
    logs = out / "logs"
    logs.mkdir(exist_ok=True)

    def launch(name: str, flags: list[str], mode: list[str], extra: list[str], convnet: bool) -> None:
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(train(out, name, [*flags, *mode], extra), cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        running.append((name, proc, convnet))
        print(f"{time.perf_counter() - start:6.0f} s  start {name}", flush=True)

    for name, flags, mode in lstm:
        launch(name, flags, mode, [], False)
    while time.perf_counter() < deadline:
        for name, proc, convnet in list(running):
            if proc.poll() is not None:
                running.remove((name, proc, convnet))
                print(f"{time.perf_counter() - start:6.0f} s  end {name} (exit {proc.returncode})",
                      flush=True)
        while queue and sum(c for _, _, c in running) < args.slots:
            name, flags, mode, extra = queue.pop(0)
            launch(name, flags, mode, extra, True)
        if not running and not queue:
            break
        time.sleep(2)
    for name, proc, _ in running:
        proc.terminate()
        print(f"deadline: stopped {name}", flush=True)
    for _, proc, _ in running:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    summarize(out)


def summarize(out: Path) -> None:
    lines = ["| run | epochs | last test | best test | train loss | params | epoch s (mean) |",
             "|---|---|---|---|---|---|---|"]
    for run in sorted(p for p in out.iterdir() if (p / "config.toml").is_file()):
        rows = read_metrics(run)
        for ckpt in run.glob("checkpoint*"):
            shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
        if not rows:
            lines.append(f"| {run.name} | 0 | | | | | |")
            continue
        key = "test_acc" if "test_acc" in rows[-1] else "test_ppl"
        best = (max if key == "test_acc" else min)(r[key] for r in rows)
        mean_t = sum(r["epoch_time"] for r in rows) / len(rows)
        lines.append(f"| {run.name} | {rows[-1]['epoch']} | {rows[-1][key]:.4f} | {best:.4f} | "
                     f"{rows[-1]['train_loss']:.4f} | {rows[-1]['params']:,} | {mean_t:.1f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
