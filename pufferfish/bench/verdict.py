"""The verdict ``results.md`` opens with: per link, which method is fastest, and what would change it.

Per link and method: the measured step time, bytes per step, exposed communication
(``comm_time`` = step - compute-only step of the same model, encode/decode included) and the
speed-up over DDP, the fastest marked; then one sentence from the α-β model
(:mod:`pufferfish.bench.projection`): at ``s`` times the link's bandwidth a method's step is

    ``T(s) = max(min(compute + compress, step), step - wire + wire / s)``

with ``wire`` its ring bits per step over the link's rate (probed, else nominal): the measured
step with its time on the wire rescaled, never below its compute. Each ``T`` is piecewise linear
in ``1/s``, so the bandwidths where another method catches up with the winner are solved exactly
between 0.1x and 100x (:data:`FACTORS`); the nearest above and below the link's are named.
Pure math on the rows, no torch: tests build the rows by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from ..formatting import markdown_table
from . import projection as proj
from .bandwidth import format_bps

__all__ = ["FACTORS", "catch_up", "verdict", "verdict_markdown"]

FACTORS = (0.1, 100.0)  # the bandwidth range, as multiples of the link's, the sentence searches


def _line(row: dict[str, Any], bps: float) -> tuple[float, float, float]:
    """``(a, b, floor)``: ``T = max(floor, a + b x)`` with ``x = 1/s``."""
    prof = proj.CommProfile.for_method(row["method"], row["compute_time"], row["compress_time"],
                                       proj.projected_payload(row), row["collectives_per_step"])
    wire = prof.bits_on_wire(row["workers"]) / bps
    # Never above the measured step: a step measured below its compute (noise) stays as measured.
    floor = min(row["compute_time"] + row["compress_time"], row["step_time"])
    return row["step_time"] - wire, wire, floor


def _at(line: tuple[float, float, float], x: float) -> float:
    a, b, floor = line
    return max(floor, a + b * x)


def catch_up(winner: tuple[float, float, float], other: tuple[float, float, float],
             lo: float = 1 / FACTORS[1], hi: float = 1 / FACTORS[0]) -> list[float]:
    """Every ``x = 1/s`` in ``[lo, hi]`` where ``other``'s step equals ``winner``'s (both
    ``(a, b, floor)`` lines, :func:`_line`): solved on each piece where both are linear."""
    cuts = {lo, hi}
    for a, b, floor in (winner, other):
        if b > 0 and lo < (floor - a) / b < hi:
            cuts.add((floor - a) / b)
    points = sorted(cuts)
    roots: list[float] = []
    for x0, x1 in pairwise(points):
        g0 = _at(other, x0) - _at(winner, x0)
        g1 = _at(other, x1) - _at(winner, x1)
        if g0 == 0:
            roots.append(x0)
        elif g0 * g1 < 0:
            roots.append(x0 + (x1 - x0) * g0 / (g0 - g1))  # exact: g is linear on the piece
    if _at(other, points[-1]) == _at(winner, points[-1]):
        roots.append(points[-1])
    return sorted(set(roots))


def _changes(rows: list[dict[str, Any]], winner: dict[str, Any],
             bps: float) -> list[dict[str, Any]]:
    """The nearest bandwidth factor above and below 1 where a method catches up (if any)."""
    best = _line(winner, bps)
    found: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r is winner:
            continue
        for x in catch_up(best, _line(r, bps)):
            if x == 1.0:
                continue
            side = "more" if x < 1 else "less"
            factor = 1 / x
            if side not in found or abs(x - 1) < abs(1 / found[side]["factor"] - 1):
                found[side] = {"method": r["method"], "factor": factor, "bps": factor * bps}
    return [found[k] for k in ("more", "less") if k in found]


def _rounded(x: float) -> float:
    """``x`` to 6 significant digits: 999999999.9 bit/s reads as 1.0 Gbit/s."""
    return float(f"{x:.6g}")


def _sentence(link: str, winner: str, bps: float | None, n: int,
              changes: list[dict[str, Any]]) -> str:
    if n == 1:
        return f"{link}: {winner} is the only method measured."
    if bps is None:
        return (f"{link}: {winner} is fastest; the link has no measured rate (loopback without "
                "the probe), so the α-β model cannot say which bandwidth would change that.")
    if not changes:
        return (f"{link}: {winner} is fastest, and no bandwidth between {FACTORS[0]:g}x and "
                f"{FACTORS[1]:g}x the link's {format_bps(bps)} changes the winner (α-β model).")
    parts = [f"at {c['factor']:.3g}x the bandwidth ({format_bps(_rounded(c['bps']))}) "
             f"{c['method']} catches up" for c in changes]
    return f"{link}: {winner} is fastest; " + " and ".join(parts) + " (α-β model)."


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per link (in row order): its rows' figures with the fastest marked, the nearest
    bandwidths where another method catches up, and the sentence that says it. ``rows`` are
    the bench's summarized rows after :func:`pufferfish.bench.results.project` set their
    ``model_bps`` (the link's probed or nominal rate; ``None`` on loopback without the probe)."""
    links: list[dict[str, Any]] = []
    for link in dict.fromkeys(r["bandwidth"] for r in rows):
        here = [r for r in rows if r["bandwidth"] == link]
        winner = min(here, key=lambda r: r["step_time"])
        bps = winner.get("model_bps") or winner.get("link_bps") or winner.get("bandwidth_bps")
        changes = _changes(here, winner, bps) if bps else []
        links.append({
            "link": link, "bps": bps, "winner": winner["method"], "changes": changes,
            "sentence": _sentence(link, winner["method"], bps, len(here), changes),
            "rows": [{"method": r["method"], "step_time": r["step_time"],
                      "compute_time": r["compute_time"], "comm_time": r["comm_time"],
                      "compress_time": r["compress_time"], "bytes_per_step": r["bytes_per_step"],
                      "speedup_vs_ddp": r.get("speedup_vs_ddp"), "fastest": r is winner}
                     for r in here],
        })
    return {"factors": list(FACTORS), "links": links}


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def verdict_markdown(v: dict[str, Any]) -> list[str]:
    """The table and one sentence per link that ``results.md`` opens with."""
    head = ["link", "method", "step ms", "compute ms", "exposed comm ms", "encode/decode ms",
            "MB/step", "speed-up vs ddp", "fastest on this link"]
    table = [[link["link"], r["method"], _ms(r["step_time"]), _ms(r["compute_time"]),
              _ms(r["comm_time"]), _ms(r["compress_time"]), f"{r['bytes_per_step'] / 1e6:.3f}",
              "-" if r["speedup_vs_ddp"] is None else f"{r['speedup_vs_ddp']:.2f}x",
              "**fastest**" if r["fastest"] else ""]
             for link in v["links"] for r in link["rows"]]
    if not table:
        return []
    return [*markdown_table(head, table), "", *(link["sentence"] for link in v["links"])]
