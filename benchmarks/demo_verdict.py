"""`make demo`'s verdict: each method's accuracy, time and size, and which reached the target first.

    python benchmarks/demo_verdict.py RUNS METHODS

RUNS holds one `pufferfish train` run directory per method (``pufferfish bench --train``'s
``train/<link>/``), METHODS the comma-separated names; the first is the reference (DDP). The
target is the reference's final test accuracy - 0.5 points (and its final itself); time is
summed epoch time, evaluation excluded, as the bench reports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import folders

from pufferfish.bench.accuracy import time_to_accuracy
from pufferfish.report import summarize_run

CACHED = folders.folder(folders.CACHE, "converged-resnet18")  # the paper's width, converged


def verdict(runs: Path, methods: list[str]) -> str:
    found = {m: summarize_run(str(runs / m)) for m in methods if (runs / m).is_dir()}
    if not found:
        return f"no runs under {runs}"
    ref_name = methods[0] if methods[0] in found else next(iter(found))
    ref = found[ref_name]
    lines = [f"{'method':<22} {'final':>7} {'epochs':>6} {'time':>7} {'params':>8}  vs {ref_name}"]
    for name, run in found.items():
        gap = 100 * (run["final"] - ref["final"])
        lines.append(f"{name:<22} {100 * run['final']:6.2f}% {run['epochs']:>6} "
                     f"{run['total_time']:6.0f}s {run['params'] / 1e6:7.3f}M  {gap:+.2f} points, "
                     f"{ref['total_time'] / run['total_time']:.2f}x the speed")
    for points in (0.5, 0.0):
        target = ref["final"] - points / 100
        reached = {n: time_to_accuracy(r["rows"], target) for n, r in found.items()}
        times = ", ".join(f"{n} {'never' if t is None else f'{t:.0f} s'}"
                          for n, t in reached.items())
        first = min((t, n) for n, t in reached.items() if t is not None)
        lines.append(f"to {100 * target:.2f}% ({ref_name}'s final"
                     + (f" - {points}" if points else "") + f"): {times}; first: {first[1]}")
    lines.append(f"table and plots: {runs / 'report.md'}, {runs / 'accuracy.png'}")
    pairs = [(CACHED / f"full-s{s}", CACHED / f"puff-s{s}") for s in (0, 1)]
    if all((d / "metrics.jsonl").is_file() for pair in pairs for d in pair):
        gaps = [100 * (summarize_run(str(p))["final"] - summarize_run(str(f))["final"])
                for f, p in pairs]
        lines.append("for comparison, cached: at the paper's width (ResNet-18 width 1.0, 20 "
                     f"epochs, seeds 0 and 1, one GPU) Pufferfish ended "
                     f"{sum(gaps) / len(gaps):+.3f} points from full rank "
                     f"({', '.join(f'{g:+.2f}' for g in gaps)}); every claim: benchmarks/paper.sh")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: demo_verdict.py RUNS METHODS")
    print(verdict(Path(sys.argv[1]), [m for m in sys.argv[2].split(",") if m]))
