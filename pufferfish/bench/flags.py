"""``pufferfish bench``'s command-line flags, in the order ``--help`` lists them, and the
:class:`~.config.BenchConfig` they make (kept here so that ``cli.py`` stays parsing-only)."""

from __future__ import annotations

import argparse

from .config import (
    DEFAULT_METHODS,
    STEP_TIMEOUT,
    BenchConfig,
    measured_config,
    parallel_methods,
)
from .launched import torchrun_links, under_torchrun
from .methods import BENCH_METHODS, FSDP_VERSIONS, HOOK_OPTIONS
from .usermodel import is_user_model
from .workload import image_models, lm_models

__all__ = ["add_arguments", "config_from_args"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pufferfish bench`` options (kept here so that ``cli.py`` stays parsing-only), in the
    order ``--help`` lists them."""
    d = BenchConfig()
    _model_arguments(ap, d)
    _measurement_arguments(ap, d)
    _output_arguments(ap, d)
    _train_arguments(ap, d)


def _model_arguments(ap: argparse.ArgumentParser, d: BenchConfig) -> None:
    """What is measured: the model and the methods."""
    ap.add_argument("--model", default=d.model,
                    help=f"{', '.join((*image_models(), *lm_models()))}, or yours: "
                         "PATH.py:NAME (NAME a pufferfish.models.ModelSpec), PATH.py:FUNC or "
                         "package.module:FUNC (FUNC() returns a pufferfish.bench.Workload), "
                         "hf:CONFIG.json (a Hugging Face causal LM from its config)")
    ap.add_argument("--seq-len", type=int, default=d.seq_len,
                    help="language models: tokens per sequence of a batch")
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size,
                    help="language models: vocabulary size of the model and its batches")
    ap.add_argument("--width", type=float, default=d.width, help="channel multiplier")
    ap.add_argument("--methods", default=",".join(d.methods),
                    help=f"comma-separated, from: {', '.join(BENCH_METHODS)} (with --parallel "
                         "fsdp the default is ddp,pufferfish); each may carry its own settings, "
                         "METHOD:KEY=VALUE[:KEY=VALUE...], e.g. powersgd:rank=1,powersgd:rank=8,"
                         "pufferfish:rank_ratio=0.125 (keys: the hook's options without its "
                         "prefix, rank_ratio, inner_steps)")
    ap.add_argument("--rank-ratio", type=float, default=d.rank_ratio,
                    help="rank ratio of the factorized methods (default: 0.25, the paper's; "
                         "your Workload: its own rank_ratio); a method's rank_ratio= wins")
    ap.add_argument("--parallel", choices=("ddp", "fsdp"), default=d.parallel,
                    help="fsdp: measure the FSDP2 versions of --methods ddp,pufferfish "
                         "(fsdp, pufferfish+fsdp; no other method has one); to compare both "
                         "side by side, keep ddp and name them: --methods "
                         "ddp,pufferfish,fsdp,pufferfish+fsdp")


def _measurement_arguments(ap: argparse.ArgumentParser, d: BenchConfig) -> None:
    """How the steps are measured: links, workers, steps, buckets, the methods' options."""
    ap.add_argument("--bandwidth", default=None,
                    help="comma-separated: loopback and/or emulated rates such as 1gbit,100mbit, "
                         "each with an optional one-way latency, e.g. 100mbit,100mbit@20ms "
                         "(emulation needs root + iproute2, a latency netem, and exactly 2 "
                         "workers; not under torchrun, which measures its own link) "
                         "(default: loopback)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes per group; more than 2 only on loopback; not under "
                         f"torchrun, whose processes are the workers (default: {d.workers})")
    ap.add_argument("--steps", type=int, default=d.steps,
                    help="timed full steps (DDP, or FSDP2 for fsdp methods)")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    ap.add_argument("--compute-steps", type=int, default=d.compute_steps,
                    help="timed steps under ddp.no_sync(), compute only (fsdp methods: on an "
                         "unsharded copy of the model)")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="per worker")
    ap.add_argument("--grad-accum", type=int, default=d.grad_accum,
                    help="micro-batches of --batch-size per step, one gradient synchronization")
    for option in HOOK_OPTIONS:
        ap.add_argument("--" + option.key.replace("_", "-"), type=option.kind,
                        default=getattr(d, option.key), help=option.help)
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="torch threads per worker (0: cores // workers)")
    ap.add_argument("--data-dir", default=d.data_dir, help="Fashion-MNIST directory")
    ap.add_argument("--alpha-us", type=float, default=d.alpha * 1e6,
                    help="per-message latency of the projection model, microseconds")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                    help="conv weights in NHWC memory order (default: on for our models and "
                         "model specs, as `pufferfish train` stores them; off for your Workload "
                         "(--model PATH.py:FUNC, hf:CONFIG), timed in the layout you built)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=d.compile,
                    help="torch.compile every method's model (compiled in the warm-up steps)")
    ap.add_argument("--amp", default=d.amp,
                    help="autocast of every timed step: bf16, or fp16 with a GradScaler (none: "
                         "full precision)")
    ap.add_argument("--bucket-mb", default=d.bucket_mb,
                    help="DDP's gradient bucket cap in MiB, 'torch' (torch's default) or 'auto' "
                         "(each method's fastest, timed on its own steps)")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="skip the all-reduce probe that measures each link's real rate")
    ap.add_argument("--timeout", type=float, default=d.timeout,
                    help=f"seconds per worker group (0: {STEP_TIMEOUT:.0f} for step timing, "
                         "no limit for --train)")
    ap.add_argument("--rounds", type=int, default=d.rounds,
                    help="interleaved rounds: every (link, method) once per round, the order "
                         "rotating; rows give the median and min-max over rounds")


def _output_arguments(ap: argparse.ArgumentParser, d: BenchConfig) -> None:
    """Where results go, and accuracy against wall-clock from earlier runs or results."""
    ap.add_argument("--out", default=d.out,
                    help="output directory (default: a new runs/bench-DATE-TIME)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace files in --out that another command (or you) wrote there")
    ap.add_argument("--accuracy-runs", default=d.accuracy_runs, metavar="METHOD=DIR,...",
                    help="`pufferfish train` runs whose per-epoch accuracy, timed with the "
                         "measured step times, gives accuracy against wall-clock per link, "
                         "e.g. ddp=runs/full,powersgd=runs/psgd,pufferfish=runs/puff "
                         "(same model, width and batch; a ddp run sets the target)")
    ap.add_argument("--accuracy-processes", type=int, default=d.accuracy_processes,
                    metavar="N", help="processes the --accuracy-runs trained on, when not "
                    "--workers (e.g. 1: one GPU at batch 128 for 2 workers x 64); 0: --workers")
    ap.add_argument("--compute-ms", default=d.compute_ms,
                    metavar="full=MS,factorized=MS,METHOD=MS",
                    help="your GPU's ms per training step (one worker's batch) of the full-rank "
                         "and factorized models, and of any method with its encode/decode (e.g. "
                         "full=9.5,factorized=13.7,powersgd=38), for the projection to 8-64 "
                         "workers at 1/10/100 Gbit/s and (with --accuracy-runs) time to "
                         "accuracy; without factorized= the factorized model keeps this CPU's "
                         "low-rank/full ratio, which the results state")
    ap.add_argument("--from-results", default=d.from_results, metavar="RESULTS_JSON",
                    help="reuse the step times of an earlier bench (its results.json, or its "
                         "--out directory) instead of measuring; measurement flags are ignored")


def _train_arguments(ap: argparse.ArgumentParser, d: BenchConfig) -> None:
    """``--train``: each method trained with ``pufferfish train``."""
    ap.add_argument("--train", action="store_true",
                    help="train each method with `pufferfish train` and plot time-to-accuracy")
    ap.add_argument("--epochs", type=int, default=d.epochs, help="--train: epochs per method")
    ap.add_argument("--method-epochs", default=d.method_epochs, metavar="METHOD=EPOCHS,...",
                    help="--train: other epochs for some methods, e.g. pufferfish=5 with "
                         "--epochs 4 (an equal wall-clock budget: a faster method trains more "
                         "epochs in the same time)")
    ap.add_argument("--warmup-epochs", type=int, default=d.warmup_epochs,
                    help="--train: Pufferfish's full-rank warm-up epochs")
    ap.add_argument("--train-subset", type=int, default=d.train_subset,
                    help="--train: first N training examples (0: all)")
    ap.add_argument("--val-subset", type=int, default=d.val_subset,
                    help="--train: training images held out as the validation split (0: none)")
    ap.add_argument("--test-subset", type=int, default=d.test_subset,
                    help="--train: first N test examples (0: all)")
    ap.add_argument("--lr", type=float, default=d.lr, help="--train: learning rate")
    ap.add_argument("--inner-steps", type=int, default=d.inner_steps,
                    help="diloco, pufferfish+diloco: optimizer steps between synchronizations")
    ap.add_argument("--train-config", default=d.train_config, metavar="TOML",
                    help="--train: a `pufferfish train` config file for the runs' other options "
                         "(keep, switch_momentum, schedule, ...); the flags above win")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A validated :class:`BenchConfig` from parsed ``add_arguments`` options."""
    bandwidths, workers = _links_arg(args)  # first: under torchrun, --from-results is refused
    measured = measured_config(args.from_results) if args.from_results else {}
    cfg = BenchConfig(
        model=args.model, width=args.width, parallel=args.parallel,
        methods=parallel_methods(_methods_arg(args), args.parallel),
        bandwidths=bandwidths, workers=workers, torchrun=under_torchrun(),
        steps=args.steps, warmup=args.warmup,
        compute_steps=args.compute_steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
        seq_len=args.seq_len, vocab_size=args.vocab_size,
        **{option.key: getattr(args, option.key) for option in HOOK_OPTIONS},
        threads=args.threads,
        data_dir=args.data_dir, alpha=args.alpha_us * 1e-6, probe=args.probe,
        channels_last=(not is_user_model(args.model) if args.channels_last is None
                       else args.channels_last), compile=args.compile, amp=args.amp,
        bucket_mb=args.bucket_mb,
        timeout=args.timeout, out=args.out, overwrite=args.overwrite, train=args.train,
        epochs=args.epochs,
        method_epochs=args.method_epochs,
        warmup_epochs=args.warmup_epochs, train_subset=args.train_subset,
        val_subset=args.val_subset, test_subset=args.test_subset, lr=args.lr, train_config=args.train_config,
        inner_steps=args.inner_steps, rank_ratio=args.rank_ratio,
        rounds=args.rounds,
        accuracy_runs=args.accuracy_runs, accuracy_processes=args.accuracy_processes,
        compute_ms=args.compute_ms,
        from_results=args.from_results,
    )  # fmt: skip
    for key, value in measured.items():  # what was measured, not today's flags
        setattr(cfg, key, value)
    cfg.validate()
    return cfg


def _links_arg(args: argparse.Namespace) -> tuple[list[str], int]:
    """``--bandwidth`` and ``--workers``, or under torchrun its link and processes."""
    if under_torchrun():
        return torchrun_links(args.bandwidth, args.workers, args.from_results)
    text = "loopback" if args.bandwidth is None else args.bandwidth
    workers = BenchConfig.workers if args.workers is None else args.workers
    return [b.strip() for b in text.split(",") if b.strip()], workers


def _methods_arg(args: argparse.Namespace) -> list[str]:
    """``--methods`` as a list; under ``--parallel fsdp`` the default is the two that have an
    FSDP2 version."""
    if args.parallel == "fsdp" and args.methods == ",".join(DEFAULT_METHODS):
        return list(FSDP_VERSIONS)
    return [m.strip() for m in args.methods.split(",") if m.strip()]


