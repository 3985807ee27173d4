"""``pufferfish bench``: every method over every network condition, measured, then projected.

Pufferfish's claim is a wall-clock one: a factorized model trained with plain all-reduce
ships fewer bytes than the full model, and computes less, so it should beat gradient
compressors (fp16, PowerSGD, signSGD, top-k) that ship even fewer bytes but pay for
encoding. Whether it does depends on the link, so the benchmark runs each method on each
link for real and then extrapolates with an explicit model:

1. Every ``--bandwidth`` is set up once (``loopback``, or a rate emulated by
   :class:`~pufferfish.bench.netns.EmulatedLink`: two network namespaces joined by a
   shaped veth pair) and an all-reduce probe measures what it really delivers
   (``link_bps``), so that a mis-shaped link is visible and the model below is fed the
   bandwidth the workers actually had. Emulated links need root and iproute2; without them
   those conditions are skipped with the reason, never replaced by loopback.
2. ``--rounds`` rounds (:mod:`pufferfish.bench.rounds`): in each, one group of
   ``--workers`` processes per link runs :mod:`pufferfish.bench.step`, which times
   compute-only and full DDP steps of every method in turn; the order of links and of
   methods rotates from round to round. Rows report the median over rounds with the
   min–max spread, and the ratio to DDP taken within each round, so that one noisy moment
   of a shared machine cannot decide a row.
3. :mod:`pufferfish.bench.projection` turns the measured compute/compress time and bytes
   into step times for 8/16/64 workers at 1/10/100 Gbit/s, with each method's crossover
   bandwidth against DDP, and predicts the measured 2-worker runs (its error column shows
   how far to trust it).
4. With ``--accuracy-runs`` (``pufferfish train`` runs, one per method),
   :mod:`pufferfish.bench.accuracy` turns their per-epoch accuracy and the measured step
   times into accuracy against wall-clock time on each link and the time to reach DDP's
   final accuracy minus 0.5/1 point; with ``--compute-ms`` also for 8 and 64 workers at
   1/10/100 Gbit/s at that GPU compute time per step (projected).

Outputs in ``--out``: ``results.json`` (per-round records, rows, time to accuracy),
``projection.json``, ``results.md`` and the plots ``step_time.png`` / ``projection.png``
(and ``time_to_accuracy.png`` / ``time_to_accuracy_projected.png``). ``--from-results``
reuses an earlier run's measured step times instead of measuring again.

``--train`` instead trains each method for the same epochs with ``pufferfish train``
(the one training loop, launched in the namespaces) and plots test accuracy against
wall-clock time, each method trained over each link for real
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

import torch

from ..data import DEFAULT_FASHION_DIR
from ..distributed.hooks import with_option_fields
from ..formatting import markdown_table
from ..training.metrics import read_metrics
from ..training.report import compare_runs
from . import accuracy as acc
from . import projection as proj
from .accuracy import time_to_accuracy
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
from .rounds import compute_check, round_plan, summarize
from .step import BENCH_METHODS, HOOK_DEFAULTS, HOOK_OPTIONS, hook_for

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
@with_option_fields(after="batch_size", defaults=HOOK_DEFAULTS, options=HOOK_OPTIONS)
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
    # ... then one field per comm-hook option: powersgd_rank, powersgd_start_iter, ...
    threads: int = 0  # 0: cores // workers
    data_dir: str = ""
    rounds: int = 3
    alpha: float = proj.DEFAULT_ALPHA
    probe: bool = True
    timeout: float = 0.0  # 0: STEP_TIMEOUT per step group, no limit per training run
    out: str = "runs/bench"
    # time to accuracy from existing runs' accuracy and the measured (or reused) step times
    accuracy_runs: str = ""
    compute_ms: float | None = None
    from_results: str = ""
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
                             + ", ".join(BENCH_METHODS))
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
        for option in HOOK_OPTIONS:
            option.check(getattr(self, option.key))
        for name in ("steps", "compute_steps", "batch_size", "epochs", "rounds"):
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
        self._validate_accuracy()
        data = Path(self.data_dir) if self.data_dir else _default_data_dir()
        if not self.from_results and not data.is_dir():
            raise ValueError(
                f"Fashion-MNIST directory {str(data)!r} does not exist: install the Debian "
                "package dataset-fashion-mnist or pass --data-dir"
            )

    def _validate_accuracy(self) -> None:
        """``--accuracy-runs`` / ``--compute-ms``: the runs exist, match the measured model and
        batch, and the bench measures every step time their curves need."""
        if self.compute_ms is not None and not self.compute_ms > 0:
            raise ValueError(f"compute_ms {self.compute_ms!r} is invalid: allowed > 0 "
                             "(milliseconds of one full-rank training step on your GPU)")
        if not self.accuracy_runs:
            if self.compute_ms is not None:
                raise ValueError("--compute-ms projects time to accuracy: give --accuracy-runs "
                                 "too")
            return
        if self.train:
            raise ValueError("--accuracy-runs uses measured step times: not with --train, which "
                             "trains over each link itself")
        runs = self.load_accuracy_runs()
        needed = dict.fromkeys(m for method in runs for m in acc.phase_methods(method))
        missing = [m for m in needed if m not in self.methods]
        if missing:
            raise ValueError(f"--accuracy-runs {','.join(runs)} needs the step times of "
                             f"{', '.join(missing)}: add them to --methods")

    def load_accuracy_runs(self) -> dict[str, acc.AccuracyRun]:
        return acc.load_accuracy_runs(self.accuracy_runs, model=self.model, width=self.width,
                                      batch_size=self.batch_size,
                                      powersgd_rank=self.powersgd_rank)

    def worker_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.workers)


def _default_data_dir() -> Path:
    return Path(DEFAULT_FASHION_DIR)


# -- command line --------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pufferfish bench`` options (kept here so that ``cli.py`` stays parsing-only)."""
    d = BenchConfig()
    ap.add_argument("--model", default=d.model, help=f"{', '.join(IMAGE_MODELS)}")
    ap.add_argument("--width", type=float, default=d.width, help="channel multiplier")
    ap.add_argument("--methods", default=",".join(d.methods),
                    help=f"comma-separated, from: {', '.join(BENCH_METHODS)}")
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
    for option in HOOK_OPTIONS:
        ap.add_argument("--" + option.key.replace("_", "-"), type=option.kind,
                        default=getattr(d, option.key), help=option.help)
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
    ap.add_argument("--rounds", type=int, default=d.rounds,
                    help="interleaved rounds: every (link, method) once per round, the order "
                         "rotating; rows give the median and min-max over rounds")
    ap.add_argument("--out", default=d.out, help="output directory")
    ap.add_argument("--accuracy-runs", default=d.accuracy_runs, metavar="METHOD=DIR,...",
                    help="`pufferfish train` runs whose per-epoch accuracy, timed with the "
                         "measured step times, gives accuracy against wall-clock per link, "
                         "e.g. ddp=runs/full,powersgd=runs/psgd,pufferfish=runs/puff "
                         "(same model, width and batch; a ddp run sets the target)")
    ap.add_argument("--compute-ms", type=float, default=d.compute_ms,
                    help="with --accuracy-runs: your GPU's time per full-rank training step "
                         "(one worker's batch), to project time to accuracy for 8 and 64 "
                         "workers at 1/10/100 Gbit/s")
    ap.add_argument("--from-results", default=d.from_results, metavar="RESULTS_JSON",
                    help="reuse the step times of an earlier bench (its results.json, or its "
                         "--out directory) instead of measuring; measurement flags are ignored")
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
    measured = _measured_config(args.from_results) if args.from_results else {}
    cfg = BenchConfig(
        model=args.model, width=args.width,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        bandwidths=[b.strip() for b in args.bandwidth.split(",") if b.strip()],
        workers=args.workers, steps=args.steps, warmup=args.warmup,
        compute_steps=args.compute_steps, batch_size=args.batch_size,
        **{option.key: getattr(args, option.key) for option in HOOK_OPTIONS},
        threads=args.threads,
        data_dir=args.data_dir, alpha=args.alpha_us * 1e-6, probe=args.probe,
        timeout=args.timeout, out=args.out, train=args.train, epochs=args.epochs,
        warmup_epochs=args.warmup_epochs, train_subset=args.train_subset,
        test_subset=args.test_subset, lr=args.lr, rounds=args.rounds,
        accuracy_runs=args.accuracy_runs, compute_ms=args.compute_ms,
        from_results=args.from_results,
    )  # fmt: skip
    for key, value in measured.items():  # what was measured, not today's flags
        setattr(cfg, key, value)
    cfg.validate()
    return cfg


# Settings that describe a measurement, taken from the results when reused.
_MEASURED = ("model", "width", "methods", "bandwidths", "workers", "steps", "warmup",
             "compute_steps", "batch_size", *(option.key for option in HOOK_OPTIONS), "threads",
             "rounds")


def _results_path(path: str) -> Path:
    p = Path(path)
    return p / "results.json" if p.is_dir() else p


def _load_results(path: str) -> dict[str, Any]:
    """An earlier bench's ``results.json`` (``ValueError`` if it is not one)."""
    p = _results_path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--from-results {path!r}: no {p} (allowed: a bench's results.json or "
                         "its --out directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--from-results {path!r}: {p} is not JSON ({e})") from None
    if not isinstance(data, dict) or not {"config", "rows", "rounds"} <= data.keys():
        raise ValueError(f"--from-results {path!r}: {p} is not the results.json of a "
                         "`pufferfish bench` with --rounds")
    return data


def _measured_config(path: str) -> dict[str, Any]:
    saved = _load_results(path)["config"]
    return {k: saved[k] for k in _MEASURED if k in saved}


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


def _hook_flags(cfg: BenchConfig) -> list[str]:
    """``--powersgd-rank 4 --topk-ratio 0.01 ...``: every hook option, as the bench has it
    (the same flags for ``pufferfish.bench.step`` and ``pufferfish train``)."""
    return [arg for option in HOOK_OPTIONS
            for arg in ("--" + option.key.replace("_", "-"), str(getattr(cfg, option.key)))]


def _step_argv(cfg: BenchConfig, methods: list[str], out: Path, cache: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "pufferfish.bench.step", "--methods", ",".join(methods),
        "--model", cfg.model, "--width", str(cfg.width), "--batch-size", str(cfg.batch_size),
        "--steps", str(cfg.steps), "--warmup", str(cfg.warmup),
        "--compute-steps", str(cfg.compute_steps), *_hook_flags(cfg),
        "--threads", str(cfg.worker_threads()), "--cache-dir", str(cache), "--out", str(out),
    ]  # fmt: skip
    if cfg.data_dir:
        argv += ["--data-dir", cfg.data_dir]
    return argv


def _worker_env() -> dict[str, str]:
    # The workers' own thread count is set with --threads; keep OpenMP from oversubscribing.
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_bench(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Measure every (bandwidth, method) in interleaved rounds (or reuse ``--from-results``),
    project, time to accuracy if asked, and write the outputs to ``cfg.out``.

    Returns ``{"config", "links", "order", "rounds", "rows", "compute_check", "projection",
    "time_to_accuracy", "skipped", "failures"}``: ``rounds`` holds one record per round,
    link and method, ``rows`` their summary per link and method.
    """
    cfg.validate()
    if cfg.from_results:
        saved = _load_results(cfg.from_results)
        log(f"step times from {_results_path(cfg.from_results)} (measured, not re-run)")
        measured = {k: saved[k] for k in ("links", "order", "rounds", "skipped", "failures")}
    else:
        measured = _measure(cfg, log)
    records = measured["rounds"]
    links = [link["bandwidth"] for link in measured["links"]]
    rows = summarize(records, links, cfg.methods)
    projection = _project(rows, cfg)
    result = {"config": {**asdict(cfg), "threads": cfg.worker_threads()}, **measured,
              "rows": rows, "compute_check": compute_check(rows), "projection": projection,
              "time_to_accuracy": _time_to_accuracy(cfg, rows, links, projection)}
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    _write_outputs(cfg, result, log)
    return result


def _measure(cfg: BenchConfig, log: Log) -> dict[str, Any]:
    """Set up every link (probing it), then measure ``cfg.rounds`` rounds over them."""
    records: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    failures: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    opened: dict[str, EmulatedLink | None] = {}
    with tempfile.TemporaryDirectory(prefix="pf-bench-") as tmp, contextlib.ExitStack() as stack:
        # Every link stays up for the whole run, so that rounds can revisit it.
        for text in cfg.bandwidths:
            cond = _condition(text, skipped, log)
            if cond is None:
                continue
            link = stack.enter_context(cond)
            rate = link.rate_bps if link is not None else None
            probed = _probe(link, text, log) if cfg.probe else None
            links.append({"bandwidth": text, "bandwidth_bps": rate, "link_bps": probed})
            opened[text] = link
        order = round_plan(list(opened), cfg.methods, cfg.rounds)
        for r, plan in enumerate(order):
            log(f"round {r + 1}/{cfg.rounds}: "
                + "; ".join(f"{text}: {', '.join(ms)}" for text, ms in plan))
            for text, methods in plan:
                info = next(x for x in links if x["bandwidth"] == text)
                got, err = _step_group(cfg, opened[text], methods, Path(tmp))
                for rec in got:
                    rec = {"round": r, **info, **rec}
                    records.append(rec)
                    log(f"[{text}] round {r + 1} {rec['method']}: step {rec['step_time']:.4f} s "
                        f"= compute {rec['compute_time']:.4f} + comm {rec['comm_time']:.4f} "
                        f"(compress {rec['compress_time']:.4f}); "
                        f"{rec['bytes_per_step'] / 1e6:.3f} MB/step")
                if err is not None:
                    done = {rec["method"] for rec in got}
                    lost = [m for m in methods if m not in done]
                    kept = f" (kept: {', '.join(sorted(done))})" if done else ""
                    failures.append({**_fail(",".join(lost) or "-", text, err + kept, log),
                                     "round": r})
    return {"links": links, "order": order, "rounds": records, "skipped": skipped,
            "failures": failures}


def _step_group(
    cfg: BenchConfig, link: EmulatedLink | None, methods: list[str], tmp: Path
) -> tuple[list[dict[str, Any]], str | None]:
    """One group of workers timing ``methods`` in turn: the records rank 0 wrote (a group that
    failed part-way keeps the methods it finished: they were gathered from every rank), and
    why the group failed, or ``None``."""
    timeout = cfg.timeout or STEP_TIMEOUT
    path = tmp / f"step-{os.urandom(4).hex()}.json"
    argv = _step_argv(cfg, methods, path, tmp / "cache")
    try:
        results = run_workers(link, lambda rank: argv, env=_worker_env(), timeout=timeout,
                              world_size=cfg.workers)
        err = _worker_error(results)
    except WorkerTimeout:
        err = f"timed out after {timeout:.0f} s"
    got = json.loads(path.read_text()) if path.exists() else []
    if err is None and len(got) < len(methods):
        err = "rank 0 wrote no result" if not got else "rank 0 wrote only some results"
    return got, err


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


# -- time to accuracy -------------------------------------------------------------------------------


def _time_to_accuracy(cfg: BenchConfig, rows: list[dict[str, Any]], links: list[str],
                      projection: dict[str, Any]) -> dict[str, Any] | None:
    """``--accuracy-runs`` timed with the measured step times of each link (and, with
    ``--compute-ms``, projected): curves and the time-to-target table, or ``None``."""
    if not cfg.accuracy_runs:
        return None
    runs = cfg.load_accuracy_runs()
    step_times = {(r["bandwidth"], r["method"]): acc.StepTime(r["step_time"],
                                                              *r["spread"]["step_time"])
                  for r in rows}
    ddp_final = runs["ddp"].accuracies[-1]
    curves = acc.measured_curves(runs, step_times, links, cfg.workers)
    result: dict[str, Any] = {
        "runs": {m: {"path": r.path, "epochs": len(r.rows), "epochs_planned": r.epochs_planned,
                     "final_test_acc": r.accuracies[-1], "batch_size": r.batch_size,
                     "train_examples": r.train_examples} for m, r in runs.items()},
        "ddp_final_acc": ddp_final,
        "points_below": list(acc.TARGET_POINTS),
        "workers": cfg.workers,
        "measured": {"curves": [asdict(c) for c in curves],
                     "table": acc.target_table(curves, ddp_final)},
        "projected": None,
    }
    if cfg.compute_ms is not None:
        profiles = [proj.CommProfile(**p) for p in projection["profiles"]]
        projected, info = acc.projected_curves(runs, profiles, cfg.compute_ms, alpha=cfg.alpha)
        result["projected"] = {
            "compute_ms": cfg.compute_ms, **info, "alpha": cfg.alpha,
            "workers": list(acc.PROJECTED_WORKERS),
            "bandwidths_bps": list(proj.DEFAULT_BANDWIDTHS),
            "curves": [asdict(c) for c in projected],
            "table": acc.target_table(projected, ddp_final)}
    return result


# -- outputs ----------------------------------------------------------------------------------------


def _write_outputs(cfg: BenchConfig, result: dict[str, Any], log: Log) -> None:
    out = Path(cfg.out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "projection.json").write_text(json.dumps(result["projection"], indent=1))
    plots = _plot(result, out) if result["rows"] else []
    if result["time_to_accuracy"]:
        plots += acc.plot(result["time_to_accuracy"], out)
    (out / "results.md").write_text(_markdown(cfg, result, plots))
    log(f"written: {out / 'results.json'}, {out / 'results.md'}, {out / 'projection.json'}"
        + "".join(f", {p}" for p in plots))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _ms_spread(row: dict[str, Any], key: str) -> str:
    """``median [min–max]`` in milliseconds."""
    low, high = row["spread"][key]
    return f"{_ms(row[key])} [{_ms(low)}–{_ms(high)}]"


def _markdown(cfg: BenchConfig, result: dict[str, Any], plots: list[Path]) -> str:
    rows = result["rows"]
    source = (f"Step times reused from `{_results_path(cfg.from_results)}`. "
              if cfg.from_results else "")
    lines = [
        f"# pufferfish bench: {cfg.model} x{cfg.width}, {cfg.workers} workers",
        "",
        f"{source}Per worker: batch {cfg.batch_size} of Fashion-MNIST, "
        f"{cfg.worker_threads()} torch thread(s); per method and round {cfg.warmup} warm-up "
        f"steps, {cfg.compute_steps} compute-only steps, {cfg.steps} timed steps; {cfg.rounds} "
        f"interleaved round(s). torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{platform.platform()}. PowerSGD rank {cfg.powersgd_rank} (compressing from step "
        f"{cfg.powersgd_start_iter}), top-k ratio {cfg.topk_ratio}, signum beta "
        f"{cfg.signum_beta}; pufferfish = the paper preset at rank ratio 0.25.",
        "",
        "Each round runs one worker group per link that measures every method in turn; the "
        "order of links and of methods rotates from round to round (below). Per round: step = "
        "median full DDP step with the method's hook; compute = median step under "
        "`ddp.no_sync()` (no gradient communication); comm = step - compute, the communication "
        "(and hook encode/decode) NOT hidden by overlap; share = comm / step; compress = the "
        "hook's encode/decode time (a lower bound for PowerSGD, whose decode runs in callbacks); "
        "times are the slowest rank's. Cells: median over rounds [min–max over rounds]. "
        "speedup vs ddp = DDP's step / the method's step in the same round and link, then "
        "median [min–max]. MB = payload per step (`bytes_sent`), ring MB = what a rank sends "
        "under the ring model. predicted = the α-β model at this worker count and the probed "
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
    lines += ["", "Measuring order:", ""]
    lines += [f"{r + 1}. " + "; ".join(f"{text} ({', '.join(ms)})" for text, ms in plan)
              for r, plan in enumerate(result["order"])]
    head = ["method", "bandwidth", "rounds", "step ms", "compute ms", "comm ms", "share",
            "compress ms", "MB/step", "ring MB/step", "params", "speedup vs ddp",
            "predicted ms", "error"]
    lines += ["", "## Measured", "", *markdown_table(head, map(_measured_cells, rows))]
    lines += _compute_check_markdown(result["compute_check"], [x["bandwidth"]
                                                               for x in result["links"]])
    lines += _projection_markdown(result["projection"])
    if result["time_to_accuracy"]:
        lines += acc.markdown(result["time_to_accuracy"])
    if result["failures"]:
        lines += ["", "## Failed groups", ""]
        lines += [f"- {f['method']} @ {f['bandwidth']}"
                  + (f", round {f['round'] + 1}" if "round" in f else "") + f": {f['error']}"
                  for f in result["failures"]]
    if plots:
        lines += ["", *[f"![{p.stem}]({p.name})" for p in plots]]
    return "\n".join(lines) + "\n"


def _measured_cells(r: dict[str, Any]) -> list[str]:
    speed = "-" if r["speedup_vs_ddp"] is None else (
        f"{r['speedup_vs_ddp']:.2f}x [{r['spread']['speedup_vs_ddp'][0]:.2f}–"
        f"{r['spread']['speedup_vs_ddp'][1]:.2f}]")
    share = r["spread"]["comm_share"]
    err = "-" if r["prediction_error"] is None else f"{100 * r['prediction_error']:+.0f}%"
    return [r["method"], r["bandwidth"], str(r["rounds"]), _ms_spread(r, "step_time"),
            _ms_spread(r, "compute_time"), _ms_spread(r, "comm_time"),
            f"{100 * r['comm_share']:.0f}% [{100 * share[0]:.0f}–{100 * share[1]:.0f}]",
            _ms(r["compress_time"]), f"{r['bytes_per_step'] / 1e6:.3f}",
            f"{r['ring_bytes_per_step'] / 1e6:.3f}", f"{r['params'] / 1e6:.3f}M", speed,
            _ms(r["predicted_step_time"]), err]


def _compute_check_markdown(check: list[dict[str, Any]], links: list[str]) -> list[str]:
    """Compute-only medians per method on every link: they should agree (no link involved)."""
    if not check or len(links) < 2:
        return []
    head = ["method", *[f"{text} compute ms" for text in links], "max/min - 1", ""]
    lines = [
        "", "## Sanity check: compute does not depend on the link", "",
        "A compute-only step sends nothing, so its median should be the same on every link; a "
        "gap above 15% is flagged: the machine's load moved it, and rows that differ by less "
        "than such a gap do not differ.", "",
    ]
    rows = [[c["method"], *[_ms(c["compute_time"].get(text)) for text in links],
             f"{100 * c['disagreement']:.0f}%", "**> 15%: noisy**" if c["flagged"] else "ok"]
            for c in check]
    return lines + markdown_table(head, rows)


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
        table = []
        for m in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for b in bws:
                r = next(x for x in rows if x["method"] == m and x["workers"] == p
                         and x["bandwidth_bps"] == b)
                speed = f" ({r['speedup_vs_ddp']:.2f}x)" if r["speedup_vs_ddp"] else ""
                cells.append(f"{_ms(r['step_time'])}{speed}")
            cross = projection["crossovers"].get(m, {}).get(str(p))
            table.append([m, *cells, proj.Crossover(**cross).describe() if cross else "-"])
        lines += ["", f"### p = {p}", "", *markdown_table(head, table)]
    return lines


def _plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["rows"]
    # Fastest link on the left: loopback, then emulated rates in decreasing order.
    order = sorted(dict.fromkeys(r["bandwidth"] for r in recs),
                   key=lambda b: -(parse_bandwidth(b) or float("inf")))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in recs):
        pts = sorted((order.index(r["bandwidth"]), r["step_time"], *r["spread"]["step_time"])
                     for r in recs if r["method"] == m)
        ax.errorbar([x for x, *_ in pts], [y for _, y, _, _ in pts],
                    yerr=[[y - lo for _, y, lo, _ in pts], [hi - y for _, y, _, hi in pts]],
                    marker="o", capsize=3, label=m)
    ax.set_xticks(range(len(order)), order)
    ax.set(xlabel="link", ylabel="step time (s): median, bars min–max over rounds",
           yscale="log", title=f"measured step time, {recs[0]['workers']} workers, "
                               f"{max(r['rounds'] for r in recs)} rounds")
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
        *_hook_flags(cfg),
        "--threads", str(cfg.worker_threads()), "--checkpoint-every-epochs", str(cfg.epochs),
        "--no-progress", "--out", str(run_dir), "--overwrite",  # a previous bench's run
    ]  # fmt: skip
    if factorized:
        argv += ["--warmup-epochs", str(cfg.warmup_epochs)]
    if cfg.data_dir:
        argv += ["--data-dir", cfg.data_dir]
    return argv


def run_train(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Train every method on every link; per link, a time-to-accuracy report and plot.

    Runs land in ``out/train/<bandwidth>/<method>``; ``out/train/<bandwidth>/report.md`` and
    ``accuracy.png`` come from :func:`pufferfish.training.report.compare_runs` (accuracy
    against the summed epoch times, i.e. training wall-clock without evaluation).
    ``out/train_results.json`` has, per run, the time to reach the best accuracy that
    every run of that link reached.
    """

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
