"""Interleaved rounds of ``pufferfish bench``: the order, and the median and spread over rounds.

On a shared machine the same method measured twice in one run can differ by 40%: other
processes come and go. One measurement per (link, method) lets one noisy moment decide a
row. So the benchmark measures in ``R`` rounds, every (link, method) once per round, in an
order that rotates from round to round (no method always goes first, none always last), and
reports per (link, method) the median over rounds with the min–max spread. Ratios to DDP are
taken within a round (same link, minutes apart) and only then summarized, so that a ratio's
two step times share the round's load.

Pure functions on the step workers' records (:mod:`pufferfish.bench.step`): tested in
``tests/test_bench.py`` with hand-computed numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "COMPUTE_DISAGREEMENT",
    "compute_check",
    "round_plan",
    "spread",
    "summarize",
]

COMPUTE_DISAGREEMENT = 0.15  # compute-only steps do not touch the link: flag a larger gap

# Per-round quantities summarized as median with min–max.
_TIMES = ("step_time", "compute_time", "comm_time", "comm_share", "compress_time")


def round_plan(
    links: Sequence[str], methods: Sequence[str], rounds: int
) -> list[list[tuple[str, list[str]]]]:
    """For each round, the links in measuring order, each with its methods in order.

    Round ``r`` rotates both lists by ``r``: with ``R >= len(methods)`` every method is
    measured first (and last) in some round, and so is every link.
    """
    if rounds < 1:
        raise ValueError(f"rounds {rounds!r} is invalid: allowed >= 1")

    def rotated(xs: Sequence[str], r: int) -> list[str]:
        k = r % len(xs) if xs else 0
        return [*xs[k:], *xs[:k]]

    return [[(link, rotated(methods, r)) for link in rotated(links, r)] for r in range(rounds)]


def spread(values: Iterable[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of some per-round values (at least one)."""
    xs = list(values)
    if not xs:
        raise ValueError("spread of no values")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _with_derived(record: dict[str, Any]) -> dict[str, Any]:
    """A round's record with ``comm_time`` and ``comm_share`` recomputed from its own times."""
    step, compute = record["step_time"], record["compute_time"]
    comm = max(0.0, step - compute)
    return {**record, "comm_time": comm, "comm_share": comm / step if step > 0 else 0.0}


def summarize(
    records: Sequence[dict[str, Any]], links: Sequence[str], methods: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per measured (link, method), in ``links`` x ``methods`` order.

    Each time field is the median over rounds and ``spread[field]`` its ``[min, max]``;
    ``speedup_vs_ddp`` is the median over rounds of ``ddp step / method step`` of the same
    round and link (``None`` when DDP was not measured there). Counts (bytes, params) come
    from the first round: they do not vary. ``rounds`` is how many rounds measured the row.
    """
    rows: list[dict[str, Any]] = []
    for link in links:
        ddp = {r["round"]: r["step_time"] for r in records
               if r["bandwidth"] == link and r["method"] == "ddp"}
        for method in methods:
            mine = [_with_derived(r) for r in records
                    if r["bandwidth"] == link and r["method"] == method]
            if not mine:
                continue
            row = {k: v for k, v in mine[0].items() if k not in ("round", "per_rank")}
            row["spread"] = {}
            for key in _TIMES:
                s = spread(r[key] for r in mine)
                row[key] = s["median"]
                row["spread"][key] = [s["min"], s["max"]]
            ratios = [ddp[r["round"]] / r["step_time"] for r in mine
                      if r["round"] in ddp and r["step_time"] > 0]
            if ratios:
                s = spread(ratios)
                row["speedup_vs_ddp"] = s["median"]
                row["spread"]["speedup_vs_ddp"] = [s["min"], s["max"]]
            else:
                row["speedup_vs_ddp"] = None
            row["rounds"] = len(mine)
            row["buckets"] = [r.get("bucket_mib") for r in mine]  # each round's (None: torch's)
            # Own buckets against torch's in the same group: torch's step / own step per round.
            gains = [(r.get("torch_step_time") or r["step_time"]) / r["step_time"] for r in mine]
            s = spread(gains)
            row["bucket_speedup"] = s["median"]
            row["spread"]["bucket_speedup"] = [s["min"], s["max"]]
            rows.append(row)
    return rows


def compute_check(
    rows: Sequence[dict[str, Any]], limit: float = COMPUTE_DISAGREEMENT
) -> list[dict[str, Any]]:
    """Per method, its median compute time on every link, and whether they disagree.

    A compute-only step runs no collective, so its time cannot depend on the link; a gap
    ``max / min - 1`` above ``limit`` says the machine's load, not the method, moved it.
    """
    out: list[dict[str, Any]] = []
    for method in dict.fromkeys(r["method"] for r in rows):
        per_link = {r["bandwidth"]: r["compute_time"] for r in rows if r["method"] == method}
        low, high = min(per_link.values()), max(per_link.values())
        gap = high / low - 1 if low > 0 else 0.0
        out.append({"method": method, "compute_time": per_link, "disagreement": gap,
                    "flagged": len(per_link) > 1 and gap > limit})
    return out
