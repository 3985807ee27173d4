"""Time to accuracy from loopback accuracy curves and per-link step times.

Test accuracy per epoch does not depend on the link a run trained over: the same steps
compute the same weights. Wall-clock time does, through the step time. So a curve of
accuracy against time on a slow link needs no training over that link: it combines

* the per-epoch test accuracy of ``pufferfish train`` runs (``metrics.jsonl``, one run per
  method, trained anywhere: e.g. two processes over loopback), with
* the step times :mod:`pufferfish.bench.runner` measures for the same model and batch on
  each link (median over rounds, with min–max), or projects with the α-β model of
  :mod:`pufferfish.bench.projection` for ``p`` workers at a user's GPU compute time
  (``--compute-ms full=MS,factorized=MS,METHOD=MS``) and at each latency the
  projection is shown at.

Time at the end of epoch ``e`` is ``sum over epochs <= e of steps_per_epoch x step time``
of the method in that epoch's phase: a factorized method (Pufferfish) steps at its
full-rank counterpart's time while its ``metrics.jsonl`` row says ``lowrank: false``
(warm-up; Pufferfish + all-reduce warms up as DDP, + PowerSGD as PowerSGD) and at its own
after the switch. The row's flag describes the model at the epoch's end, so an automatic
switch inside an epoch counts that whole epoch as low-rank. Evaluation and data loading
are not counted. The target is full-rank DDP's final test accuracy minus 0.5 and minus 1
point (FSDP2's when there is no DDP run: ``--parallel fsdp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..formatting import markdown_table
from ..training.metrics import read_metrics
from ..training.startup import load_run_config
from . import projection as proj
from . import time_to_target as ttt
from .bandwidth import format_bps
from .methods import (
    BENCH_METHODS,
    MethodSpec,
    parallel_for,
    parse_method_map,
    sync_for,
)
from .time_to_target import StepTime
from .workload import PUFFERFISH_RANK_RATIO

__all__ = [
    "FASHION_MNIST_TEST",
    "FASHION_MNIST_TRAIN",
    "PROJECTED_WORKERS",
    "TARGET_POINTS",
    "AccuracyRun",
    "Curve",
    "StepTime",
    "load_accuracy_runs",
    "markdown",
    "measured_curves",
    "parse_accuracy_runs",
    "phase_methods",
    "plot",
    "projected_curves",
    "steps_per_epoch",
    "target_method",
    "target_table",
    "time_to_accuracy",
    "wallclock",
]

TARGET_POINTS: tuple[float, ...] = (0.5, 1.0)  # below full-rank DDP's final accuracy
TARGET_METHODS = ("ddp", "fsdp")  # the full-rank run that sets the target, first found
PROJECTED_WORKERS: tuple[int, ...] = (8, 64)
FASHION_MNIST_TRAIN = 60_000  # training images (a run trains on those val_subset leaves)
FASHION_MNIST_TEST = 10_000


# -- accuracy runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AccuracyRun:
    """One ``pufferfish train`` run standing for a bench method: its per-epoch rows."""

    method: str
    path: str
    rows: list[dict[str, Any]]
    epochs_planned: int
    batch_size: int
    train_examples: int

    @property
    def finished(self) -> bool:
        return len(self.rows) >= self.epochs_planned

    @property
    def accuracies(self) -> list[float]:
        return [r["test_acc"] for r in self.rows]


def parse_accuracy_runs(spec: str) -> dict[str, Path]:
    """``"ddp=runs/a,pufferfish=runs/b"`` -> ``{method: run directory}`` (``ValueError``); a
    method may carry settings (``powersgd:rank=2=runs/p``: the key is everything before the last
    ``=``), made canonical."""
    runs = {m: Path(d) for m, d in parse_method_map(
        spec, "--accuracy-runs", "METHOD=RUN_DIR, e.g. ddp=runs/full,pufferfish=runs/pufferfish",
        None, ", ".join(BENCH_METHODS)).items()}
    if not set(TARGET_METHODS) & set(runs):
        raise ValueError(f"--accuracy-runs {spec!r} has no ddp run (or fsdp run): the target is "
                         "full-rank DDP's (FSDP2's) final accuracy")
    return runs


def target_method(runs: Mapping[str, Any]) -> str:
    """The run whose final accuracy sets the targets: ddp's, else (``--parallel fsdp``) fsdp's."""
    return next(m for m in TARGET_METHODS if m in runs)


def load_accuracy_runs(
    spec: str, *, model: str, width: float, batch_size: int, powersgd_rank: int,
    workers: int = 2, processes: int = 0, inner_steps: int = 0,
    rank_ratio: float | None = PUFFERFISH_RANK_RATIO,
) -> dict[str, AccuracyRun]:
    """Read and check the runs of ``--accuracy-runs`` against what the bench measures.

    Each must be a Fashion-MNIST run of ``model`` at ``width`` and ``batch_size`` per
    process, trained the way its method says (mode, comm hook, PowerSGD rank, Pufferfish's
    paper preset at ``rank_ratio``; a method's own settings, ``powersgd:rank=2``, over these):
    otherwise its accuracy does not belong to the measured steps. ``ValueError`` with one line naming the run and the mismatch. Runs trained on
    ``processes`` processes other than the bench's ``workers`` (say one GPU at batch 128 for
    2 x 64) must match the global batch instead: the same steps per epoch, so the same curve.
    """

    runs: dict[str, AccuracyRun] = {}
    for method, path in parse_accuracy_runs(spec).items():
        where = f"--accuracy-runs {method}={path}"
        if not (path / "metrics.jsonl").is_file():
            raise ValueError(f"{where}: no metrics.jsonl there (not a `pufferfish train` run "
                             "directory)")
        try:
            cfg = load_run_config(path / "config.toml")
        except ConfigError as e:
            raise ValueError(f"{where}: {e}") from None
        rows = [r for r in read_metrics(path) if r.get("test_acc") is not None]
        if not rows:
            raise ValueError(f"{where}: metrics.jsonl has no epoch with test_acc yet")
        spec = MethodSpec.parse(method)
        factorized, hook, own = spec.factorized, spec.hook, spec.flat
        expect = {"data": "fashion-mnist", "model": model, "width": width,
                  "batch_size": batch_size, "mode": "pufferfish" if factorized else "full",
                  "comm": hook, "sync": sync_for(method), "parallel": parallel_for(method)}
        if sync_for(method) == "diloco" and inner_steps:
            expect["inner_steps"] = own.get("inner_steps", inner_steps)
        if processes and processes != workers:
            if cfg.batch_size * processes != batch_size * workers:
                raise ValueError(f"{where}: its global batch {cfg.batch_size} x {processes} "
                                 f"processes differs from the bench's {batch_size} x {workers} "
                                 "workers: allowed the same number of examples per step")
            del expect["batch_size"]
        if hook == "powersgd":
            expect["powersgd_rank"] = own.get("powersgd_rank", powersgd_rank)
        if factorized:
            ratio = own.get("rank_ratio", rank_ratio)
            expect |= {"rank_ratio": str(ratio if ratio is not None else PUFFERFISH_RANK_RATIO),
                       "preset": "paper"}
        for key, want in expect.items():
            got = getattr(cfg, key)
            if got != want and str(got) != str(want):
                raise ValueError(f"{where}: the run has {key} {got!r} but the bench's {method} "
                                 f"measures {key} {want!r}")
        if not factorized and any(r.get("lowrank") for r in rows):
            raise ValueError(f"{where}: the run has low-rank epochs but {method} is full-rank")
        # batch_size: the bench's per-worker batch, which the checks above made the run's too
        # (or its equal share of the same global batch)
        runs[method] = AccuracyRun(method, str(path), rows, cfg.epochs, batch_size,
                                   cfg.train_subset or FASHION_MNIST_TRAIN - cfg.val_subset)
    return runs


def steps_per_epoch(train_examples: int, batch_size: int, workers: int) -> int:
    """Optimizer steps per epoch: every rank gets ``N // workers`` examples, full batches only
    (the training loader's ``drop_last``)."""
    return (train_examples // workers) // batch_size


def phase_methods(method: str) -> tuple[str, str]:
    """``(full-rank phase, low-rank phase)`` bench methods whose step times a run's epochs take:
    a factorized method warms up as the full-rank method with the same hook, synchronization and
    parallelism (pufferfish+fsdp as fsdp), and the hook's own settings
    (``pufferfish+powersgd:rank_ratio=0.5:rank=2`` warms up as ``powersgd:rank=2``)."""
    spec = MethodSpec.parse(method)
    if not spec.factorized:
        return method, method
    full = next(m for m, (f, h) in BENCH_METHODS.items()
                if not f and h == spec.hook and sync_for(m) == sync_for(method)
                and parallel_for(m) == parallel_for(method))
    return spec.with_base(full).name, method


# -- curves ------------------------------------------------------------------------------------


def wallclock(
    rows: Sequence[Mapping[str, Any]], steps: int, full_step: float, lowrank_step: float
) -> list[float]:
    """Seconds of training at the end of each epoch: ``steps`` per epoch at ``full_step``
    seconds, or ``lowrank_step`` in epochs whose row says ``lowrank``."""
    return ttt.phase_ends([(steps, lowrank_step if row.get("lowrank") else full_step)
                           for row in rows])


def time_to_accuracy(
    rows: Sequence[Mapping[str, Any]], target: float, times: Sequence[float] | None = None
) -> float | None:
    """Seconds until test accuracy first reaches ``target`` (``None``: never).

    ``times`` are the seconds at each epoch's end; by default the run's own clock, the
    cumulative ``epoch_time`` (training without evaluation).
    """
    if times is None:
        times = ttt.phase_ends([(1, row["epoch_time"]) for row in rows])
    return ttt.reach([(t, row["test_acc"]) for row, t in zip(rows, times)], target,
                     higher_is_better=True)


@dataclass(frozen=True)
class Curve:
    """Accuracy against seconds for one method in one regime (a link, or a projected cluster);
    ``low``/``high`` are the seconds with every step time at its low/high end."""

    method: str
    regime: str
    steps_per_epoch: int
    accuracies: list[float]
    times: list[float]
    low: list[float]
    high: list[float]
    step_times: dict[str, float] = field(default_factory=dict)  # phase -> median seconds


def _curve(run: AccuracyRun, regime: str, steps: int, full: StepTime,
           lowrank: StepTime) -> Curve:
    rows = run.rows
    return Curve(
        run.method, regime, steps, run.accuracies,
        wallclock(rows, steps, full.median, lowrank.median),
        wallclock(rows, steps, full.low, lowrank.low),
        wallclock(rows, steps, full.high, lowrank.high),
        {"full": full.median, "lowrank": lowrank.median},
    )


def measured_curves(
    runs: Mapping[str, AccuracyRun],
    step_times: Mapping[tuple[str, str], StepTime],
    links: Sequence[str],
    workers: int,
) -> list[Curve]:
    """A curve per link and run, with the bench's step times of ``(link, method)``.

    A method whose phases were not both measured on a link gets no curve there.
    """
    curves: list[Curve] = []
    for link in links:
        for method, run in runs.items():
            full, low = (step_times.get((link, m)) for m in phase_methods(method))
            if full is None or low is None:
                continue
            steps = steps_per_epoch(run.train_examples, run.batch_size, workers)
            curves.append(_curve(run, link, steps, full, low))
    return curves


def projected_curves(
    runs: Mapping[str, AccuracyRun],
    profiles: Sequence[proj.CommProfile],
    compute_ms: float | Mapping[str, float],
    workers: Sequence[int] = PROJECTED_WORKERS,
    bandwidths: Sequence[float] = proj.DEFAULT_BANDWIDTHS,
    alpha: float = proj.DEFAULT_ALPHA,
    factorized_ms: float | None = None,
    alphas: Sequence[float] | None = None,
) -> tuple[list[Curve], dict[str, Any]]:
    """Curves for ``p`` workers at each bandwidth (and each of ``alphas``, default ``alpha``),
    with step times from the α-β model.

    ``compute_ms`` is the user's ms per step (one worker's batch): the full-rank model's, or
    ``--compute-ms``'s figures per key (``full``, ``factorized``, methods), ``factorized_ms``
    the factorized model's; :func:`~pufferfish.bench.projection.with_compute` sets each
    method's compute-side time from them, keeping this CPU's low-rank/full ratio where no
    factorized figure is given (``info["assumes_cpu_ratio"]``). Communication is the model's,
    with no overlap. Weak scaling: each worker keeps the runs' batch, so an epoch has
    ``N // p // batch`` steps, and accuracy per epoch is assumed to stay that of the runs (an
    assumption at a larger global batch). Returns the curves and ``{"scale",
    "factorized_scale", "lowrank_compute_ratio" (as projected), "cpu_lowrank_compute_ratio",
    "assumes_cpu_ratio", "sources"}``.
    """
    figures = (dict(compute_ms) if isinstance(compute_ms, Mapping)
               else {"full": float(compute_ms)})
    if factorized_ms is not None:
        figures["factorized"] = factorized_ms
    gpu = proj.with_compute(list(profiles), figures)
    info = {"scale": gpu.scale, "factorized_scale": gpu.factorized_scale,
            "lowrank_compute_ratio": gpu.cpu_ratio * gpu.factorized_scale / gpu.scale,
            "cpu_lowrank_compute_ratio": gpu.cpu_ratio,
            "assumes_cpu_ratio": gpu.assumes_cpu_ratio, "sources": gpu.sources}
    by_method = {p.method: p for p in gpu.profiles}

    def step_at(method: str, p: int, bw: float, a: float) -> StepTime | None:
        prof = by_method.get(method)
        return None if prof is None else StepTime.exact(proj.step_time(prof, p, bw, a))

    curves: list[Curve] = []
    latencies = list(alphas) if alphas else [alpha]
    for a in latencies:
        for p in workers:
            for bw in bandwidths:
                regime = f"p={p}, {format_bps(bw)}"
                regime += f", α {proj.format_alpha(a)}" if len(latencies) > 1 else ""
                for method, run in runs.items():
                    full, low_step = (step_at(m, p, bw, a) for m in phase_methods(method))
                    if full is None or low_step is None:
                        continue
                    steps = steps_per_epoch(run.train_examples, run.batch_size, p)
                    curves.append(_curve(run, regime, steps, full, low_step))
    return curves, info


# -- targets -----------------------------------------------------------------------------------


def target_table(
    curves: Sequence[Curve], ddp_final: float, points: Sequence[float] = TARGET_POINTS,
    baseline: str = "ddp",
) -> list[dict[str, Any]]:
    """Per regime, method and target (``ddp_final`` minus ``points`` percentage points): the
    epoch and seconds at which the curve first reaches it, with low/high seconds, and the
    speed-up over DDP's curve in the same regime with its worst/best case (DDP's low time
    over the method's high, DDP's high over the method's low); DDP is ``baseline``'s curve."""
    table: list[dict[str, Any]] = []
    for point in points:
        target = ddp_final - point / 100
        for regime in dict.fromkeys(c.regime for c in curves):
            here = [c for c in curves if c.regime == regime]
            reach = {c.method: _reach(c, target) for c in here}
            ddp = reach.get(baseline)
            for c in here:
                row = {"regime": regime, "method": c.method, "points_below": point,
                       "target_acc": target, "best_acc": max(c.accuracies),
                       "step_times": c.step_times, **reach[c.method]}
                row["speedup_vs_ddp"] = row["speedup_worst"] = row["speedup_best"] = None
                if c.method == baseline and row["seconds"] is not None:  # itself, exactly
                    row["speedup_vs_ddp"] = row["speedup_worst"] = row["speedup_best"] = 1.0
                elif ddp and ddp["seconds"] is not None and row["seconds"] is not None:
                    row["speedup_vs_ddp"] = ddp["seconds"] / row["seconds"]
                    row["speedup_worst"] = ddp["seconds_low"] / row["seconds_high"]
                    row["speedup_best"] = ddp["seconds_high"] / row["seconds_low"]
                table.append(row)
    return table


def _reach(curve: Curve, target: float) -> dict[str, Any]:
    epoch = ttt.reach(list(enumerate(curve.accuracies, 1)), target, higher_is_better=True)
    if epoch is None:
        return {"epoch": None, "seconds": None, "seconds_low": None, "seconds_high": None}
    return {"epoch": epoch, "seconds": curve.times[epoch - 1],
            "seconds_low": curve.low[epoch - 1], "seconds_high": curve.high[epoch - 1]}


# -- report ------------------------------------------------------------------------------------


def _pivot(table: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[float, Any]]:
    """``{(regime, method): {points_below: row}}``, regimes and methods in table order."""
    out: dict[tuple[str, str], dict[float, Any]] = {}
    for row in table:
        out.setdefault((row["regime"], row["method"]), {})[row["points_below"]] = row
    return out


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _reach_cells(row: Mapping[str, Any], ranges: bool) -> list[str]:
    if row["seconds"] is None:
        return [f"not reached (best {100 * row['best_acc']:.2f}%)", "-", "-"]
    secs = _seconds(row["seconds"])
    if ranges:
        secs += f" [{_seconds(row['seconds_low'])}–{_seconds(row['seconds_high'])}]"
    speed = "-"
    if row["speedup_vs_ddp"] is not None:
        speed = f"{row['speedup_vs_ddp']:.2f}x"
        if ranges:
            speed += f" [{row['speedup_worst']:.2f}–{row['speedup_best']:.2f}]"
    return [str(row["epoch"]), secs, speed]


def _table(table: Sequence[Mapping[str, Any]], points: Sequence[float], regime: str,
           ranges: bool) -> list[str]:
    head = [regime, "method", "step ms"]
    for p in points:
        head += [f"epoch at −{p:g}", f"s to −{p:g}", f"speed-up (−{p:g})"]
    rows = []
    for (reg, method), by_point in _pivot(table).items():
        steps = by_point[points[0]]["step_times"]
        full, low = (f"{1e3 * steps[k]:.1f}" for k in ("full", "lowrank"))
        cells = [reg, method, full if full == low else f"{full} → {low}"]
        for p in points:
            cells += _reach_cells(by_point[p], ranges)
        rows.append(cells)
    return markdown_table(head, rows)


def _run_cells(method: str, run: Mapping[str, Any]) -> list[str]:
    done = f"{run['epochs']} of {run['epochs_planned']}"
    if run["epochs"] < run["epochs_planned"]:
        done += " (unfinished)"
    return [method, f"`{run['path']}`", done, f"{100 * run['final_test_acc']:.2f}%"]


def _processes(tta: Mapping[str, Any]) -> str:
    """How the runs' process count relates to the bench's workers (older results: the same)."""
    processes = tta.get("accuracy_processes", tta["workers"])
    if processes == tta["workers"]:
        return f"the runs used {processes} processes"
    return (f"the runs used {processes} process(es) at the same global batch: the same steps "
            "per epoch, the batch statistics of BatchNorm over a different split")


def _baseline_name(tta: Mapping[str, Any]) -> str:
    return "FSDP2" if tta.get("target_method") == "fsdp" else "DDP"


def markdown(tta: Mapping[str, Any]) -> list[str]:
    """The ``results.md`` sections of :func:`pufferfish.bench.results.time_to_accuracy_result`."""
    points = tta["points_below"]
    final = tta["ddp_final_acc"]
    ddp = _baseline_name(tta)
    targets = ", ".join(f"{100 * (final - p / 100):.2f}% (−{p:g})" for p in points)
    lines = [
        "", "## Time to accuracy: accuracy of the training runs, time of the measured steps", "",
        "Test accuracy per epoch comes from the `pufferfish train` runs below, trained once "
        "(over loopback): accuracy per epoch does not depend on the link. Time at an epoch's end "
        "= the sum over epochs so far of steps/epoch x the method's step time measured on the "
        "link (median over rounds); a Pufferfish epoch steps at DDP's time while the run is "
        "full-rank (warm-up) and at its own after the switch (the run's `lowrank` flag). "
        f"Steps/epoch = ⌊N / {tta['workers']} workers⌋ / batch ({_processes(tta)}). "
        "Evaluation and data loading are not counted. "
        "step ms: median step time (a Pufferfish run's warm-up → after the switch). "
        f"[low–high]: every step time at its min / max over rounds; speed-up vs {ddp} "
        f"[worst–best]: {ddp}'s low time over the method's high, and {ddp}'s high over the "
        "method's low.", "",
        *markdown_table(["method", "run", "epochs", "final test acc"],
                        [_run_cells(method, run) for method, run in tta["runs"].items()]),
    ]
    lines += ["", f"Targets: {ddp}'s final {100 * final:.2f}% minus 0.5 and 1 point: {targets}.",
              "", *_table(tta["measured"]["table"], points, "link", ranges=True)]
    pj = tta["projected"]
    if pj:
        lines += [
            "", "## Time to accuracy, PROJECTED for "
            + " and ".join(str(p) for p in pj["workers"]) + " workers", "",
            f"Projected, not measured. {_compute_note(pj)} Communication: the ring "
            f"α-β model (α = {_alphas(pj)} per message), no overlap with backward (an upper "
            "bound). Weak scaling: each worker keeps the runs' batch, so an epoch has "
            "⌊N / p⌋ / batch steps, and accuracy per epoch is assumed to stay the runs' "
            "(an assumption at the larger global batch).", "",
            *_table(pj["table"], points, "regime", ranges=False),
        ]
    return lines


def _compute_note(pj: Mapping[str, Any]) -> str:
    """How the projected compute times were set: the user's figures, or the CPU's ratio."""
    figures = pj.get("compute_figures") or {"full": pj["compute_ms"]}
    given = ",".join(f"{k}={v:g}" for k, v in figures.items())
    head = (f"Compute per step from `--compute-ms {given}` (ms, one worker's batch on the "
            "user's GPU; a METHOD= figure includes its encode/decode)")
    if pj.get("assumes_cpu_ratio", True):
        return (f"{head}; no factorized figure given, so the factorized model's compute-side "
                f"times are scaled by the full-rank factor {pj['scale']:.3g}: ASSUMES the "
                "factorized model keeps the low-rank/full compute ratio of this CPU "
                f"({pj['lowrank_compute_ratio']:.2f}); the MAC ratio would flatter it, as small "
                "factorized layers do not run at full speed.")
    return (f"{head}: a low-rank/full ratio of {pj['lowrank_compute_ratio']:.2f}, this CPU's "
            f"{pj['cpu_lowrank_compute_ratio']:.2f}; a method without its own figure has its "
            "hook encode/decode scaled by its model's factor.")


def _alphas(pj: Mapping[str, Any]) -> str:
    return " and ".join(proj.format_alpha(a) for a in pj.get("alphas") or [pj["alpha"]])


def plot(tta: Mapping[str, Any], out: Path) -> list[Path]:
    """``time_to_accuracy.png`` (a panel per link) and, when projected,
    ``time_to_accuracy_projected.png`` (a panel per worker count and bandwidth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [tta["ddp_final_acc"] - p / 100 for p in tta["points_below"]]
    paths: list[Path] = []
    for key, name, note in (
        ("measured", "time_to_accuracy.png",
         "accuracy per epoch: the loopback `pufferfish train` runs; time: epochs x steps/epoch "
         "x step time measured by `pufferfish bench` on each link (median; bars: min–max)"),
        ("projected", "time_to_accuracy_projected.png",
         "PROJECTED: accuracy per epoch of the loopback runs; time from the α-β model at "
         "--compute-ms per step"),
    ):
        part = tta[key]
        if not part or not part["curves"]:
            continue
        curves = [Curve(**c) for c in part["curves"]]
        regimes = list(dict.fromkeys(c.regime for c in curves))
        ncols = len(regimes) if key == "measured" else len(part["bandwidths_bps"])
        nrows = -(-len(regimes) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.8 * nrows + 0.6),
                                 squeeze=False, sharey=True, sharex=key == "measured")
        accs = [a for c in curves for a in c.accuracies]
        bottom = max(min(accs), min(targets) - 0.04)
        for ax, regime in zip(axes.flat, regimes):
            for c in (x for x in curves if x.regime == regime):
                ys = [100 * a for a in c.accuracies]
                run = tta["runs"][c.method]
                label = c.method + ("" if run["epochs"] >= run["epochs_planned"] else
                                    f" ({run['epochs']}/{run['epochs_planned']} epochs)")
                xerr = [[t - lo for t, lo in zip(c.times, c.low)],
                        [hi - t for t, hi in zip(c.times, c.high)]]
                ax.errorbar(c.times, ys, xerr=xerr if c.low != c.high else None, marker=".",
                            capsize=2, elinewidth=0.8, label=label)
            for t, style in zip(targets, ("--", ":")):
                ax.axhline(100 * t, color="grey", linestyle=style, linewidth=0.8)
            ax.set(title=regime + (" (projected)" if key == "projected" else ""),
                   xlabel="training wall-clock (s)", ylim=(100 * bottom, 100 * max(accs) + 0.3))
            ax.grid(alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("test accuracy (%)")
        axes.flat[0].legend(fontsize=8, title=f"dashed: {_baseline_name(tta)} final −0.5, "
                                              "dotted: −1",
                            title_fontsize=7)
        fig.text(0.5, 0.01, note, ha="center", fontsize=8)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths
