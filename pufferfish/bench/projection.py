"""Analytic α-β projection of step time to more workers and other bandwidths.

A benchmark on one machine measures two workers. The paper's question, whether training a
factorized model with plain all-reduce beats compressing the full model's gradients,
depends on the worker count ``p`` and the bandwidth ``B``, so we project the measured
figures with the textbook ring model (Thakur et al., 2005; the same model
``pufferfish.distributed.hooks.ring_bytes`` uses for bytes):

* all-reduce of ``n`` bytes, ``c`` collectives per step:
  ``T = c * 2(p-1) * α + 2(p-1)/p * 8n / B``;
* all-gather of ``n`` bytes per rank (signum, topk), ``c`` collectives per step:
  ``T = c * (p-1) * α + (p-1) * 8n / B``.
* FSDP2 (fsdp, pufferfish+fsdp), ``c`` all-gathers and reduce-scatters per step, each of
  whose rings sends ``(p-1)/p`` of the unsharded tensors: ``T = c * (p-1) * α + (p-1)/p * 8n / B``
  with ``n`` = the unsharded bytes all-gathered and reduce-scattered in one step (the model's
  parameters about three times: gathered in forward and again in backward, gradients
  scattered), i.e. the measured ring bytes x p/(p-1) (:func:`projected_payload`).

``B`` is in bits/s, ``n`` in bytes, ``α`` is the per-message latency in seconds (a link's
one-way delay: ``--bandwidth 100mbit@20ms`` projects at α = ``--alpha-us`` + 20 ms beside
``--alpha-us`` alone). The latency term is multiplied by the number of collectives a step
launches, which the hooks count (``collectives_per_step``): DDP one per bucket; PowerSGD three
per bucket (the uncompressed tensors, P, Q); signum and top-k their all-gathers; DiLoCo one per
outer step, i.e. 1 / ``inner_steps`` per step; FSDP2 its all-gathers and reduce-scatters. So on
a slow, far link a step of many buckets pays many round trips, and DiLoCo almost none.

A method's projected step time is ``compute + compress + T``: no overlap of communication
with backward is assumed, so this is an upper bound on a real step, the same quantity
the benchmark reports as ``comm_time`` (``step - compute``, the communication that
overlap did NOT hide). ``compute`` and ``compress`` are taken as measured on the benchmark
machine (so a bench run on your GPUs supplies its own per-method compute split), or set per
method from ``--compute-ms`` (:func:`with_compute`, which says where it fell back to this
machine's ratios), and assumed not to depend on ``p``.

Against DDP both step times are ``fixed + slope / B`` curves, so there is at most one
crossover bandwidth ``B* = (slope_ddp - slope_m) / (fixed_m - fixed_ddp)``: a method
that sends fewer bytes but computes more (compression) beats DDP below ``B*``; one that
sends fewer bytes and computes less (Pufferfish) beats it at every bandwidth.

Pure math, no torch: unit-tested with known numbers in ``tests/test_bench.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..distributed.hooks import hook_family
from .methods import BENCH_METHODS, FSDP_METHODS, base_of, hook_for

__all__ = [
    "ALLGATHER_METHODS",
    "DEFAULT_ALPHA",
    "DEFAULT_BANDWIDTHS",
    "DEFAULT_WORKERS",
    "CommProfile",
    "Compute",
    "Crossover",
    "comm_time",
    "crossover",
    "format_alpha",
    "link_alpha",
    "project",
    "projected_payload",
    "step_time",
    "with_compute",
]

DEFAULT_ALPHA = 50e-6  # s per message: a typical TCP/Ethernet latency in a data center
DEFAULT_WORKERS: tuple[int, ...] = (8, 16, 64)
DEFAULT_BANDWIDTHS: tuple[float, ...] = (1e9, 10e9, 100e9)  # bits/s
# Methods whose hook sends its payload with an all-gather (the hook registry says which).
ALLGATHER_METHODS = frozenset(
    method for method, (_, hook) in BENCH_METHODS.items() if hook_family(hook).collective == "allgather"
)

Kind = Literal["allreduce", "allgather", "sharded"]


@dataclass(frozen=True)
class CommProfile:
    """What one method costs per step on one worker, as measured by the benchmark.

    ``payload_bytes`` is the hooks' ``bytes_sent``: the all-reduce input size, or this
    rank's own all-gather contribution, without any algorithm factor; for FSDP2 the unsharded
    bytes of its collectives (:func:`projected_payload`).
    """

    method: str
    compute_time: float
    compress_time: float
    payload_bytes: float
    collectives: float = 1.0
    kind: Kind = "allreduce"

    @classmethod
    def for_method(
        cls,
        method: str,
        compute_time: float,
        compress_time: float,
        payload_bytes: float,
        collectives: float = 1.0,
    ) -> CommProfile:
        """Profile with the collective kind the method's hook (or FSDP2) uses."""
        base = base_of(method)  # a variant (powersgd:rank=2) sends as its method does
        kind: Kind = ("sharded" if base in FSDP_METHODS
                      else "allgather" if base in ALLGATHER_METHODS else "allreduce")
        return cls(method, compute_time, compress_time, payload_bytes, collectives, kind)

    def latency_term(self, p: int, alpha: float) -> float:
        """Seconds of per-message latency per step on ``p`` workers."""
        hops = 2 * (p - 1) if self.kind == "allreduce" else p - 1  # all-gather, reduce-scatter
        return self.collectives * hops * alpha

    def bits_on_wire(self, p: int) -> float:
        """Bits one rank sends per step under the ring model (``slope`` of ``1/B``)."""
        factor = {"allreduce": 2 * (p - 1) / p, "allgather": float(p - 1),
                  "sharded": (p - 1) / p}[self.kind]
        return factor * 8 * self.payload_bytes

    def fixed_time(self, p: int, alpha: float) -> float:
        """The part of a projected step that does not shrink with bandwidth."""
        return self.compute_time + self.compress_time + self.latency_term(p, alpha)


def projected_payload(record: dict[str, object]) -> float:
    """The ``payload_bytes`` of a measured record's profile: its ``bytes_per_step``, or for FSDP2
    the unsharded bytes its rings moved, ``ring_bytes_per_step x p/(p-1)`` (independent of p)."""
    if base_of(str(record["method"])) not in FSDP_METHODS:
        return float(record["bytes_per_step"])  # type: ignore[arg-type]
    p = float(record["workers"])  # type: ignore[arg-type]
    return float(record["ring_bytes_per_step"]) * p / (p - 1)  # type: ignore[arg-type]


def link_alpha(link: dict[str, object], p: int, alpha: float = DEFAULT_ALPHA) -> float:
    """α of a measured link (a bench record or link entry): its probed one-float all-reduce time
    (``link_rtt_s``) over the 2(p-1) messages of a ring all-reduce, or, not probed, ``alpha``
    plus its nominal one-way delay (``delay_ms``; 0 for records from before links had one)."""
    rtt = link.get("link_rtt_s")
    if rtt:
        return float(rtt) / (2 * (p - 1))  # type: ignore[arg-type]
    return alpha + float(link.get("delay_ms") or 0.0) / 1e3  # type: ignore[arg-type]


def _check(p: int, bandwidth_bps: float, alpha: float) -> None:
    if p < 2:
        raise ValueError(f"workers {p!r} is invalid: the model needs p >= 2")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth {bandwidth_bps!r} bit/s is invalid: allowed > 0")
    if not alpha >= 0:
        raise ValueError(f"alpha {alpha!r} s is invalid: allowed >= 0")


def comm_time(
    profile: CommProfile, p: int, bandwidth_bps: float, alpha: float = DEFAULT_ALPHA
) -> float:
    """Communication seconds per step under the ring α-β model (see the module doc)."""
    _check(p, bandwidth_bps, alpha)
    return profile.latency_term(p, alpha) + profile.bits_on_wire(p) / bandwidth_bps


def step_time(
    profile: CommProfile, p: int, bandwidth_bps: float, alpha: float = DEFAULT_ALPHA
) -> float:
    """Projected step seconds: measured compute + compress, plus modelled communication."""
    return profile.compute_time + profile.compress_time + comm_time(profile, p, bandwidth_bps, alpha)


@dataclass(frozen=True)
class Crossover:
    """Where a method's projected step time equals DDP's, and on which side it wins.

    ``region`` is ``"below"`` (beats DDP for bandwidths below ``bandwidth_bps``),
    ``"above"``, ``"always"`` or ``"never"`` (``bandwidth_bps`` is ``None`` for the last two).
    """

    region: Literal["below", "above", "always", "never"]
    bandwidth_bps: float | None = None

    def describe(self) -> str:
        if self.bandwidth_bps is None:
            return {"always": "beats DDP at every bandwidth", "never": "never beats DDP"}[
                self.region
            ]
        return f"beats DDP {self.region} {_fmt_bps(self.bandwidth_bps)}"


def crossover(
    method: CommProfile, ddp: CommProfile, p: int, alpha: float = DEFAULT_ALPHA
) -> Crossover:
    """Solve ``step_time(method, p, B) == step_time(ddp, p, B)`` for ``B``.

    Both sides are ``fixed + slope / B``; with ``dfix = fixed_m - fixed_ddp`` and
    ``dslope = slope_ddp - slope_m`` the method is faster iff ``dslope / B > dfix``, so
    the single crossover is ``B* = dslope / dfix`` when the signs agree.
    """
    _check(p, 1.0, alpha)
    dfix = method.fixed_time(p, alpha) - ddp.fixed_time(p, alpha)
    dslope = ddp.bits_on_wire(p) - method.bits_on_wire(p)
    if dslope > 0:  # the method sends less: it wins when bandwidth is scarce
        return Crossover("below", dslope / dfix) if dfix > 0 else Crossover("always")
    if dslope < 0:  # the method sends more: it can only win on a fast link
        return Crossover("above", dslope / dfix) if dfix < 0 else Crossover("never")
    return Crossover("always") if dfix < 0 else Crossover("never")


def project(
    profiles: list[CommProfile],
    workers: tuple[int, ...] = DEFAULT_WORKERS,
    bandwidths: tuple[float, ...] = DEFAULT_BANDWIDTHS,
    alpha: float = DEFAULT_ALPHA,
    baseline: str = "ddp",
) -> list[dict[str, object]]:
    """Projected step time of every profile for every ``(p, B)``, plus the crossover
    against ``baseline`` (when present) and the speedup over it; one record per
    ``(method, p, B)``, each with the ``alpha`` it was projected at."""
    base = next((pr for pr in profiles if pr.method == baseline), None)
    rows: list[dict[str, object]] = []
    for p in workers:
        for prof in profiles:
            cross = crossover(prof, base, p, alpha) if base is not None else None
            for bw in bandwidths:
                t = step_time(prof, p, bw, alpha)
                rows.append(
                    {
                        "method": prof.method,
                        "workers": p,
                        "bandwidth_bps": bw,
                        "alpha": alpha,
                        "step_time": t,
                        "comm_time": comm_time(prof, p, bw, alpha),
                        "speedup_vs_ddp": (step_time(base, p, bw, alpha) / t) if base else None,
                        "crossover_region": cross.region if cross else None,
                        "crossover_bps": cross.bandwidth_bps if cross else None,
                    }
                )
    return rows


# Where a projected method's compute came from (``Compute.sources``).
MEASURED, GIVEN, MODEL, CPU_RATIO = "measured", "given", "model", "cpu ratio"


@dataclass(frozen=True)
class Compute:
    """Profiles with compute-side times set from ``--compute-ms``, and where each came from:
    ``measured`` (no figures), ``given`` (the method's own ``METHOD=MS``: compute and
    encode/decode), ``model`` (its model's ``full=`` / ``factorized=``, encode/decode scaled by
    the same factor) or ``cpu ratio`` (a factorized method without ``factorized=``: scaled by the
    full-rank factor, i.e. this machine's low-rank/full ratio kept). ``scale`` /
    ``factorized_scale``: given ms over measured ms of each model; ``cpu_ratio``: the measured
    factorized/full compute ratio."""

    profiles: list[CommProfile]
    sources: dict[str, str]
    scale: float = 1.0
    factorized_scale: float = 1.0
    cpu_ratio: float = math.nan

    @property
    def assumes_cpu_ratio(self) -> bool:
        return CPU_RATIO in self.sources.values()


def _reference(profiles: list[CommProfile], method: str, factorized: bool) -> CommProfile | None:
    """The profile whose compute stands for a model: ``method``'s, else the first of the model."""
    return next((p for p in profiles if p.method == method), None) or next(
        (p for p in profiles if hook_for(p.method)[0] == factorized), None)


def with_compute(profiles: list[CommProfile], figures: dict[str, float] | None) -> Compute:
    """``profiles`` with each method's compute-side time from ``figures`` (ms, as
    :func:`pufferfish.bench.config.parse_compute_ms` returns them): a method named there computes
    that many ms with its encode/decode included; any other is scaled by its model's factor (given
    ms / measured ms), ``full`` (or ``ddp``) and ``factorized`` (or ``pufferfish``); a factorized
    method without a factorized figure takes the full-rank factor (``cpu ratio``). No figures:
    the measured profiles. ``ValueError`` without a measured full-rank method to scale from."""
    full = _reference(profiles, "ddp", False)
    low = _reference(profiles, "pufferfish", True)
    cpu_ratio = (low.compute_time / full.compute_time
                 if full is not None and low is not None and full.compute_time > 0 else math.nan)
    if not figures:
        return Compute(list(profiles), dict.fromkeys((p.method for p in profiles), MEASURED),
                       cpu_ratio=cpu_ratio)
    if full is None or full.compute_time <= 0:
        raise ValueError("--compute-ms needs a measured full-rank method (e.g. ddp) to scale from")
    full_ms = figures.get("full", figures.get("ddp"))
    low_ms = figures.get("factorized", figures.get("pufferfish"))
    scale = (full_ms or 0.0) / 1e3 / full.compute_time
    low_scale = (low_ms / 1e3 / low.compute_time
                 if low_ms is not None and low is not None and low.compute_time > 0 else scale)
    out, sources = [], {}
    for p in profiles:
        factorized = hook_for(p.method)[0]
        if p.method in figures:
            compute, compress, source = figures[p.method] / 1e3, 0.0, GIVEN
        else:
            k = low_scale if factorized else scale
            compute, compress = p.compute_time * k, p.compress_time * k
            source = CPU_RATIO if factorized and low_ms is None else MODEL
        out.append(CommProfile(p.method, compute, compress, p.payload_bytes, p.collectives,
                               p.kind))
        sources[p.method] = source
    return Compute(out, sources, scale, low_scale, cpu_ratio)


def format_alpha(alpha: float) -> str:
    """A latency as the reports print it: ``50 µs``, ``20.05 ms``."""
    return f"{1e6 * alpha:g} µs" if alpha < 1e-3 else f"{1e3 * alpha:.4g} ms"


def _fmt_bps(bps: float) -> str:
    if math.isinf(bps):
        return "inf"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"
