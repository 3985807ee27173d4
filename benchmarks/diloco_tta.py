"""Time to a target test loss over slow links, from the runs of ``benchmarks/diloco.sh``.

Usage: ``python benchmarks/diloco_tta.py RUNS_DIR [--target LOSS] [--links 1e9,1e8,1e7]``

The loss per epoch does not depend on the link; the time does. Each epoch's time over a link of
``B`` bit/s is the run's own measured ``compute_time`` (2 processes over loopback) plus its
``steps x comm_bytes_per_step x 8 / B`` (2 workers: a ring all-reduce sends its payload once;
per-message latency is left out). That is the α-β model of ``pufferfish bench`` with α = 0,
applied to the bytes each run counted where it sent them; ``pufferfish bench`` measures the
image models' step times over emulated links instead (bench/accuracy.py).
The target defaults to DDP's final test loss plus 2%; for image runs the "loss" is the test
error, 1 - accuracy (``--target 0.3``: 70% accuracy).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _loss(row: dict) -> float:
    return math.log(row["test_ppl"]) if "test_ppl" in row else 1.0 - row["test_acc"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path)
    ap.add_argument("--target", type=float, default=0.0)
    ap.add_argument("--links", default="1e9,1e8,1e7", help="bit/s")
    args = ap.parse_args()
    runs = {p.name: _rows(p) for p in sorted(args.runs.iterdir()) if (p / "metrics.jsonl").is_file()}
    steps = next(r["steps"] for rows in runs.values() for r in rows if "steps" in r)
    target = args.target or _loss(runs["ddp"][-1]) * 1.02
    links = [float(x) for x in args.links.split(",")]
    what = "test loss" if "test_ppl" in runs["ddp"][-1] else "test error (1 - accuracy)"
    print(f"target {what} {target:.4f}; {steps} steps per epoch\n")
    head = ["method", "final ppl / acc", "MB sent / step", "MB sent in all", "MB to target",
            *(f"time to target @ {b / 1e6:g} Mbit/s" for b in links)]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, rows in runs.items():
        per_epoch = [r.get("steps", steps) * r["comm_bytes_per_step"] for r in rows]
        reached = next((i for i, r in enumerate(rows) if _loss(r) <= target), None)
        last = rows[-1]
        final = f"{last['test_ppl']:.2f}" if "test_ppl" in last else f"{100 * last['test_acc']:.2f}%"
        cells = [name, final,
                 f"{sum(per_epoch) / sum(r.get('steps', steps) for r in rows) / 1e6:.3f}",
                 f"{sum(per_epoch) / 1e6:.1f}",
                 "-" if reached is None else f"{sum(per_epoch[:reached + 1]) / 1e6:.1f}"]
        for b in links:
            clock = [r["compute_time"] + 8 * sent / b for r, sent in zip(rows, per_epoch)]
            cells.append("not reached" if reached is None else f"{sum(clock[:reached + 1]):.0f} s")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
