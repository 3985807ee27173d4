"""``pufferfish bench``: every method over every network condition, measured, then projected.

Pufferfish's claim is a wall-clock one: a factorized model trained with plain all-reduce
ships fewer bytes than the full model, and computes less, so it should beat gradient
compressors (fp16, PowerSGD, signSGD, top-k) that ship even fewer bytes but pay for
encoding. Whether it does depends on the link, so the benchmark runs each method on each
link for real and then extrapolates with an explicit model:

1. For each ``--bandwidth`` (``loopback``, or a rate emulated by
   :class:`~pufferfish.bench.netns.EmulatedLink`: two network namespaces joined by a
   shaped veth pair) and each ``--methods`` entry, one group of ``--workers`` processes
   runs :mod:`pufferfish.bench.step`, which times compute-only and full DDP steps and
   writes one JSON record (rank 0). Emulated links need root and iproute2; without them
   those conditions are skipped with the reason, never replaced by loopback.
2. Before a link's runs, an all-reduce probe measures what the link really delivers
   (``link_bps``), so that a mis-shaped link is visible and the model below is fed the
   bandwidth the workers actually had.
3. :mod:`pufferfish.bench.projection` turns the measured compute/compress time and bytes
   into step times for 8/16/64 workers at 1/10/100 Gbit/s, with each method's crossover
   bandwidth against DDP, and predicts the measured 2-worker runs (its error column shows
   how far to trust it).

Outputs in ``--out``: ``results.json`` (one record per method and bandwidth),
``projection.json``, ``results.md`` and the plots ``step_time.png`` / ``projection.png``.

``--train`` instead trains each method for the same epochs with ``pufferfish train``
(the one training loop, launched in the namespaces) and plots test accuracy against
wall-clock time: the time-to-accuracy comparison the step times alone cannot give
(``train.md``, ``train_results.json``, ``train/<bandwidth>/{report.md,accuracy.png}``).

A failed worker group is reported (``results.md``, exit status 1) and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import projection as proj
from .netns import (
    EmulatedLink,
    WorkerTimeout,
    cleanup_stale,
    format_bps,
    measure_throughput,
    netns_available,
    parse_bandwidth,
    run_workers,
)
from .step import METHODS, hook_for

__all__ = [
    "DEFAULT_METHODS",
    "BenchConfig",
    "add_arguments",
    "config_from_args",
    "run_bench",
    "run_from_args",
    "run_train",
    "time_to_accuracy",
]

DEFAULT_METHODS = ("ddp", "fp16", "powersgd", "signum", "topk", "pufferfish")
IMAGE_MODELS = ("resnet18", "vgg19_bn")
PROBE_BYTES = 16_000_000  # large enough for steady-state throughput, a few s at 100mbit
STEP_TIMEOUT = 3600.0  # per worker group, when --timeout is not given
NO_TIMEOUT = 10.0 * 365 * 86400

Log = Callable[[str], None]


@dataclass
class BenchConfig:
    """Everything ``pufferfish bench`` needs; :meth:`validate` gives one-line errors."""

    model: str = "resnet18"
    width: float = 0.5
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    bandwidths: list[str] = field(default_factory=lambda: ["loopback"])
    workers: int = 2
    steps: int = 20
    warmup: int = 3
    compute_steps: int = 5
    batch_size: int = 128
    powersgd_rank: int = 4
    powersgd_start_iter: int = 2
    topk_ratio: float = 0.01
    signum_beta: float = 0.9
    threads: int = 0  # 0: cores // workers
    data_dir: str = ""
    alpha: float = proj.DEFAULT_ALPHA
    probe: bool = True
    timeout: float = 0.0  # 0: STEP_TIMEOUT per step group, no limit per training run
    out: str = "runs/bench"
    # --train
    train: bool = False
    epochs: int = 3
    warmup_epochs: int = 1
    train_subset: int = 0
    test_subset: int = 0
    lr: float = 0.1

    def validate(self) -> None:
        """Check every value before any process starts (``ValueError``: CLI exit 2)."""
        if self.model not in IMAGE_MODELS:
            raise ValueError(
                f"model {self.model!r} is invalid for the benchmark (Fashion-MNIST): "
                f"allowed {', '.join(IMAGE_MODELS)}"
            )
        if not self.methods:
            raise ValueError("--methods is empty: allowed a comma-separated list of "
                             + ", ".join(METHODS))
        for m in self.methods:
            hook_for(m)
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"--methods {','.join(self.methods)!r} names a method twice")
        if not self.bandwidths:
            raise ValueError("--bandwidth is empty: allowed e.g. loopback,1gbit,100mbit")
        rates = [parse_bandwidth(b) for b in self.bandwidths]
        if self.workers < 2:
            raise ValueError(f"--workers {self.workers} is invalid: allowed >= 2 (DDP)")
        if self.workers != 2 and any(r is not None for r in rates):
            raise ValueError(
                f"--workers {self.workers}: an emulated link connects exactly 2 workers; "
                "use --workers 2, or --bandwidth loopback for more workers"
            )
        for name in ("steps", "compute_steps", "batch_size", "powersgd_rank", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 1")
        if self.width <= 0:
            raise ValueError(f"width {self.width!r} is invalid: allowed > 0")
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"powersgd_start_iter {self.powersgd_start_iter} is invalid: allowed >= 2 "
                "(DDP re-buckets after step 1, and PowerSGD's memory must follow)"
            )
        if self.warmup < self.powersgd_start_iter:
            raise ValueError(
                f"warmup {self.warmup} is invalid: allowed >= powersgd_start_iter "
                f"({self.powersgd_start_iter}), so that timed PowerSGD steps compress"
            )
        if not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio {self.topk_ratio!r} is invalid: allowed 0 < ratio <= 1")
        if not 0 <= self.signum_beta < 1:
            raise ValueError(f"signum_beta {self.signum_beta!r} is invalid: allowed 0 <= beta < 1")
        for name in ("threads", "train_subset", "test_subset", "warmup_epochs", "alpha", "timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 0")
        if self.lr <= 0:
            raise ValueError(f"lr {self.lr!r} is invalid: allowed > 0")
        factorized = any(hook_for(m)[0] for m in self.methods)
        if self.train and factorized and self.warmup_epochs >= self.epochs:
            raise ValueError(
                f"warmup_epochs {self.warmup_epochs} is invalid with epochs {self.epochs}: "
                "Pufferfish methods need warmup_epochs < epochs"
            )
        data = Path(self.data_dir) if self.data_dir else _default_data_dir()
        if not data.is_dir():
            raise ValueError(
                f"Fashion-MNIST directory {str(data)!r} does not exist: install the Debian "
                "package dataset-fashion-mnist or pass --data-dir"
            )

    def worker_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.workers)


def _default_data_dir() -> Path:
    from ..data import DEFAULT_FASHION_DIR

    return Path(DEFAULT_FASHION_DIR)


# -- command line --------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pufferfish bench`` options (kept here so that ``cli.py`` stays parsing-only)."""
    d = BenchConfig()
    ap.add_argument("--model", default=d.model, help=f"{', '.join(IMAGE_MODELS)}")
    ap.add_argument("--width", type=float, default=d.width, help="channel multiplier")
    ap.add_argument("--methods", default=",".join(d.methods),
                    help=f"comma-separated, from: {', '.join(METHODS)}")
    ap.add_argument("--bandwidth", default="loopback",
                    help="comma-separated: loopback and/or emulated rates such as 1gbit,100mbit "
                         "(emulation needs root + iproute2 and exactly 2 workers)")
    ap.add_argument("--workers", type=int, default=d.workers,
                    help="processes per group; more than 2 only on loopback")
    ap.add_argument("--steps", type=int, default=d.steps, help="timed full DDP steps")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    ap.add_argument("--compute-steps", type=int, default=d.compute_steps,
                    help="timed steps under ddp.no_sync() (compute only)")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="per worker")
    ap.add_argument("--powersgd-rank", type=int, default=d.powersgd_rank)
    ap.add_argument("--powersgd-start-iter", type=int, default=d.powersgd_start_iter)
    ap.add_argument("--topk-ratio", type=float, default=d.topk_ratio)
    ap.add_argument("--signum-beta", type=float, default=d.signum_beta)
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="torch threads per worker (0: cores // workers)")
    ap.add_argument("--data-dir", default=d.data_dir, help="Fashion-MNIST directory")
    ap.add_argument("--alpha-us", type=float, default=d.alpha * 1e6,
                    help="per-message latency of the projection model, microseconds")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="skip the all-reduce probe that measures each link's real rate")
    ap.add_argument("--timeout", type=float, default=d.timeout,
                    help=f"seconds per worker group (0: {STEP_TIMEOUT:.0f} for step timing, "
                         "no limit for --train)")
    ap.add_argument("--out", default=d.out, help="output directory")
    ap.add_argument("--train", action="store_true",
                    help="train each method with `pufferfish train` and plot time-to-accuracy")
    ap.add_argument("--epochs", type=int, default=d.epochs, help="--train: epochs per method")
    ap.add_argument("--warmup-epochs", type=int, default=d.warmup_epochs,
                    help="--train: Pufferfish's full-rank warm-up epochs")
    ap.add_argument("--train-subset", type=int, default=d.train_subset,
                    help="--train: first N training examples (0: all)")
    ap.add_argument("--test-subset", type=int, default=d.test_subset,
                    help="--train: first N test examples (0: all)")
    ap.add_argument("--lr", type=float, default=d.lr, help="--train: learning rate")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A validated :class:`BenchConfig` from parsed ``add_arguments`` options."""
    cfg = BenchConfig(
        model=args.model, width=args.width,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        bandwidths=[b.strip() for b in args.bandwidth.split(",") if b.strip()],
        workers=args.workers, steps=args.steps, warmup=args.warmup,
        compute_steps=args.compute_steps, batch_size=args.batch_size,
        powersgd_rank=args.powersgd_rank, powersgd_start_iter=args.powersgd_start_iter,
        topk_ratio=args.topk_ratio, signum_beta=args.signum_beta, threads=args.threads,
        data_dir=args.data_dir, alpha=args.alpha_us * 1e-6, probe=args.probe,
        timeout=args.timeout, out=args.out, train=args.train, epochs=args.epochs,
        warmup_epochs=args.warmup_epochs, train_subset=args.train_subset,
        test_subset=args.test_subset, lr=args.lr,
    )  # fmt: skip
    cfg.validate()
    return cfg


def run_from_args(args: argparse.Namespace) -> int:
    """``pufferfish bench``: exit status 0, or 1 if some worker group failed."""
    cfg = config_from_args(args)
    result = run_train(cfg) if cfg.train else run_bench(cfg)
    return 1 if result["failures"] else 0


# -- running groups --------------------------------------------------------------------------------


def _condition(
    text: str, skipped: list[dict[str, str]], log: Log
) -> contextlib.AbstractContextManager[EmulatedLink | None] | None:
    """A context giving the link for one ``--bandwidth`` entry (``None``: loopback), or
    ``None`` (after saying why) when it cannot be emulated here.

    An emulated link lives only while its methods run; its ``with`` deletes the
    namespaces on every exit path, Ctrl-C included.
    """
    rate = parse_bandwidth(text)
    if rate is None:
        return contextlib.nullcontext()
    reason = netns_available()
    if reason is not None:
        log(f"skipping {text}: link emulation unavailable ({reason}); "
            "emulated conditions are never replaced by loopback")
        skipped.append({"bandwidth": text, "reason": reason})
        return None
    cleanup_stale()
    return EmulatedLink(rate)


def _fail(method: str, bandwidth: str, why: str, log: Log) -> dict[str, str]:
    log(f"[{bandwidth}] {method}: FAILED: {why}")
    return {"method": method, "bandwidth": bandwidth, "error": why}


def _worker_error(results: list[subprocess.CompletedProcess[str]]) -> str | None:
    """The last stderr line of the first failed rank, or ``None`` if all succeeded."""
    for rank, p in enumerate(results):
        if p.returncode != 0:
            lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
            return f"rank {rank} exited {p.returncode}: {lines[-1] if lines else 'no output'}"
    return None


def _step_argv(cfg: BenchConfig, method: str, out: Path, cache: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "pufferfish.bench.step", "--method", method,
        "--model", cfg.model, "--width", str(cfg.width), "--batch-size", str(cfg.batch_size),
        "--steps", str(cfg.steps), "--warmup", str(cfg.warmup),
        "--compute-steps", str(cfg.compute_steps), "--powersgd-rank", str(cfg.powersgd_rank),
        "--powersgd-start-iter", str(cfg.powersgd_start_iter),
        "--topk-ratio", str(cfg.topk_ratio), "--signum-beta", str(cfg.signum_beta),
        "--threads", str(cfg.worker_threads()), "--cache-dir", str(cache), "--out", str(out),
    ]  # fmt: skip
    if cfg.data_dir:
        argv += ["--data-dir", cfg.data_dir]
    return argv


def _worker_env() -> dict[str, str]:
    # The workers' own thread count is set with --threads; keep OpenMP from oversubscribing.
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_bench(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Measure every (bandwidth, method), project, and write the outputs to ``cfg.out``.

    Returns ``{"records", "projection", "skipped", "failures", "links"}``.
    """
    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    failures: list[dict[str, str]] = []
    links: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pf-bench-") as tmp:
        for text in cfg.bandwidths:
            cond = _condition(text, skipped, log)
            if cond is None:
                continue
            with cond as link:
                rate = link.rate_bps if link is not None else None
                probed = _probe(link, text, log) if cfg.probe else None
                links.append({"bandwidth": text, "bandwidth_bps": rate, "link_bps": probed})
                for method in cfg.methods:
                    got = _step_group(cfg, link, method, Path(tmp))
                    if isinstance(got, str):
                        failures.append(_fail(method, text, got, log))
                        continue
                    rec = {"bandwidth": text, "bandwidth_bps": rate, "link_bps": probed, **got}
                    records.append(rec)
                    log(f"[{text}] {method}: step {rec['step_time']:.4f} s = compute "
                        f"{rec['compute_time']:.4f} + comm {rec['comm_time']:.4f} "
                        f"(compress {rec['compress_time']:.4f}); "
                        f"{rec['bytes_per_step'] / 1e6:.3f} MB/step")
    _add_speedups(records)
    projection = _project(records, cfg)
    result = {"records": records, "projection": projection, "skipped": skipped,
              "failures": failures, "links": links}
    _write_outputs(cfg, result, log)
    return result


def _step_group(
    cfg: BenchConfig, link: EmulatedLink | None, method: str, tmp: Path
) -> dict[str, Any] | str:
    """One group of workers timing ``method``: rank 0's record, or why it failed."""
    timeout = cfg.timeout or STEP_TIMEOUT
    path = tmp / f"{method}-{os.urandom(4).hex()}.json"
    argv = _step_argv(cfg, method, path, tmp / "cache")
    try:
        results = run_workers(link, lambda rank: argv, env=_worker_env(), timeout=timeout,
                              world_size=cfg.workers)
    except WorkerTimeout:
        return f"timed out after {timeout:.0f} s"
    err = _worker_error(results)
    if err is not None or not path.exists():
        return err or "rank 0 wrote no result"
    return json.loads(path.read_text())


def _probe(link: EmulatedLink | None, text: str, log: Log) -> float | None:
    """All-reduce bus bandwidth the link delivers (None, with a message, if the probe fails)."""
    try:
        bps = measure_throughput(link, nbytes=PROBE_BYTES)
    except (RuntimeError, subprocess.SubprocessError) as e:
        log(f"[{text}] link probe failed ({str(e).strip().splitlines()[0]}); "
            "the projection will use the nominal rate")
        return None
    nominal = f" of nominal {format_bps(link.rate_bps)}" if link is not None else ""
    log(f"[{text}] link probe: all-reduce bus bandwidth {format_bps(bps)}{nominal}")
    return bps


def _add_speedups(records: list[dict[str, Any]]) -> None:
    ddp = {r["bandwidth"]: r["step_time"] for r in records if r["method"] == "ddp"}
    for r in records:
        base = ddp.get(r["bandwidth"])
        r["speedup_vs_ddp"] = base / r["step_time"] if base and r["step_time"] > 0 else None


# -- projection ------------------------------------------------------------------------------------


def _profile(method: str, recs: list[dict[str, Any]],
             all_recs: list[dict[str, Any]]) -> proj.CommProfile:
    """A method's profile for the projection.

    ``compute_time`` is the median over every record of the same model (full-rank or
    factorized), at every bandwidth: compute-only steps run no hook, so ddp, fp16,
    powersgd, signum and topk do identical work there, and pooling them damps the noise of
    a shared machine. ``compress_time`` is the median of the method's own records.
    """
    same_model = [r["compute_time"] for r in all_recs if r["factorized"] == recs[0]["factorized"]]
    return proj.CommProfile.for_method(
        method,
        compute_time=statistics.median(same_model),
        compress_time=statistics.median(r["compress_time"] for r in recs),
        payload_bytes=recs[0]["bytes_per_step"],
        collectives=recs[0]["collectives_per_step"],
    )


def _project(records: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Projection to large clusters, and the model's prediction of every measured record."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    profiles = [_profile(m, rs, records) for m, rs in by_method.items()]
    for r in records:
        bps = r["link_bps"] or r["bandwidth_bps"]
        r["model_bps"] = bps
        if bps is None:
            r["predicted_step_time"] = r["prediction_error"] = None
            continue
        own = proj.CommProfile.for_method(r["method"], r["compute_time"], r["compress_time"],
                                          r["bytes_per_step"], r["collectives_per_step"])
        pred = proj.step_time(own, r["workers"], bps, cfg.alpha)
        r["predicted_step_time"] = pred
        r["prediction_error"] = (pred - r["step_time"]) / r["step_time"]
    ddp = next((p for p in profiles if p.method == "ddp"), None)
    crossovers = {
        p.method: {
            str(w): asdict(proj.crossover(p, ddp, w, cfg.alpha)) for w in proj.DEFAULT_WORKERS
        }
        for p in profiles
        if ddp is not None and p.method != "ddp"
    }
    return {
        "alpha": cfg.alpha,
        "workers": list(proj.DEFAULT_WORKERS),
        "bandwidths_bps": list(proj.DEFAULT_BANDWIDTHS),
        "profiles": [asdict(p) for p in profiles],
        "rows": proj.project(profiles, alpha=cfg.alpha),
        "crossovers": crossovers,
    }


# -- outputs ----------------------------------------------------------------------------------------


def _write_outputs(cfg: BenchConfig, result: dict[str, Any], log: Log) -> None:
    out = Path(cfg.out)
    (out / "results.json").write_text(json.dumps(result["records"], indent=1))
    (out / "projection.json").write_text(json.dumps(result["projection"], indent=1))
    plots = _plot(result, out) if result["records"] else []
    (out / "results.md").write_text(_markdown(cfg, result, plots))
    log(f"written: {out / 'results.json'}, {out / 'results.md'}, {out / 'projection.json'}"
        + "".join(f", {p}" for p in plots))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _markdown(cfg: BenchConfig, result: dict[str, Any], plots: list[Path]) -> str:
    import torch

    recs = result["records"]
    lines = [
        f"# pufferfish bench: {cfg.model} x{cfg.width}, {cfg.workers} workers",
        "",
        f"Per worker: batch {cfg.batch_size} of Fashion-MNIST, {cfg.worker_threads()} torch "
        f"thread(s); {cfg.warmup} warm-up steps, {cfg.compute_steps} compute-only steps, "
        f"{cfg.steps} timed steps. torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{platform.platform()}. PowerSGD rank {cfg.powersgd_rank} (compressing from step "
        f"{cfg.powersgd_start_iter}), top-k ratio {cfg.topk_ratio}, signum beta "
        f"{cfg.signum_beta}; pufferfish = the paper preset at rank ratio 0.25.",
        "",
        "step = median full DDP step with the method's hook; compute = median step under "
        "`ddp.no_sync()` (no gradient communication); comm = step - compute, the communication "
        "(and hook encode/decode) NOT hidden by overlap; compress = the hook's encode/decode "
        "time (a lower bound for PowerSGD, whose decode runs in callbacks); MB = payload per "
        "step (`bytes_sent`), ring MB = what a rank sends under the ring model. Times are the "
        "slowest rank's medians. predicted = the α-β model at this worker count and the probed "
        "link rate, from this row's compute and compress; error = (predicted - step) / step.",
        "",
        "## Links",
        "",
        "| bandwidth | nominal | probed all-reduce bus bandwidth |",
        "|---|---|---|",
    ]
    for link in result["links"]:
        nominal = format_bps(link["bandwidth_bps"]) if link["bandwidth_bps"] else "-"
        probed = format_bps(link["link_bps"]) if link["link_bps"] else "-"
        lines.append(f"| {link['bandwidth']} | {nominal} | {probed} |")
    for s in result["skipped"]:
        lines.append(f"| {s['bandwidth']} | skipped: {s['reason']} | - |")
    head = ["method", "bandwidth", "step ms", "compute ms", "comm ms", "compress ms", "MB/step",
            "ring MB/step", "params", "speedup vs ddp", "predicted ms", "error"]
    lines += ["", "## Measured", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in recs:
        speed = "-" if r["speedup_vs_ddp"] is None else f"{r['speedup_vs_ddp']:.2f}x"
        err = "-" if r["prediction_error"] is None else f"{100 * r['prediction_error']:+.0f}%"
        lines.append("| " + " | ".join([
            r["method"], r["bandwidth"], _ms(r["step_time"]), _ms(r["compute_time"]),
            _ms(r["comm_time"]), _ms(r["compress_time"]), f"{r['bytes_per_step'] / 1e6:.3f}",
            f"{r['ring_bytes_per_step'] / 1e6:.3f}", f"{r['params'] / 1e6:.3f}M", speed,
            _ms(r["predicted_step_time"]), err]) + " |")  # fmt: skip
    lines += _projection_markdown(result["projection"])
    if result["failures"]:
        lines += ["", "## Failed groups", ""]
        lines += [f"- {f['method']} @ {f['bandwidth']}: {f['error']}" for f in result["failures"]]
    if plots:
        lines += ["", *[f"![{p.stem}]({p.name})" for p in plots]]
    return "\n".join(lines) + "\n"


def _projection_markdown(projection: dict[str, Any]) -> list[str]:
    rows = projection["rows"]
    if not rows:
        return []
    bws = projection["bandwidths_bps"]
    lines = [
        "",
        "## Projection (ring α-β model)",
        "",
        f"α = {projection['alpha'] * 1e6:g} µs per message. Step = measured compute (median "
        "over all rows of the same model: full-rank or factorized) + the method's median "
        "compress + modelled communication with no overlap; all-reduce methods send 2(p-1)/p "
        "of their payload, all-gather ones (signum, topk) (p-1) times it. Cells: step ms "
        "(speedup vs ddp).",
    ]
    for p in projection["workers"]:
        head = ["method", *[format_bps(b) for b in bws], "crossover vs ddp"]
        lines += ["", f"### p = {p}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        methods = dict.fromkeys(r["method"] for r in rows)
        for m in methods:
            cells = []
            for b in bws:
                r = next(x for x in rows if x["method"] == m and x["workers"] == p
                         and x["bandwidth_bps"] == b)
                speed = f" ({r['speedup_vs_ddp']:.2f}x)" if r["speedup_vs_ddp"] else ""
                cells.append(f"{_ms(r['step_time'])}{speed}")
            cross = projection["crossovers"].get(m, {}).get(str(p))
            text = proj.Crossover(**cross).describe() if cross else "-"
            lines.append("| " + " | ".join([m, *cells, text]) + " |")
    return lines


def _plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    # Fastest link on the left: loopback, then emulated rates in decreasing order.
    order = sorted(dict.fromkeys(r["bandwidth"] for r in recs),
                   key=lambda b: -(parse_bandwidth(b) or float("inf")))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in recs):
        pts = [(order.index(r["bandwidth"]), r["step_time"]) for r in recs if r["method"] == m]
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m)
    ax.set_xticks(range(len(order)), order)
    ax.set(xlabel="link", ylabel="median step time (s)", yscale="log",
           title=f"measured step time, {recs[0]['workers']} workers")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "step_time.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    projection = result["projection"]
    profiles = [proj.CommProfile(**p) for p in projection["profiles"]]
    workers = projection["workers"]
    fig, axes = plt.subplots(1, len(workers), figsize=(5 * len(workers), 4), sharey=True)
    grid = [10 ** (7 + k / 10) for k in range(41)]  # 10 Mbit/s .. 100 Gbit/s
    for ax, p in zip(axes, workers):
        for prof in profiles:
            ax.plot([b / 1e9 for b in grid],
                    [proj.step_time(prof, p, b, projection["alpha"]) for b in grid],
                    label=prof.method)
        ax.set(xscale="log", yscale="log", xlabel="bandwidth (Gbit/s)", title=f"p = {p}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("projected step time (s)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "projection.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


# -- --train: time to accuracy ----------------------------------------------------------------------


def _train_argv(cfg: BenchConfig, method: str, run_dir: Path) -> list[str]:
    factorized, hook = hook_for(method)
    argv = [
        sys.executable, "-m", "pufferfish", "train", "--model", cfg.model,
        "--width", str(cfg.width), "--data", "fashion-mnist",
        "--mode", "pufferfish" if factorized else "full", "--comm", hook,
        "--epochs", str(cfg.epochs), "--batch-size", str(cfg.batch_size), "--lr", str(cfg.lr),
        "--train-subset", str(cfg.train_subset), "--test-subset", str(cfg.test_subset),
        "--powersgd-rank", str(cfg.powersgd_rank),
        "--powersgd-start-iter", str(cfg.powersgd_start_iter),
        "--topk-ratio", str(cfg.topk_ratio), "--signum-beta", str(cfg.signum_beta),
        "--threads", str(cfg.worker_threads()), "--checkpoint-every-epochs", str(cfg.epochs),
        "--no-progress", "--out", str(run_dir), "--overwrite",  # a previous bench's run
    ]  # fmt: skip
    if factorized:
        argv += ["--warmup-epochs", str(cfg.warmup_epochs)]
    if cfg.data_dir:
        argv += ["--data-dir", cfg.data_dir]
    return argv


def time_to_accuracy(rows: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds (sum of ``epoch_time``) until test accuracy first reaches ``target``."""
    clock = 0.0
    for row in rows:
        clock += row["epoch_time"]
        if row["test_acc"] >= target:
            return clock
    return None


def run_train(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Train every method on every link; per link, a time-to-accuracy report and plot.

    Runs land in ``out/train/<bandwidth>/<method>``; ``out/train/<bandwidth>/report.md`` and
    ``accuracy.png`` come from :func:`pufferfish.training.report.compare_runs` (accuracy
    against the summed epoch times, i.e. training wall-clock without evaluation).
    ``out/train_results.json`` has, per run, the time to reach the best accuracy that
    every run of that link reached.
    """
    from ..training.report import compare_runs

    cfg.validate()
    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    skipped: list[dict[str, str]] = []
    failures: list[dict[str, str]] = []
    summary: list[dict[str, Any]] = []
    for text in cfg.bandwidths:
        cond = _condition(text, skipped, log)
        if cond is None:
            continue
        done: list[tuple[str, Path]] = []
        with cond as link:
            for method in cfg.methods:
                run_dir = root / "train" / text / method
                err = _train_run(cfg, link, method, run_dir, log)
                if err is None:
                    done.append((method, run_dir))
                else:
                    failures.append(_fail(method, text, err, log))
        if done:
            summary += _train_summary(text, done)
            log(compare_runs([str(d) for _, d in done], str(root / "train" / text)))
    (root / "train_results.json").write_text(
        json.dumps({"runs": summary, "skipped": skipped, "failures": failures}, indent=1))
    (root / "train.md").write_text(_train_markdown(cfg, summary, skipped, failures))
    log(f"written: {root / 'train_results.json'}, {root / 'train.md'}, "
        f"{root / 'train'}/<bandwidth>/report.md and accuracy.png")
    return {"runs": summary, "skipped": skipped, "failures": failures}


def _train_run(
    cfg: BenchConfig, link: EmulatedLink | None, method: str, run_dir: Path, log: Log
) -> str | None:
    """Train ``method`` into ``run_dir`` (replacing an old run there: ``--overwrite``); why it
    failed, or None."""
    from ..training.metrics import read_metrics

    timeout = cfg.timeout or NO_TIMEOUT
    argv = _train_argv(cfg, method, run_dir)
    log(f"training {method}: {' '.join(argv[1:])}")
    try:
        results = run_workers(link, lambda rank: argv, env=_worker_env(), timeout=timeout,
                              world_size=cfg.workers)
    except WorkerTimeout:
        return f"timed out after {timeout:.0f} s"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "worker0.log").write_text(results[0].stdout + results[0].stderr)
    err = _worker_error(results)
    if err is None and not read_metrics(run_dir):
        err = "no metrics written"
    return err


def _train_markdown(cfg: BenchConfig, runs: list[dict[str, Any]],
                    skipped: list[dict[str, str]], failures: list[dict[str, str]]) -> str:
    lines = [
        f"# pufferfish bench --train: {cfg.model} x{cfg.width}, {cfg.workers} workers, "
        f"{cfg.epochs} epochs",
        "",
        "Time = summed training epoch times (evaluation excluded); target = the best test "
        "accuracy that every run on that link reached. Plots: train/<bandwidth>/accuracy.png.",
        "",
        "| bandwidth | method | final acc | best acc | train s | target acc | s to target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        reach = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
        lines.append(f"| {r['bandwidth']} | {r['method']} | {100 * r['final_test_acc']:.2f}% | "
                     f"{100 * r['best_test_acc']:.2f}% | {r['train_time']:.1f} | "
                     f"{100 * r['target_acc']:.2f}% | {reach} |")
    lines += [f"- {s['bandwidth']}: skipped ({s['reason']})" for s in skipped]
    lines += [f"- {f['method']} @ {f['bandwidth']}: FAILED: {f['error']}" for f in failures]
    return "\n".join(lines) + "\n"


def _train_summary(text: str, done: list[tuple[str, Path]]) -> list[dict[str, Any]]:
    from ..training.metrics import read_metrics

    rows = {m: read_metrics(d) for m, d in done}
    target = min(max(r["test_acc"] for r in rs) for rs in rows.values())
    return [
        {
            "method": m,
            "bandwidth": text,
            "final_test_acc": rs[-1]["test_acc"],
            "best_test_acc": max(r["test_acc"] for r in rs),
            "train_time": sum(r["epoch_time"] for r in rs),
            "target_acc": target,
            "time_to_target": time_to_accuracy(rs, target),
        }
        for m, rs in rows.items()
    ]
