"""Time to a target test loss over slow links, from the runs of ``benchmarks/sweeps.py diloco``.

Usage: ``python benchmarks/diloco_tta.py RUNS_DIR [--target LOSS] [--links 1e9,1e8,1e7]
[--compute-like RUN=REF,...] [--interpolate]``

The loss per epoch does not depend on the link; the time does. Each epoch's time over a link of
``B`` bit/s is the run's own measured ``compute_time`` (2 processes over loopback) plus its
``steps x comm_bytes_per_step x 8 / B`` (2 workers: a ring all-reduce sends its payload once;
per-message latency is left out). That is the α-β model of ``pufferfish bench`` with α = 0,
applied to the bytes each run counted where it sent them; ``pufferfish bench`` measures the
image models' step times over emulated links instead (bench/accuracy.py).
The target defaults to DDP's final test loss plus 2%; for image runs the "loss" is the test
error, 1 - accuracy (``--target 0.3``: 70% accuracy); for llama it is the validation loss, and
the evaluations within epochs (``evals.jsonl``, ``--eval-every-steps``) count too: a point at
global step ``s`` is timed as the steps before it, each at its epoch's compute and bytes per step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pufferfish.bench import time_to_target as ttt


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def loss(row: dict) -> float:
    for key in ("test_ppl", "val_ppl"):
        if key in row:
            return math.log(row[key])
    return 1.0 - row["test_acc"]


def points(run: Path, rows: list[dict], steps: int) -> list[tuple[int, float]]:
    """``(global step, loss)`` of every evaluation: each epoch's end, and within epochs."""
    ends, total = [], 0
    for r in rows:
        total += r.get("steps", steps)
        ends.append((total, loss(r)))
    evals = run / "evals.jsonl"
    inner = [(e["step"], loss(e)) for e in map(json.loads, evals.read_text().splitlines())] \
        if evals.is_file() else []
    return sorted(set(ends + inner))


def clock(rows: list[dict], steps: int, step: float, bps: float,
          compute_per_step: float | None = None) -> float:
    """Seconds to ``step`` global steps over ``bps``: each step at its epoch's compute time per
    step (or ``compute_per_step``) plus its bytes per step on the wire."""
    return ttt.cumulative(step, [(
        r.get("steps", steps),
        (r["compute_time"] / r.get("steps", steps) if compute_per_step is None
         else compute_per_step) + 8 * r["comm_bytes_per_step"] / bps) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path)
    ap.add_argument("--target", type=float, default=0.0)
    ap.add_argument("--links", default="1e9,1e8,1e7", help="bit/s")
    ap.add_argument("--interpolate", action="store_true",
                    help="the step where the loss crosses the target, linear between the two "
                         "evaluations around it (default: the first evaluation at or below it)")
    ap.add_argument("--compute-like", default="",
                    help="RUN=REF,...: time RUN's steps at REF's mean compute per step (for a run "
                         "that shared the cores with other jobs; REF: an idle run of the same model)")
    args = ap.parse_args()
    dirs = {p.name: p for p in sorted(args.runs.iterdir()) if (p / "metrics.jsonl").is_file()}
    runs = {name: rows_of(p) for name, p in dirs.items()}
    like = {}
    for pair in filter(None, args.compute_like.split(",")):
        name, _, ref = pair.partition("=")
        if name not in runs or ref not in runs:
            print(f"diloco_tta.py: --compute-like {pair}: allowed RUN=REF, both runs in "
                  f"{args.runs} (found: {', '.join(runs)})", file=sys.stderr)
            sys.exit(2)
        like[name] = ref
    mean_compute = {name: sum(r["compute_time"] for r in rows)
                    / sum(r.get("steps", 1) for r in rows) for name, rows in runs.items()}
    steps = next(r["steps"] for rows in runs.values() for r in rows if "steps" in r)
    target = args.target or loss(runs["ddp"][-1]) * 1.02
    links = [float(x) for x in args.links.split(",")]
    last_ddp = runs["ddp"][-1]
    what = "test loss" if "test_ppl" in last_ddp else \
        "validation loss" if "val_ppl" in last_ddp else "test error (1 - accuracy)"
    print(f"target {what} {target:.4f}; {steps} steps per epoch\n")
    head = ["method", "final ppl / acc", "MB sent / step", "MB sent in all", "MB to target",
            *(f"time to target @ {b / 1e6:g} Mbit/s" for b in links)]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, rows in runs.items():
        per_epoch = [r.get("steps", steps) * r["comm_bytes_per_step"] for r in rows]
        at = ttt.reach(points(dirs[name], rows, steps), target, interpolate=args.interpolate)
        last = rows[-1]
        ppl = last.get("test_ppl", last.get("val_ppl"))
        final = f"{ppl:.2f}" if ppl is not None else f"{100 * last['test_acc']:.2f}%"
        cells = [name, final,
                 f"{sum(per_epoch) / sum(r.get('steps', steps) for r in rows) / 1e6:.3f}",
                 f"{sum(per_epoch) / 1e6:.1f}",
                 "-" if at is None else f"{_bytes_to(rows, steps, at) / 1e6:.1f} (step {at:.0f})"]
        for b in links:
            compute = mean_compute[like[name]] if name in like else None
            cells.append("not reached" if at is None
                         else f"{clock(rows, steps, at, b, compute):.0f} s")
        print("| " + " | ".join(cells) + " |")


def _bytes_to(rows: list[dict], steps: int, step: float) -> float:
    """Bytes sent in the first ``step`` global steps."""
    return ttt.cumulative(step, [(r.get("steps", steps), r["comm_bytes_per_step"]) for r in rows])


if __name__ == "__main__":
    main()
