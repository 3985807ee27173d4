"""``pufferfish bench``'s settings: :class:`BenchConfig` (checked in one place) and the measured
settings of an earlier run that ``--from-results`` reuses (the flags: :mod:`.flags`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..configfile import load_config
from ..data import DEFAULT_FASHION_DIR
from ..distributed.buckets import parse_bucket_mb
from ..distributed.hooks import with_option_fields
from ..models import model_names
from ..options import BatchOptions, ModelOptions, SubsetOptions, override_defaults
from . import accuracy as acc
from . import projection as proj
from .bandwidth import parse_link
from .launched import TORCHRUN_LINK, launched_world
from .methods import (
    BENCH_METHODS,
    FSDP_METHODS,
    FSDP_VERSIONS,
    HOOK_DEFAULTS,
    HOOK_OPTIONS,
    MethodSpec,
    base_of,
    hook_for,
    parse_method_map,
    setting_keys,
)
from .usermodel import check_workload, is_user_model
from .workload import adamw_models, image_models, is_lm, optimizer_name, rank_ratio_of

__all__ = [
    "AMP_CHOICES",
    "COMPUTE_MS_FORM",
    "DEFAULT_METHODS",
    "STEP_TIMEOUT",
    "BenchConfig",
    "load_results",
    "measured_config",
    "parallel_methods",
    "parse_compute_ms",
    "results_path",
]

DEFAULT_METHODS = ("ddp", "fp16", "powersgd", "signum", "topk", "pufferfish")
STEP_TIMEOUT = 3600.0  # per worker group, when --timeout is not given


COMPUTE_MS_FORM = ("full=MS,factorized=MS[,METHOD=MS...], your hardware's ms per step with "
                   "MS > 0: full= / factorized= each model's compute, METHOD= one method's "
                   "compute with its encode/decode (e.g. full=9.5,factorized=13.7,powersgd=38, "
                   "powersgd:rank=2=41); full= (or ddp=) required; MS alone is full=MS")
AMP_CHOICES = ("none", "bf16", "fp16")


def parse_compute_ms(value: str | float) -> dict[str, float]:
    """``--compute-ms`` as ``{key: ms}``, key ``full``, ``factorized`` or a bench method's
    canonical name (an entry's key is everything before its last ``=``: ``powersgd:rank=2=41``);
    the old forms (``MS``, ``full=MS``, ``full=MS,factorized=MS``) keep their meaning. ``ValueError``
    (one line) names the value and :data:`COMPUTE_MS_FORM`. How the projection uses each figure,
    and where it falls back to this CPU's ratios: :func:`~pufferfish.bench.projection.with_compute`.
    """
    bad = ValueError(f"--compute-ms {str(value)!r} is invalid: allowed {COMPUTE_MS_FORM}")
    if isinstance(value, bool):
        raise bad
    text = str(value).strip()
    found: dict[str, float] = {}
    for item in (text.split(",") if "=" in text else [f"full={text}"]):
        key, _, ms = (x.strip() for x in item.rpartition("="))
        try:
            number = float(ms)
            key = key if key in ("full", "factorized") else MethodSpec.parse(key).name
        except ValueError:
            raise bad from None
        if key in found or not 0 < number < math.inf:
            raise bad
        found[key] = number
    if "full" not in found and "ddp" not in found:
        raise bad
    return found


# The option groups it shares with `pufferfish train` (the same fields, help and defaults, but a
# narrower network by default); its own checks, in terms of its flags and Fashion-MNIST's sizes.
@dataclass
@with_option_fields(after="vocab_size", defaults=HOOK_DEFAULTS, options=HOOK_OPTIONS)
@override_defaults(width=0.5)
class BenchConfig(SubsetOptions, BatchOptions, ModelOptions):
    """Everything ``pufferfish bench`` needs; :meth:`validate` gives one-line errors."""

    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    parallel: str = "ddp"  # fsdp: --methods ddp,pufferfish measured as fsdp,pufferfish+fsdp
    bandwidths: list[str] = field(default_factory=lambda: ["loopback"])
    workers: int = 2
    torchrun: bool = False  # measured inside torchrun's processes, over their link (launched.py)
    steps: int = 20
    warmup: int = 3
    compute_steps: int = 5
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
    amp: str = "none"  # autocast of the timed steps: bf16, or fp16 with a GradScaler
    bucket_mb: str = "auto"  # DDP bucket cap (MiB), torch's default, or each method's fastest
    timeout: float = 0.0  # 0: STEP_TIMEOUT per step group, no limit per training run
    out: str = ""  # "": a new runs/bench-<date-time> (runner._hold_out)
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
    lr: float = 0.1
    inner_steps: int = 50  # DiLoCo methods: optimizer steps between synchronizations
    # factorized methods' rank ratio; None: the paper's 0.25 (a user's Workload: its rank_ratio)
    rank_ratio: float | None = None
    train_config: str = ""  # a `pufferfish train` TOML for every other option of the runs

    def validate(self) -> None:
        """Check every value before any process starts (``ValueError``: CLI exit 2)."""
        if is_user_model(self.model):
            self._validate_user_model()
        else:
            self._validate_spec_model()
        self._validate_methods()
        self._validate_fsdp()
        if self.torchrun:
            self._validate_torchrun()
        else:
            self._validate_links()
        for option in HOOK_OPTIONS:
            option.check(getattr(self, option.key))
        if self.rank_ratio is not None and not 0 < self.rank_ratio <= 1:
            raise ValueError(f"rank_ratio {self.rank_ratio!r} is invalid: allowed a number in "
                             "(0, 1]")
        for name in ("steps", "compute_steps", "batch_size", "epochs", "rounds", "inner_steps",
                     "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 1")
        if self.width <= 0:
            raise ValueError(f"width {self.width!r} is invalid: allowed > 0")
        self._validate_grad_accum()
        parse_bucket_mb(self.bucket_mb)
        self._validate_amp()
        self._validate_powersgd()
        if self.warmup < 2:
            raise ValueError(f"warmup {self.warmup} is invalid: allowed >= 2 (DDP rebuilds its "
                             "buckets after its first step, which must not be timed)")
        SubsetOptions.check_group(self)  # >= 0, as `pufferfish train` checks them
        for name in ("threads", "warmup_epochs", "alpha", "timeout"):
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
        if not self.from_results and not is_user_model(self.model) and not is_lm(self.model) \
                and not data.is_dir():
            raise ValueError(
                f"Fashion-MNIST directory {str(data)!r} does not exist: install the Debian "
                "package dataset-fashion-mnist or pass --data-dir"
            )

    def _validate_powersgd(self) -> None:
        """PowerSGD's start step, global and each variant's: after DDP re-buckets, and within
        the warm-up, so that the timed steps compress."""
        starts = [self.powersgd_start_iter] + [
            self.settings_of(m).powersgd_start_iter for m in self.methods
            if hook_for(m)[1] == "powersgd"]
        start = next((s for s in starts if s < 2), None)
        if start is not None:
            raise ValueError(
                f"powersgd_start_iter {start} is invalid: allowed >= 2 "
                "(DDP re-buckets after step 1, and PowerSGD's memory must follow)"
            )
        # --train times no step: its runs start compressing at the step given, as `train` does
        if not self.train and len(starts) > 1 and self.warmup < max(starts[1:]):
            raise ValueError(
                f"warmup {self.warmup} is invalid: allowed >= powersgd_start_iter "
                f"({max(starts[1:])}), so that timed PowerSGD steps compress"
            )

    def settings_of(self, method: str) -> BenchConfig:
        """This configuration as ``method`` runs it: its own settings (``powersgd:rank=2``) over
        the global flags."""
        return MethodSpec.parse(method).applied(self)

    def method_settings(self) -> dict[str, dict[str, Any]]:
        """Every method's settings as measured (its own over the global flags), for results.json:
        ``{"powersgd:rank=1": {"powersgd_rank": 1, "powersgd_start_iter": 2}, ...}``; a rank ratio
        of None is the user's Workload's own."""
        out: dict[str, dict[str, Any]] = {}
        for m in self.methods:
            mine = self.settings_of(m)
            keys = [s.flat for s in setting_keys(base_of(m)).values()]
            out[m] = {k: rank_ratio_of(mine) if k == "rank_ratio" else getattr(mine, k)
                      for k in keys}
        return out

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

    def _validate_spec_model(self) -> None:
        """A model spec (ours, or ``PATH.py:NAME`` of the user's ``ModelSpec``): it exists, and
        only an image model trains for ``--train`` / ``--accuracy-runs``."""
        try:
            lm = is_lm(self.model)
        except ValueError:
            raise ValueError(
                f"model {self.model!r} is invalid for the benchmark: allowed "
                f"{', '.join(model_names())}, or your own: PATH.py:NAME (a ModelSpec), "
                "PATH.py:FUNC, package.module:FUNC, hf:CONFIG.json"
            ) from None
        if lm and (self.train or self.accuracy_runs):
            raise ValueError(f"model {self.model!r}: --train and --accuracy-runs are for the "
                             f"image models ({', '.join(image_models())}); step times only")

    def _validate_user_model(self) -> None:
        """``--model PATH.py:FUNC`` (or ``module:FUNC``, ``hf:CONFIG.json``): it loads, keeps the
        Workload contract, and Pufferfish finds layers to factorize if a method needs them; the
        methods and modes that need one of our models are refused."""
        if self.train or self.accuracy_runs:
            raise ValueError(f"--model {self.model!r}: --train and --accuracy-runs train our "
                             f"models ({', '.join(image_models())}); your model: step times only")
        for m in self.methods:
            if base_of(m) == "galore" or base_of(m) in FSDP_METHODS:
                raise ValueError(f"method {m!r} is invalid with your model {self.model!r}: "
                                 "allowed the DDP and DiLoCo methods")
        if self.from_results:
            return  # measured before: nothing is built
        factorized = [m for m in self.methods if hook_for(m)[0]]
        check_workload(self.model, self.seq_len, bool(factorized),
                       [rank_ratio_of(self.settings_of(m)) for m in factorized])

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
    def _validate_amp(self) -> None:
        """``--amp``: a known precision, and none that a method cannot take."""
        if self.amp not in AMP_CHOICES:
            raise ValueError(f"--amp {self.amp!r} is invalid: allowed {', '.join(AMP_CHOICES)}")
        if self.amp == "fp16" and "signum" in map(base_of, self.methods):
            raise ValueError("--amp fp16 is invalid with method 'signum' (its +-1 votes ignore "
                             "the GradScaler's loss scale): allowed --amp bf16 or none")
        if self.amp == "bf16" and torch.cuda.is_available() \
                and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ValueError(f"--amp bf16 is invalid on {torch.cuda.get_device_name()} (no bf16 "
                             "kernels before compute capability 8.0: emulated, its times would "
                             "not be bf16's): allowed --amp fp16 or none")
        sharded = [m for m in self.methods if base_of(m) in FSDP_METHODS]
        if self.amp != "none" and sharded:
            raise ValueError(f"--amp {self.amp} is invalid with {sharded[0]} (the FSDP2 bench "
                             "times full precision): allowed --amp none")

    def _validate_methods(self) -> None:
        """``--methods``: known, with settings their methods take (names made canonical), each
        once, and compared with one optimizer per workload."""
        if not self.methods:
            raise ValueError("--methods is empty: allowed a comma-separated list of "
                             + ", ".join(BENCH_METHODS))
        given = list(self.methods)
        self.methods = [MethodSpec.parse(m).name for m in given]
        for m in self.methods:
            if self.methods.count(m) > 1:
                twice = [t for t, n in zip(given, self.methods, strict=True) if n == m]
                raise ValueError(f"--methods {','.join(given)!r} names method {m!r} twice"
                                 + (f" ({' and '.join(twice)})" if len(set(twice)) > 1 else "")
                                 + ": allowed each method (with its settings) once")
        if "galore" in map(base_of, self.methods) and (is_user_model(self.model)
                                         or optimizer_name(self.model) != "adamw"):
            raise ValueError(f"method 'galore' is invalid with model {self.model!r}: GaLore's "
                             "AdamW would race the image models' SGD; allowed with "
                             f"{', '.join(adamw_models())} (every method there steps with "
                             "AdamW)")

    def _validate_fsdp(self) -> None:
        """``--parallel`` and the FSDP2 methods: what ``pufferfish train --parallel fsdp``
        refuses is refused here, before any worker starts."""
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"--parallel {self.parallel!r} is invalid: allowed ddp, fsdp")
        if self.parallel == "fsdp":
            parallel_methods(self.methods, "fsdp")  # every method has an FSDP2 version
        sharded = [m for m in self.methods if base_of(m) in FSDP_METHODS]
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
                                      inner_steps=self.inner_steps,
                                      rank_ratio=rank_ratio_of(self))

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


def parallel_methods(methods: list[str], parallel: str) -> list[str]:
    """The methods ``--methods`` names under ``--parallel``: with ``fsdp``, ddp and pufferfish
    become their FSDP2 versions; any other method is refused (``ValueError``, one line)."""
    if parallel != "fsdp":
        return list(methods)
    out = []
    for m in methods:
        base = base_of(m)
        if base not in FSDP_METHODS and base not in FSDP_VERSIONS:
            raise ValueError(
                f"method {m!r} is invalid with --parallel fsdp: allowed "
                f"{', '.join(FSDP_VERSIONS)} (measured as {', '.join(FSDP_VERSIONS.values())}), "
                "or --parallel ddp")
        out.append(m if base in FSDP_METHODS else
                   MethodSpec.parse(m).with_base(FSDP_VERSIONS[base]).name)
    return out


# Settings that describe a measurement, taken from the results when reused.
_MEASURED = ("model", "width", "methods", "parallel", "bandwidths", "workers", "steps", "warmup",
             "compute_steps", "batch_size", "grad_accum", *(option.key for option in HOOK_OPTIONS), "threads",
             "rounds", "channels_last", "compile", "amp", "bucket_mb", "inner_steps", "rank_ratio", "seq_len",
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


def measured_config(path: str) -> dict[str, Any]:
    # Older results: NCHW, eager, torch's default buckets.
    saved = {"channels_last": False, "compile": False, "amp": "none", "bucket_mb": "torch",
             "parallel": "ddp",
             **load_results(path)["config"]}
    return {k: saved[k] for k in _MEASURED if k in saved}
