"""``pufferfish bench``: every method over every network condition, measured, then projected.

Pufferfish's claim is a wall-clock one: a factorized model trained with plain all-reduce
ships fewer bytes than the full model, and computes less, so it should beat gradient
compressors (fp16, PowerSGD, signSGD, top-k) that ship even fewer bytes but pay for
encoding. Whether it does depends on the link, so the benchmark runs each method on each
link for real and then extrapolates with an explicit model:

1. Every ``--bandwidth`` is set up once (``loopback``, or a rate emulated by
   :class:`~pufferfish.bench.netns.EmulatedLink`: two network namespaces joined by a
   shaped veth pair, ``100mbit@20ms`` with a 20 ms netem delay each way) and an all-reduce
   probe measures what it really delivers (``link_bps``) and its round trip (``link_rtt_s``, a
   one-float all-reduce), so that a mis-shaped link is visible and the model below is fed the
   bandwidth and latency the workers actually had. Emulated links need root and iproute2 (a
   delay also netem); without them those conditions are skipped with the reason, never
   replaced by loopback or run without their delay.
2. ``--rounds`` rounds (:mod:`pufferfish.bench.rounds`): in each, one group of
   ``--workers`` processes per link runs :mod:`pufferfish.bench.step`, which times
   compute-only and full DDP steps of every method in turn; the order of links and of
   methods rotates from round to round. Rows report the median over rounds with the
   min–max spread, and the ratio to DDP taken within each round, so that one noisy moment
   of a shared machine cannot decide a row.
3. :mod:`pufferfish.bench.projection` turns the measured compute/compress time and bytes
   into step times for 8/16/64 workers at 1/10/100 Gbit/s (at ``--alpha-us`` and at it plus
   each link's delay), with each method's crossover bandwidth against DDP, and predicts the
   measured 2-worker runs at each link's probed rate and latency (its error column shows how
   far to trust it).
4. With ``--accuracy-runs`` (``pufferfish train`` runs, one per method),
   :mod:`pufferfish.bench.accuracy` turns their per-epoch accuracy and the measured step
   times into accuracy against wall-clock time on each link and the time to reach DDP's
   final accuracy minus 0.5/1 point; with ``--compute-ms full=MS,factorized=MS`` also for 8
   and 64 workers at 1/10/100 Gbit/s at those GPU compute times per step (projected; without
   the factorized figure at this CPU's low-rank/full ratio, which the log and results say).

Outputs in ``--out``: ``results.json`` (per-round records, rows, time to accuracy),
``projection.json``, ``results.md`` and the plots ``step_time.png`` / ``projection.png``
(and ``time_to_accuracy.png`` / ``time_to_accuracy_projected.png``). ``--from-results``
reuses an earlier run's measured step times instead of measuring again. An earlier bench's
measurements in ``--out`` (``results.json``; ``--train``'s runs) are replaced only with
``--overwrite``, or reused by ``--from-results`` naming them; the bench holds ``--out``
(:func:`pufferfish.outputs.hold`) while it writes there, so two benches never mix their files.

``--train`` instead trains each method for ``--epochs`` (``--method-epochs``: some for
longer, an equal wall-clock budget) with ``pufferfish train``
(the one training loop, launched in the namespaces) and plots test accuracy against
wall-clock time, each method trained over each link for real
(``train.md``, ``train_results.json``, ``train/<bandwidth>/{report.md,accuracy.png}``).

A failed worker group is reported (``results.md``, exit status 1) and the others still run.

This module runs the worker groups and writes the outputs; the settings and flags are in
:mod:`~pufferfish.bench.config`, the projection and summaries in :mod:`~pufferfish.bench.results`,
the Markdown in :mod:`~pufferfish.bench.markdown` and the plots in :mod:`~pufferfish.bench.plots`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..outputs import Held, claim_outputs, hold, make_fresh, seal_outputs
from ..report import compare_runs
from ..training.metrics import read_metrics
from . import accuracy as acc
from .accuracy import time_to_accuracy
from .bandwidth import format_bps, parse_link
from .config import (
    DEFAULT_METHODS,
    STEP_TIMEOUT,
    BenchConfig,
    load_results,
    results_path,
)
from .flags import add_arguments, config_from_args
from .launched import is_rank0, measure_in_group
from .markdown import results_markdown, train_markdown
from .methods import HOOK_OPTIONS, hook_for, parallel_for, sync_for
from .netns import EmulatedLink, cleanup_stale, netem_available, netns_available
from .plots import plot_results
from .probe import ProbeResult, measure_link
from .progress import TrainingProgress, measuring
from .results import project, time_to_accuracy_result, train_summary
from .rounds import compute_check, round_plan, summarize
from .step import machine_facts
from .usermodel import factorization_report, is_user_model
from .workers import WorkerTimeout, run_workers
from .workload import rank_ratio_of

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

# What a bench writes into --out (claimed before it starts: pufferfish.outputs).
BENCH_FILES = ("results.json", "results.md", "projection.json", "step_time.png", "projection.png",
               "time_to_accuracy.png", "time_to_accuracy_projected.png")
TRAIN_FILES = ("train", "train_results.json", "train.md")  # --train: runs in train/<link>/<method>
PROBE_BYTES = 16_000_000  # large enough for steady-state throughput, a few s at 100mbit
NO_TIMEOUT = 10.0 * 365 * 86400

Log = Callable[[str], None]


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
    rate, delay_ms = parse_link(text)
    if rate is None:
        return contextlib.nullcontext()
    reason = netem_available() if delay_ms > 0 else netns_available()
    if reason is not None:
        log(f"skipping {text}: link emulation unavailable ({reason}); "
            "emulated conditions are never replaced by loopback or run without their delay")
        skipped.append({"bandwidth": text, "reason": reason})
        return None
    cleanup_stale()
    return EmulatedLink(rate, delay_ms=delay_ms)


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


def _channels_flag(cfg: BenchConfig) -> str:
    """The memory-format flag, the same for step timing and training runs."""
    return "--channels-last" if cfg.channels_last else "--no-channels-last"


def _step_argv(cfg: BenchConfig, methods: list[str], out: Path, cache: Path) -> list[str]:
    argv = [
        sys.executable, "-m", "pufferfish.bench.step", "--methods", ",".join(methods),
        "--model", cfg.model, "--width", str(cfg.width), "--batch-size", str(cfg.batch_size),
        "--grad-accum", str(cfg.grad_accum), "--steps", str(cfg.steps), "--warmup", str(cfg.warmup),
        "--compute-steps", str(cfg.compute_steps), *_hook_flags(cfg), _channels_flag(cfg),
        "--bucket-mb", str(cfg.bucket_mb), "--inner-steps", str(cfg.inner_steps),
        "--seq-len", str(cfg.seq_len), "--vocab", str(cfg.vocab_size),
        "--threads", str(cfg.worker_threads()), "--cache-dir", str(cache), "--out", str(out),
    ]  # fmt: skip
    if cfg.data_dir:
        argv += ["--data-dir", cfg.data_dir]
    if cfg.compile:
        argv.append("--compile")
    if cfg.rank_ratio is not None:  # else the worker's default: 0.25, a Workload's own
        argv += ["--rank-ratio", str(cfg.rank_ratio)]
    argv += ["--amp", cfg.amp]
    return argv


def _worker_env() -> dict[str, str]:
    # The workers' own thread count is set with --threads; keep OpenMP from oversubscribing.
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_bench(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Measure every (bandwidth, method) in interleaved rounds (or reuse ``--from-results``),
    project, time to accuracy if asked, and write the outputs to ``cfg.out``, held
    (:func:`~pufferfish.outputs.hold`) from before the claim until they are sealed.

    Returns ``{"config", "links", "order", "rounds", "rows", "compute_check", "projection",
    "time_to_accuracy", "skipped", "failures"}``: ``rounds`` holds one record per round,
    link and method, ``rows`` their summary per link and method.
    """
    cfg.validate()
    if cfg.torchrun and not is_rank0():  # under torchrun rank 0 writes and prints
        return {**_measured(cfg, _quiet), "failures": []}
    with _hold_out(cfg):
        _claim_bench(cfg)
        return _bench(cfg, log)


def _hold_out(cfg: BenchConfig) -> contextlib.AbstractContextManager[Held]:
    """Hold ``--out`` for this bench; without one, a new ``runs/bench-<date-time>`` (one atomic
    mkdir, the next free ``-N`` if taken, as a run's default directory), which ``cfg.out`` then
    names (results.json's config says where the results are)."""
    if cfg.out:
        return hold(cfg.out, "bench")
    cfg.out = str(make_fresh(Path(f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")))
    return hold(cfg.out, "bench", created=True)


def _claim_bench(cfg: BenchConfig) -> None:
    """Claim the bench's files in ``cfg.out``: an earlier bench's measurements (results.json)
    are replaced only with ``--overwrite``, or carried over when ``--from-results`` names them."""
    results = Path(cfg.out) / "results.json"
    reused = bool(cfg.from_results) and results_path(cfg.from_results).resolve() == \
        results.resolve()
    claim_outputs(cfg.out, "bench", BENCH_FILES, cfg.overwrite,
                  keep=() if reused else ("results.json",),
                  also=f"--from-results {results} (its measurements reused)")


def _bench(cfg: BenchConfig, log: Log) -> dict[str, Any]:
    """The step times (measured or reused), projected, and the outputs written."""
    measured = _measured(cfg, log)
    records = measured["rounds"]
    links = [link["bandwidth"] for link in measured["links"]]
    rows = summarize(records, links, cfg.methods)
    projection = project(rows, cfg)
    result = {"config": {**asdict(cfg), "threads": cfg.worker_threads(),
                         "method_settings": cfg.method_settings()}, **measured,
              "rows": rows, "compute_check": compute_check(rows), "projection": projection,
              "time_to_accuracy": time_to_accuracy_result(cfg, rows, links, projection)}
    projected = (result["time_to_accuracy"] or {}).get("projected")
    fallback = [m for m, src in projection["compute_sources"].items() if src == "cpu ratio"]
    if fallback:
        log("note: --compute-ms gave no factorized=MS, so the projection"
            + (" and the projected time to accuracy" if projected else "")
            + " assume the factorized model keeps this CPU's low-rank/full compute ratio "
            f"({projection['cpu_lowrank_compute_ratio']:.2f}) for {', '.join(fallback)}; give "
            "--compute-ms full=MS,factorized=MS to use your GPU's")
    _write_outputs(cfg, result, log)
    return result


def _measured(cfg: BenchConfig, log: Log) -> dict[str, Any]:
    """The step times: an earlier run's (``--from-results``), measured in torchrun's processes
    (:mod:`.launched`), or by the bench's own worker groups; the user's model's factorization
    said first."""
    if is_user_model(cfg.model) and not cfg.from_results:
        ratios = dict.fromkeys(rank_ratio_of(cfg.settings_of(m)) for m in cfg.methods
                               if hook_for(m)[0])
        for ratio in ratios:
            at = "" if ratio is None else f" at rank ratio {ratio:g}"
            log(f"Pufferfish factorizes {cfg.model}{at}:\n"
                f"{factorization_report(cfg.model, cfg.seq_len, ratio)}")
    if cfg.from_results:
        saved = load_results(cfg.from_results)
        log(f"step times from {results_path(cfg.from_results)} (measured, not re-run)")
        return {k: saved[k] for k in ("links", "order", "rounds", "skipped", "failures")}
    if not cfg.torchrun:
        return _measure(cfg, log)
    with tempfile.TemporaryDirectory(prefix="pf-bench-") as tmp:
        flags = _step_argv(cfg, cfg.methods, Path(tmp) / "unused.json", Path(tmp) / "cache")
        return measure_in_group(cfg.methods, cfg.rounds, flags[3:],
                                PROBE_BYTES if cfg.probe else 0, log,
                                lambda text, r, rec: log(_record_line(text, r, rec)))


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
            links.append({"bandwidth": text, "bandwidth_bps": rate,
                          "delay_ms": link.delay_ms if link is not None else 0.0,
                          "link_bps": probed.bus_bps if probed else None,
                          "link_rtt_s": probed.latency_s if probed else None})
            opened[text] = link
        order = round_plan(list(opened), cfg.methods, cfg.rounds)
        bar = stack.enter_context(measuring(sum(len(plan) for plan in order)))
        for r, plan in enumerate(order):
            log(f"round {r + 1}/{cfg.rounds}: "
                + "; ".join(f"{text}: {', '.join(ms)}" for text, ms in plan))
            for text, methods in plan:
                info = next(x for x in links if x["bandwidth"] == text)
                bar.set_postfix_str(f"round {r + 1}, {text}")
                got, err = _step_group(cfg, opened[text], methods, Path(tmp))
                bar.update(1)
                for rec in got:
                    rec = {"round": r, **info, **rec}
                    records.append(rec)
                    log(_record_line(text, r, rec))
                if err is not None:
                    done = {rec["method"] for rec in got}
                    lost = [m for m in methods if m not in done]
                    kept = f" (kept: {', '.join(sorted(done))})" if done else ""
                    failures.append({**_fail(",".join(lost) or "-", text, err + kept, log),
                                     "round": r})
    return {"links": links, "order": order, "rounds": records, "skipped": skipped,
            "failures": failures}


def _quiet(text: str) -> None:
    """The log of a torchrun rank other than 0: rank 0 says it all."""


def _record_line(text: str, r: int, rec: dict[str, Any]) -> str:
    """One measured record of round ``r`` over link ``text``, as the log shows it."""
    return (f"[{text}] round {r + 1} {rec['method']}: step {rec['step_time']:.4f} s "
            f"= compute {rec['compute_time']:.4f} + comm {rec['comm_time']:.4f} "
            f"(compress {rec['compress_time']:.4f}); "
            f"{rec['bytes_per_step'] / 1e6:.3f} MB/step; "
            + ("FSDP2" if rec.get("parallel") == "fsdp" else
               f"DiLoCo, an outer step every {rec['inner_steps']} steps"
               if "inner_steps" in rec else
               f"buckets {rec.get('bucket_mib') or 'torch'}"))


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


def _probe(link: EmulatedLink | None, text: str, log: Log) -> ProbeResult | None:
    """All-reduce bus bandwidth and round trip the link delivers (None, with a message, if the
    probe fails)."""
    try:
        res = measure_link(link, nbytes=PROBE_BYTES)
    except (RuntimeError, subprocess.SubprocessError) as e:
        log(f"[{text}] link probe failed ({str(e).strip().splitlines()[0]}); "
            "the projection will use the nominal rate and delay")
        return None
    nominal = f" of nominal {format_bps(link.rate_bps)}" if link is not None else ""
    delay = f" (nominal {2 * link.delay_ms:g} ms)" if link is not None and link.delay_ms else ""
    log(f"[{text}] link probe: all-reduce bus bandwidth {format_bps(res.bus_bps)}{nominal}, "
        f"round trip {1e3 * res.latency_s:.2f} ms{delay}")
    return res


# -- outputs ----------------------------------------------------------------------------------------


def _write_outputs(cfg: BenchConfig, result: dict[str, Any], log: Log) -> None:
    out = Path(cfg.out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "projection.json").write_text(json.dumps(result["projection"], indent=1))
    plots = plot_results(result, out) if result["rows"] else []
    if result["time_to_accuracy"]:
        plots += acc.plot(result["time_to_accuracy"], out)
    (out / "results.md").write_text(results_markdown(cfg, result, plots))
    seal_outputs(out, "bench", BENCH_FILES)
    log(f"written: {out / 'results.json'}, {out / 'results.md'}, {out / 'projection.json'}"
        + "".join(f", {p}" for p in plots))


# -- --train: time to accuracy ----------------------------------------------------------------------


def _train_argv(cfg: BenchConfig, method: str, run_dir: Path) -> list[str]:
    factorized, hook = hook_for(method)
    epochs = cfg.epochs_per_method()[method]
    mine = cfg.settings_of(method)  # its own settings (powersgd:rank=2) over the global flags
    argv = [
        sys.executable, "-m", "pufferfish", "train", "--model", cfg.model,
        "--width", str(cfg.width), "--data", "fashion-mnist",
        "--mode", "pufferfish" if factorized else "full", "--comm", hook,
        "--epochs", str(epochs), "--batch-size", str(cfg.batch_size), "--lr", str(cfg.lr),
        "--train-subset", str(cfg.train_subset), "--val-subset", str(cfg.val_subset),
        "--test-subset", str(cfg.test_subset),
        *_hook_flags(mine), _channels_flag(cfg), "--bucket-mb", str(cfg.bucket_mb),
        "--threads", str(cfg.worker_threads()), "--checkpoint-every-epochs", str(epochs),
        "--no-progress", "--out", str(run_dir), "--overwrite",  # an earlier bench's (asked)
    ]  # fmt: skip
    if factorized:
        argv += ["--warmup-epochs", str(cfg.warmup_epochs)]
        if mine.rank_ratio is not None:
            argv += ["--rank-ratio", str(mine.rank_ratio)]
    if sync_for(method) == "diloco":
        argv += ["--sync", "diloco", "--inner-steps", str(mine.inner_steps)]
    if parallel_for(method) == "fsdp":
        argv += ["--parallel", "fsdp"]
    if cfg.train_config:  # its keys first; the flags above override them
        argv[4:4] = ["--config", cfg.train_config]
    if cfg.data_dir:
        argv += ["--data-dir", cfg.data_dir]
    if cfg.compile:
        argv.append("--compile")
    return argv


def run_train(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Train every method on every link; per link, a time-to-accuracy report and plot.

    Runs land in ``out/train/<bandwidth>/<method>``; ``out/train/<bandwidth>/report.md`` and
    ``accuracy.png`` come from :func:`pufferfish.report.compare_runs` (accuracy
    against the summed epoch times, i.e. training wall-clock without evaluation).
    ``out/train_results.json`` has, per run, the time to reach the best accuracy that
    every run of that link reached.
    """

    cfg.validate()
    with _hold_out(cfg):
        # An earlier bench's training runs are replaced only with --overwrite.
        claim_outputs(cfg.out, "bench", TRAIN_FILES, cfg.overwrite,
                      keep=("train_results.json", "train"))
        return _train_all(cfg, Path(cfg.out), log)


def _train_all(cfg: BenchConfig, root: Path, log: Log) -> dict[str, Any]:
    """Every method trained over every link into ``root/train``, summarized, written."""
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
            summary += train_summary(text, done)
            log(compare_runs([str(d) for _, d in done], str(root / "train" / text),
                             command="bench"))
    machine = machine_facts()
    (root / "train_results.json").write_text(json.dumps(
        {"runs": summary, "skipped": skipped, "failures": failures, "machine": machine}, indent=1))
    (root / "train.md").write_text(train_markdown(cfg, summary, skipped, failures, machine))
    seal_outputs(root, "bench", TRAIN_FILES)
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
    try:  # run_dir is out/train/<bandwidth>/<method>
        with TrainingProgress(run_dir, f"{method} over {run_dir.parent.name}",
                              cfg.epochs_per_method()[method], log):
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
