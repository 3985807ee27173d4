"""What a link really delivers: a timed, checked gloo all-reduce across it, and its latency.

Lets the bench print "emulated 100mbit, measured 94 Mbit/s", so a misconfigured link shows, and
"round trip 40.3 ms" for a link emulated with a 20 ms one-way delay (``100mbit@20ms``).
The worker side is ``_probe.py``; ``python -m pufferfish.bench.probe 100mbit`` measures links.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .bandwidth import format_bps, parse_link
from .netns import EmulatedLink, cleanup_stale, netem_available, netns_available
from .workers import run_workers

__all__ = ["ProbeResult", "measure_link", "measure_throughput", "probe_result", "run_probe"]

_PROBE = Path(__file__).with_name("_probe.py")


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of one all-reduce probe (see :func:`run_probe`)."""

    nbytes: int
    seconds: float
    bus_bps: float
    correct: bool
    world_size: int
    latency_s: float = 0.0  # median all-reduce of one float (slowest rank): 2 ranks, a round trip

    @property
    def alpha_s(self) -> float:
        """Per-message latency of the α-β model: a small ring all-reduce is 2(p-1) messages."""
        return self.latency_s / (2 * (self.world_size - 1))


def run_probe(
    link: EmulatedLink | None,
    nbytes: int = 25_000_000,
    iters: int = 1,
    timeout: float = 120.0,
) -> ProbeResult:
    """Time a gloo all_reduce of ``nbytes`` across the link and verify its result.

    Bus bandwidth follows the nccl-tests convention, ``busbw = size/time *
    2(n-1)/n``: it is the per-rank, per-direction link rate a ring all-reduce
    achieves, so it is directly comparable with the emulated rate.
    """
    results = run_workers(
        link,
        lambda rank: [sys.executable, str(_PROBE), "--nbytes", str(nbytes), "--iters", str(iters)],
        timeout=timeout,
    )
    bad = [(r, p) for r, p in enumerate(results) if p.returncode != 0]
    if bad:
        msg = "; ".join(
            f"rank {r} exited {p.returncode}: {p.stderr.strip()[-1500:]}" for r, p in bad
        )
        raise RuntimeError(f"all-reduce probe failed: {msg}")
    reports = []
    for r, p in enumerate(results):
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"all-reduce probe rank {r} printed no result: {p.stdout!r}")
        reports.append(json.loads(lines[-1]))
    return probe_result(reports, iters)


def probe_result(reports: Sequence[dict], iters: int = 1) -> ProbeResult:
    """One :class:`ProbeResult` from every rank's report (``_probe.measure``): the slowest
    rank's times; bus bandwidth as nccl-tests count it."""
    world = len(reports)
    seconds = max(float(rep["seconds"]) for rep in reports)
    size = int(reports[0]["nbytes"])
    bus_bps = size * 8 * iters / seconds * 2 * (world - 1) / world
    correct = all(bool(rep["correct"]) for rep in reports)
    latency = max(float(rep["small_seconds"]) for rep in reports)
    return ProbeResult(nbytes=size, seconds=seconds, bus_bps=bus_bps, correct=correct,
                       world_size=world, latency_s=latency)


def measure_throughput(link: EmulatedLink | None, nbytes: int = 25_000_000) -> float:
    """Achieved all-reduce bus bandwidth (bits/s) over ``link`` (``None`` = loopback).

    Lets the benchmark print "emulated 100mbit, measured 94 Mbit/s" so that a
    misconfigured (or unshaped) link is visible instead of silently skewing results.
    Raises if the all-reduce result is wrong.
    """
    return measure_link(link, nbytes).bus_bps


def measure_link(link: EmulatedLink | None, nbytes: int = 25_000_000) -> ProbeResult:
    """:func:`run_probe` that raises if the all-reduce result is wrong: the bus bandwidth the
    link delivers and its latency (``latency_s``, a small all-reduce: 2 ranks, a round trip)."""
    res = run_probe(link, nbytes=nbytes)
    if not res.correct:
        raise RuntimeError("all-reduce probe returned a wrong result")
    return res


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m pufferfish.bench.probe 100mbit 1gbit 100mbit@20ms``: measure emulated links."""
    import argparse

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("rates", nargs="*", default=["100mbit", "1gbit"])
    ap.add_argument("--nbytes", type=int, default=25_000_000)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    stale = cleanup_stale()
    if stale:
        print(f"removed stale namespaces: {', '.join(stale)}")
    for text in args.rates:
        rate, delay_ms = parse_link(text)
        delay_ms = delay_ms or args.delay_ms
        if rate is None:
            res = run_probe(None, nbytes=args.nbytes)
            print(
                f"loopback: measured {format_bps(res.bus_bps)} all-reduce bus bandwidth "
                f"({res.seconds:.3f} s, correct={res.correct}), round trip "
                f"{1e3 * res.latency_s:.2f} ms"
            )
            continue
        reason = netem_available() if delay_ms > 0 else netns_available()
        if reason is not None:
            print(f"{text}: skipped ({reason})")
            continue
        with EmulatedLink(rate, delay_ms=delay_ms) as link:
            res = run_probe(link, nbytes=args.nbytes)
        print(
            f"emulated {text}: measured {format_bps(res.bus_bps)} all-reduce bus bandwidth "
            f"({res.bus_bps / rate:.0%} of rate, {res.seconds:.3f} s, correct={res.correct}), "
            f"round trip {1e3 * res.latency_s:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
