"""From the bench's measured records to its results: the projection (with the model's prediction
of every measured row), time to accuracy from ``--accuracy-runs``, and ``--train``'s summary."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..training.metrics import read_metrics
from . import accuracy as acc
from . import projection as proj
from .accuracy import time_to_accuracy
from .config import BenchConfig, parse_compute_ms
from .methods import MethodSpec
from .verdict import verdict

__all__ = ["project", "time_to_accuracy_result", "train_summary"]


def _profile(method: str, recs: list[dict[str, Any]],
             all_recs: list[dict[str, Any]]) -> proj.CommProfile:
    """A method's profile for the projection.

    ``compute_time`` is the median over every record of the same model (full-rank or
    factorized, at a variant's own ``rank_ratio``; DDP's or FSDP2's), at every bandwidth:
    compute-only steps run no hook, so ddp, fp16, powersgd, signum and topk do identical work
    there, and pooling them damps the noise of a shared machine. ``compress_time`` is the median
    of the method's own records.
    """
    def layout(r: dict[str, Any]) -> tuple[bool, str, Any]:  # FSDP2's model: not channels_last
        return (r["factorized"], r.get("parallel", "ddp"),
                MethodSpec.parse(r["method"]).flat.get("rank_ratio"))

    same_model = [r["compute_time"] for r in all_recs if layout(r) == layout(recs[0])]
    return proj.CommProfile.for_method(
        method,
        compute_time=statistics.median(same_model),
        compress_time=statistics.median(r["compress_time"] for r in recs),
        payload_bytes=proj.projected_payload(recs[0]),
        collectives=recs[0]["collectives_per_step"],
    )


def project(records: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Projection to large clusters, and the model's prediction of every measured record."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    profiles = [_profile(m, rs, records) for m, rs in by_method.items()]
    figures = parse_compute_ms(cfg.compute_ms) if cfg.compute_ms is not None else None
    projected = proj.with_compute(profiles, figures)
    for r in records:
        bps = r["link_bps"] or r["bandwidth_bps"]
        r["model_bps"] = bps
        r["model_alpha"] = alpha = proj.link_alpha(r, r["workers"], cfg.alpha)
        if bps is None:
            r["predicted_step_time"] = r["prediction_error"] = None
            r["wire_time"] = r["overlap_bound"] = r["overlap_efficiency"] = None
            continue
        own = proj.CommProfile.for_method(r["method"], r["compute_time"], r["compress_time"],
                                          proj.projected_payload(r), r["collectives_per_step"])
        # Overlap efficiency: the best a step can do if communication hid entirely behind
        # compute (or compute behind the wire), max(compute, wire time), over the measured step.
        r["wire_time"] = own.bits_on_wire(r["workers"]) / bps
        r["overlap_bound"] = max(r["compute_time"], r["wire_time"])
        r["overlap_efficiency"] = r["overlap_bound"] / r["step_time"]
        pred = proj.step_time(own, r["workers"], bps, alpha)
        r["predicted_step_time"] = pred
        r["prediction_error"] = (pred - r["step_time"]) / r["step_time"]
    ddp = next((p for p in projected.profiles if p.method == "ddp"), None)
    crossovers = {
        p.method: {
            str(w): asdict(proj.crossover(p, ddp, w, cfg.alpha)) for w in proj.DEFAULT_WORKERS
        }
        for p in projected.profiles
        if ddp is not None and p.method != "ddp"
    }
    alphas = projection_alphas(records, cfg.alpha)
    return {
        "alpha": cfg.alpha,
        "alphas": alphas,
        "workers": list(proj.DEFAULT_WORKERS),
        "bandwidths_bps": list(proj.DEFAULT_BANDWIDTHS),
        "profiles": [asdict(p) for p in profiles],  # as measured here
        # each method's compute-side ms per step as projected, and where it came from
        "compute_figures": figures,
        "compute_ms": {p.method: 1e3 * (p.compute_time + p.compress_time)
                       for p in projected.profiles},
        "compute_sources": projected.sources,
        "cpu_lowrank_compute_ratio": projected.cpu_ratio,
        "rows": [row for a in alphas for row in proj.project(projected.profiles, alpha=a)],
        "crossovers": crossovers,  # at cfg.alpha; the rows have each alpha's
        "verdict": verdict(records),
    }


def projection_alphas(records: list[dict[str, Any]], alpha: float) -> list[float]:
    """The latencies the cluster projection is shown at: ``alpha`` (``--alpha-us``), and
    ``alpha`` plus each measured link's nominal one-way delay (``100mbit@20ms``: + 20 ms)."""
    delays = sorted({float(r.get("delay_ms") or 0.0) for r in records} - {0.0})
    return [alpha, *(alpha + d / 1e3 for d in delays)]


# -- time to accuracy -------------------------------------------------------------------------------


def time_to_accuracy_result(cfg: BenchConfig, rows: list[dict[str, Any]], links: list[str],
                            projection: dict[str, Any]) -> dict[str, Any] | None:
    """``--accuracy-runs`` timed with the measured step times of each link (and, with
    ``--compute-ms``, projected): curves and the time-to-target table, or ``None``."""
    if not cfg.accuracy_runs:
        return None
    runs = cfg.load_accuracy_runs()
    step_times = {(r["bandwidth"], r["method"]): acc.StepTime(r["step_time"],
                                                              *r["spread"]["step_time"])
                  for r in rows}
    target = acc.target_method(runs)
    ddp_final = runs[target].accuracies[-1]
    curves = acc.measured_curves(runs, step_times, links, cfg.workers)
    result: dict[str, Any] = {
        "runs": {m: {"path": r.path, "epochs": len(r.rows), "epochs_planned": r.epochs_planned,
                     "final_test_acc": r.accuracies[-1], "batch_size": r.batch_size,
                     "train_examples": r.train_examples} for m, r in runs.items()},
        "ddp_final_acc": ddp_final,  # the target_method's
        "target_method": target,
        "points_below": list(acc.TARGET_POINTS),
        "workers": cfg.workers,
        "accuracy_processes": cfg.accuracy_processes or cfg.workers,
        "measured": {"curves": [asdict(c) for c in curves],
                     "table": acc.target_table(curves, ddp_final, baseline=target)},
        "projected": None,
    }
    if cfg.compute_ms is not None:
        figures = parse_compute_ms(cfg.compute_ms)
        profiles = [proj.CommProfile(**p) for p in projection["profiles"]]
        alphas = projection.get("alphas") or [cfg.alpha]
        projected, info = acc.projected_curves(runs, profiles, figures, alpha=cfg.alpha,
                                               alphas=alphas)
        result["projected"] = {
            "compute_ms": figures.get("full", figures.get("ddp")),
            "factorized_compute_ms": figures.get("factorized", figures.get("pufferfish")),
            "compute_figures": figures, **info,
            "alpha": cfg.alpha, "alphas": alphas,
            "workers": list(acc.PROJECTED_WORKERS),
            "bandwidths_bps": list(proj.DEFAULT_BANDWIDTHS),
            "curves": [asdict(c) for c in projected],
            "table": acc.target_table(projected, ddp_final, baseline=target)}
    return result


def train_summary(text: str, done: list[tuple[str, Path]]) -> list[dict[str, Any]]:
    """Per ``--train`` run of link ``text``: final and best accuracy, training time, and the time
    to reach the best accuracy that every run of that link reached."""
    rows = {m: read_metrics(d) for m, d in done}
    target = min(max(r["test_acc"] for r in rs) for rs in rows.values())
    return [
        {
            "method": m,
            "bandwidth": text,
            "epochs": len(rs),
            "final_test_acc": rs[-1]["test_acc"],
            "best_test_acc": max(r["test_acc"] for r in rs),
            "train_time": sum(r["epoch_time"] for r in rs),
            "target_acc": target,
            "time_to_target": time_to_accuracy(rs, target),
        }
        for m, rs in rows.items()
    ]
