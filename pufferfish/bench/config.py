"""``pufferfish bench``'s settings: :class:`BenchConfig` (checked in one place), its command-line
flags, and the measured settings of an earlier run that ``--from-results`` reuses."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..configfile import FIELDS, load_config
from ..data import DEFAULT_FASHION_DIR
from ..distributed.buckets import parse_bucket_mb
from ..distributed.hooks import with_option_fields
from . import accuracy as acc
from . import projection as proj
from .bandwidth import parse_link
from .launched import TORCHRUN_LINK, launched_world, torchrun_links, under_torchrun
from .step import (
    BENCH_METHODS,
    FSDP_METHODS,
    FSDP_VERSIONS,
    HOOK_DEFAULTS,
    HOOK_OPTIONS,
    LM_MODELS,
    hook_for,
    parse_method_map,
)
from .usermodel import check_workload, is_user_model

__all__ = [
    "COMPUTE_MS_FORM",
    "DEFAULT_METHODS",
    "IMAGE_MODELS",
    "STEP_TIMEOUT",
    "BenchConfig",
    "add_arguments",
    "config_from_args",
    "load_results",
    "parallel_methods",
    "parse_compute_ms",
    "results_path",
]

DEFAULT_METHODS = ("ddp", "fp16", "powersgd", "signum", "topk", "pufferfish")
IMAGE_MODELS = ("resnet18", "vgg19_bn")
STEP_TIMEOUT = 3600.0  # per worker group, when --timeout is not given


COMPUTE_MS_FORM = ("full=MS,factorized=MS, your GPU's ms per step of each model with MS > 0 "
                   "(e.g. full=40,factorized=22), or full=MS / MS alone")


def parse_compute_ms(value: str | float) -> tuple[float, float | None]:
    """``--compute-ms`` as ``(full-rank ms, factorized ms or None)``; ``ValueError`` (one line)
    names the value and :data:`COMPUTE_MS_FORM`. Without the factorized figure the projection
    scales the factorized model's time by the CPU's low-rank/full ratio (:func:`~pufferfish.bench.accuracy.projected_curves`).
    """
    bad = ValueError(f"--compute-ms {str(value)!r} is invalid: allowed {COMPUTE_MS_FORM}")
    if isinstance(value, bool):
        raise bad
    text = str(value).strip()
    found: dict[str, float] = {}
    for item in (text.split(",") if "=" in text else [f"full={text}"]):
        key, _, ms = (x.strip() for x in item.partition("="))
        try:
            number = float(ms)
        except ValueError:
            raise bad from None
        if key not in ("full", "factorized") or key in found or not 0 < number < math.inf:
            raise bad
        found[key] = number
    if "full" not in found:
        raise bad
    return found["full"], found.get("factorized")


@dataclass
@with_option_fields(after="batch_size", defaults=HOOK_DEFAULTS, options=HOOK_OPTIONS)
class BenchConfig:
    """Everything ``pufferfish bench`` needs; :meth:`validate` gives one-line errors."""

    model: str = "resnet18"
    width: float = 0.5
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    parallel: str = "ddp"  # fsdp: --methods ddp,pufferfish measured as fsdp,pufferfish+fsdp
    bandwidths: list[str] = field(default_factory=lambda: ["loopback"])
    workers: int = 2
    torchrun: bool = False  # measured inside torchrun's processes, over their link (launched.py)
    steps: int = 20
    warmup: int = 3
    compute_steps: int = 5
    batch_size: int = 128
    grad_accum: int = 1  # micro-batches per step: times and bytes per optimizer step
    seq_len: int = 64  # language models: tokens per sequence of a batch
    vocab_size: int = 2000  # language models: vocabulary (KJV words, the rarest clamped)
    # ... then one field per comm-hook option: powersgd_rank, powersgd_start_iter, ...
    threads: int = 0  # 0: cores // workers
    data_dir: str = ""
    rounds: int = 3
    alpha: float = proj.DEFAULT_ALPHA
    probe: bool = True
    channels_last: bool = True  # conv weights NHWC, as `pufferfish train` has them by default
    compile: bool = False  # torch.compile every method's model (compiled in the warm-up steps)
    bucket_mb: str = "auto"  # DDP bucket cap (MiB), torch's default, or each method's fastest
    timeout: float = 0.0  # 0: STEP_TIMEOUT per step group, no limit per training run
    out: str = "runs/bench"
    overwrite: bool = False  # replace files in --out that another command wrote
    # time to accuracy from existing runs' accuracy and the measured (or reused) step times
    accuracy_runs: str = ""
    accuracy_processes: int = 0  # processes the accuracy runs trained on (0: --workers)
    compute_ms: str | float | None = None  # --compute-ms: parse_compute_ms's forms
    from_results: str = ""
    # --train
    train: bool = False
    epochs: int = 3
    # "pufferfish=5,...": epochs for named methods (the rest train --epochs). An equal wall-clock
    # comparison: a method whose epoch is faster trains more of them in the same time.
    method_epochs: str = ""
    warmup_epochs: int = 1
    train_subset: int = 0
    val_subset: int = FIELDS["val_subset"].default  # held out of training, as `pufferfish train`
    test_subset: int = 0
    lr: float = 0.1
    inner_steps: int = 50  # DiLoCo methods: optimizer steps between synchronizations
    train_config: str = ""  # a `pufferfish train` TOML for every other option of the runs

    def validate(self) -> None:
        """Check every value before any process starts (``ValueError``: CLI exit 2)."""
        if is_user_model(self.model):
            self._validate_user_model()
        elif self.model not in (*IMAGE_MODELS, *LM_MODELS):
            raise ValueError(
                f"model {self.model!r} is invalid for the benchmark: allowed "
                f"{', '.join((*IMAGE_MODELS, *LM_MODELS))}, or your own: PATH.py:FUNC, "
                "package.module:FUNC, hf:CONFIG.json"
            )
        if self.model in LM_MODELS and (self.train or self.accuracy_runs):
            raise ValueError(f"model {self.model!r}: --train and --accuracy-runs are for the "
                             f"image models ({', '.join(IMAGE_MODELS)}); step times only")
        self._validate_methods()
        self._validate_fsdp()
        if self.torchrun:
            self._validate_torchrun()
        else:
            self._validate_links()
        for option in HOOK_OPTIONS:
            option.check(getattr(self, option.key))
        for name in ("steps", "compute_steps", "batch_size", "epochs", "rounds", "inner_steps",
                     "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 1")
        if self.width <= 0:
            raise ValueError(f"width {self.width!r} is invalid: allowed > 0")
        self._validate_grad_accum()
        parse_bucket_mb(self.bucket_mb)
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"powersgd_start_iter {self.powersgd_start_iter} is invalid: allowed >= 2 "
                "(DDP re-buckets after step 1, and PowerSGD's memory must follow)"
            )
        if any("powersgd" in m for m in self.methods) and self.warmup < self.powersgd_start_iter:
            raise ValueError(
                f"warmup {self.warmup} is invalid: allowed >= powersgd_start_iter "
                f"({self.powersgd_start_iter}), so that timed PowerSGD steps compress"
            )
        if self.warmup < 2:
            raise ValueError(f"warmup {self.warmup} is invalid: allowed >= 2 (DDP rebuilds its "
                             "buckets after its first step, which must not be timed)")
        for name in ("threads", "train_subset", "val_subset", "test_subset", "warmup_epochs",
                     "alpha", "timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 0")
        if self.val_subset >= acc.FASHION_MNIST_TRAIN:
            raise ValueError(f"--val-subset {self.val_subset} is invalid: allowed 0 (none) to "
                             f"{acc.FASHION_MNIST_TRAIN - 1} (Fashion-MNIST, less one to train on)")
        for name, n, what in (
                ("train_subset", acc.FASHION_MNIST_TRAIN - self.val_subset,
                 f"Fashion-MNIST less the {self.val_subset} of --val-subset"),
                ("test_subset", acc.FASHION_MNIST_TEST, "Fashion-MNIST")):
            if getattr(self, name) > n:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: "
                                 f"allowed 0 (all) to {n} ({what})")
        if self.lr <= 0:
            raise ValueError(f"lr {self.lr!r} is invalid: allowed > 0")
        epochs = self.epochs_per_method()
        for m in self.methods:
            if self.train and hook_for(m)[0] and self.warmup_epochs >= epochs[m]:
                raise ValueError(
                    f"warmup_epochs {self.warmup_epochs} is invalid with {m}'s {epochs[m]} "
                    "epochs: Pufferfish methods need warmup_epochs < epochs"
                )
        if self.train_config:
            try:
                load_config(self.train_config)
            except ConfigError as e:
                raise ValueError(f"--train-config: {e}") from None
        self._validate_accuracy()
        data = Path(self.data_dir) if self.data_dir else _default_data_dir()
        if not self.from_results and self.model in IMAGE_MODELS and not data.is_dir():
            raise ValueError(
                f"Fashion-MNIST directory {str(data)!r} does not exist: install the Debian "
                "package dataset-fashion-mnist or pass --data-dir"
            )

    def _validate_links(self) -> None:
        """``--bandwidth`` and ``--workers``: the links this bench emulates and its groups."""
        if not self.bandwidths:
            raise ValueError("--bandwidth is empty: allowed e.g. loopback,1gbit,100mbit")
        rates = [parse_link(b)[0] for b in self.bandwidths]
        if self.workers < 2:
            raise ValueError(f"--workers {self.workers} is invalid: allowed >= 2 (DDP)")
        if self.workers != 2 and any(r is not None for r in rates):
            raise ValueError(
                f"--workers {self.workers}: an emulated link connects exactly 2 workers; "
                "use --workers 2, or --bandwidth loopback for more workers"
            )

    def _validate_torchrun(self) -> None:
        """Under torchrun: its processes over their own link, step times only."""
        if self.workers < 2:
            raise ValueError(f"torchrun started {self.workers} process(es): allowed >= 2 "
                             "(--nnodes x --nproc-per-node), DDP needs peers")
        if self.bandwidths != [TORCHRUN_LINK]:
            raise ValueError(f"--bandwidth {','.join(self.bandwidths)!r} is invalid under "
                             "torchrun, which measures the link its processes have: allowed "
                             "none (emulated links are for a bench outside torchrun)")
        if self.train:
            raise ValueError("--train is invalid under torchrun: allowed outside it (under "
                             "torchrun the bench measures step times)")

    def _validate_user_model(self) -> None:
        """``--model PATH.py:FUNC`` (or ``module:FUNC``, ``hf:CONFIG.json``): it loads, keeps the
        Workload contract, and Pufferfish finds layers to factorize if a method needs them; the
        methods and modes that need one of our models are refused."""
        if self.train or self.accuracy_runs:
            raise ValueError(f"--model {self.model!r}: --train and --accuracy-runs train our "
                             f"models ({', '.join(IMAGE_MODELS)}); your model: step times only")
        for m in self.methods:
            hook_for(m)
            if m == "galore" or m in FSDP_METHODS:
                raise ValueError(f"method {m!r} is invalid with your model {self.model!r}: "
                                 "allowed the DDP and DiLoCo methods")
        if self.from_results:
            return  # measured before: nothing is built
        check_workload(self.model, self.seq_len, any(hook_for(m)[0] for m in self.methods))

    def _validate_grad_accum(self) -> None:
        """``--grad-accum``: step timing only; the time-to-accuracy runs count steps of one
        batch (bench/accuracy.py), so they keep 1."""
        n = self.grad_accum
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--grad-accum {n!r} is invalid: allowed an integer >= 1 "
                             "(micro-batches per step)")
        if n > 1 and (self.train or self.accuracy_runs):
            raise ValueError(f"--grad-accum {n} is invalid with --train or --accuracy-runs "
                             "(time to accuracy counts steps of one batch): allowed 1, or step "
                             "times only")
    def _validate_methods(self) -> None:
        """``--methods``: known, each once, and compared with one optimizer per workload."""
        if not self.methods:
            raise ValueError("--methods is empty: allowed a comma-separated list of "
                             + ", ".join(BENCH_METHODS))
        for m in self.methods:
            hook_for(m)
        if "galore" in self.methods and self.model not in LM_MODELS:
            raise ValueError(f"method 'galore' is invalid with model {self.model!r}: GaLore's "
                             "AdamW would race the image models' SGD; allowed with "
                             f"{', '.join(LM_MODELS)} (every method there steps with AdamW)")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"--methods {','.join(self.methods)!r} names a method twice")

    def _validate_fsdp(self) -> None:
        """``--parallel`` and the FSDP2 methods: what ``pufferfish train --parallel fsdp``
        refuses is refused here, before any worker starts."""
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"--parallel {self.parallel!r} is invalid: allowed ddp, fsdp")
        if self.parallel == "fsdp":
            parallel_methods(self.methods, "fsdp")  # every method has an FSDP2 version
        sharded = [m for m in self.methods if m in FSDP_METHODS]
        if not sharded:
            return
        if self.compile:
            raise ValueError(f"--compile is invalid with {sharded[0]} (FSDP2 runs are not "
                             "compiled: `pufferfish train --parallel fsdp` refuses it): allowed "
                             "--no-compile")
        if self.train:
            for m in sharded:
                factorized, hook = hook_for(m)
                try:
                    load_config(self.train_config or None, overrides={
                        "model": self.model, "parallel": "fsdp", "comm": hook,
                        "mode": "pufferfish" if factorized else "full"})
                except ConfigError as e:
                    raise ValueError(f"--train {m}: {e}") from None

    def _validate_accuracy(self) -> None:
        """``--accuracy-runs`` / ``--compute-ms``: the runs exist, match the measured model and
        batch, and the bench measures every step time their curves need."""
        if self.compute_ms is not None:
            parse_compute_ms(self.compute_ms)
        if self.accuracy_processes < 0:
            raise ValueError(f"accuracy_processes {self.accuracy_processes} is invalid: allowed "
                             ">= 1, or 0 for --workers")
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
        # An epoch of no full batch takes no time: its curve would divide by zero.
        counts = [self.workers]
        counts += list(acc.PROJECTED_WORKERS) if self.compute_ms is not None else []
        for run in runs.values():
            for p in counts:
                if acc.steps_per_epoch(run.train_examples, run.batch_size, p) < 1:
                    flag = "--accuracy-runs" if p == counts[0] else "--compute-ms"
                    raise ValueError(
                        f"{flag}: run {run.path} has {run.train_examples} training examples, "
                        f"no full batch of {run.batch_size} for each of {p} workers: allowed "
                        f"runs of >= {run.batch_size * p} examples (train_subset)")

    def load_accuracy_runs(self) -> dict[str, acc.AccuracyRun]:
        return acc.load_accuracy_runs(self.accuracy_runs, model=self.model, width=self.width,
                                      batch_size=self.batch_size,
                                      powersgd_rank=self.powersgd_rank, workers=self.workers,
                                      processes=self.accuracy_processes,
                                      inner_steps=self.inner_steps)

    def epochs_per_method(self) -> dict[str, int]:
        """``--train``'s epochs for each of ``methods``: ``--method-epochs`` over ``--epochs``
        (``ValueError`` naming a bad entry)."""
        epochs = dict.fromkeys(self.methods, self.epochs)
        form = "METHOD=EPOCHS with EPOCHS >= 1, e.g. pufferfish=5"
        named = parse_method_map(self.method_epochs, "--method-epochs", form, self.methods,
                                 f"the --methods ({','.join(self.methods)})")
        for method, count in named.items():
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"--method-epochs entry '{method}={count}' is invalid: allowed "
                                 + form)
            epochs[method] = int(count)
        if named and not self.train:
            raise ValueError("--method-epochs sets how long --train trains: give --train too")
        return epochs

    def worker_threads(self) -> int:
        """``--threads``, or this machine's cores shared by its processes (under torchrun:
        ``LOCAL_WORLD_SIZE`` of them)."""
        here = launched_world()[1] if self.torchrun else self.workers
        return self.threads or max(1, (os.cpu_count() or 1) // here)


def _default_data_dir() -> Path:
    return Path(DEFAULT_FASHION_DIR)


# -- command line --------------------------------------------------------------------------------


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
                    help=f"{', '.join((*IMAGE_MODELS, *LM_MODELS))}, or yours: PATH.py:FUNC or "
                         "package.module:FUNC (FUNC() returns a pufferfish.bench.Workload), "
                         "hf:CONFIG.json (a Hugging Face causal LM from its config)")
    ap.add_argument("--seq-len", type=int, default=d.seq_len,
                    help="language models: tokens per sequence of a batch")
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size,
                    help="language models: vocabulary size of the model and its batches")
    ap.add_argument("--width", type=float, default=d.width, help="channel multiplier")
    ap.add_argument("--methods", default=",".join(d.methods),
                    help=f"comma-separated, from: {', '.join(BENCH_METHODS)} (with --parallel "
                         "fsdp the default is ddp,pufferfish)")
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
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction,
                    default=d.channels_last,
                    help="conv weights in NHWC memory order (the training default; "
                         "--no-channels-last: NCHW)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=d.compile,
                    help="torch.compile every method's model (compiled in the warm-up steps)")
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
    ap.add_argument("--out", default=d.out, help="output directory")
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
    ap.add_argument("--compute-ms", default=d.compute_ms, metavar="full=MS,factorized=MS",
                    help="with --accuracy-runs: your GPU's time per training step of the "
                         "full-rank and the factorized model (one worker's batch), to project "
                         "time to accuracy for 8 and 64 workers at 1/10/100 Gbit/s; a single MS "
                         "(or no factorized=) scales the factorized model by this CPU's "
                         "low-rank/full ratio, an assumption the results state")
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
    measured = _measured_config(args.from_results) if args.from_results else {}
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
        channels_last=args.channels_last, compile=args.compile, bucket_mb=args.bucket_mb,
        timeout=args.timeout, out=args.out, overwrite=args.overwrite, train=args.train,
        epochs=args.epochs,
        method_epochs=args.method_epochs,
        warmup_epochs=args.warmup_epochs, train_subset=args.train_subset,
        val_subset=args.val_subset, test_subset=args.test_subset, lr=args.lr, train_config=args.train_config,
        inner_steps=args.inner_steps,
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


def parallel_methods(methods: list[str], parallel: str) -> list[str]:
    """The methods ``--methods`` names under ``--parallel``: with ``fsdp``, ddp and pufferfish
    become their FSDP2 versions; any other method is refused (``ValueError``, one line)."""
    if parallel != "fsdp":
        return list(methods)
    out = []
    for m in methods:
        if m not in FSDP_METHODS and m not in FSDP_VERSIONS:
            raise ValueError(
                f"method {m!r} is invalid with --parallel fsdp: allowed "
                f"{', '.join(FSDP_VERSIONS)} (measured as {', '.join(FSDP_VERSIONS.values())}), "
                "or --parallel ddp")
        out.append(FSDP_VERSIONS.get(m, m))
    return out


# Settings that describe a measurement, taken from the results when reused.
_MEASURED = ("model", "width", "methods", "parallel", "bandwidths", "workers", "steps", "warmup",
             "compute_steps", "batch_size", "grad_accum", *(option.key for option in HOOK_OPTIONS), "threads",
             "rounds", "channels_last", "compile", "bucket_mb", "inner_steps", "seq_len",
             "vocab_size", "torchrun")


def results_path(path: str) -> Path:
    p = Path(path)
    return p / "results.json" if p.is_dir() else p


def load_results(path: str) -> dict[str, Any]:
    """An earlier bench's ``results.json`` (``ValueError`` if it is not one)."""
    p = results_path(path)
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
    # Older results: NCHW, eager, torch's default buckets.
    saved = {"channels_last": False, "compile": False, "bucket_mb": "torch", "parallel": "ddp",
             **load_results(path)["config"]}
    return {k: saved[k] for k in _MEASURED if k in saved}
