"""All training configuration in one place: one dataclass, TOML files, command-line overrides.

Every field of :class:`TrainConfig` is a TOML key and a ``--flag`` (underscores become dashes), so a
shipped config file is just a set of overrides of these defaults. The fields come by concern from
the option groups of :mod:`pufferfish.options` (data, model, method, switch, optimizer, ...), each
checking its own; here are the checks across groups and the values derived from several, with
one-line errors that name the bad value and what is allowed. Reading and writing them (TOML,
flag strings, the shipped configs) is :mod:`pufferfish.configfile`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .data.bpe import MIN_VOCAB
from .models import get_spec, model_names
from .options import (
    GROUPS,
    HOOK_OPTIONS,
    BaselineOptions,
    BatchOptions,
    ConfigError,
    DataOptions,
    DistributedOptions,
    LMOptions,
    MethodOptions,
    ModelOptions,
    OptimizerOptions,
    RunOptions,
    SubsetOptions,
    SwitchOptions,
    TrainingOptions,
    group_choices,
)
from .options.checks import as_float as _float
from .options.checks import as_int as _int

__all__ = ["HOOK_OPTIONS", "ConfigError", "TrainConfig", "choices"]

WARMUP_ALLOWED = "an integer >= 0, a percentage of the epochs such as '10%', or 'auto'"
# The bases in reverse: a dataclass takes its bases' fields from the last base to the first, so
# the fields (--help, config.toml) come in the order of options.GROUPS.
@dataclass
class TrainConfig(RunOptions, DistributedOptions, LMOptions, OptimizerOptions, TrainingOptions,
                  BatchOptions, BaselineOptions, SwitchOptions, MethodOptions, SubsetOptions,
                  DataOptions, ModelOptions):
    """Every training option (the groups' fields), checked as a whole: each group's own checks,
    then those across groups; the values derived from several groups."""

    def __post_init__(self) -> None:
        self.validate()

    # -- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        self._validate_model()
        for group in GROUPS:  # each group's own fields
            group.check_group(self)
        if self.parallel == "fsdp":
            self._check_fsdp()
        if self.warmup_epochs.endswith("%"):
            pct = _float("warmup_epochs", self.warmup_epochs[:-1], WARMUP_ALLOWED)
            if not 0 <= pct < 100:
                raise ConfigError(f"warmup_epochs {self.warmup_epochs!r} is invalid: allowed "
                                  "0% <= P% < 100%")
        elif self.warmup_epochs != "auto":
            w = _int("warmup_epochs", self.warmup_epochs, WARMUP_ALLOWED)
            if self.mode == "pufferfish" and not self.warmup_steps and not 0 <= w < self.epochs:
                raise ConfigError(f"warmup_epochs {w} is invalid with epochs {self.epochs}: "
                                  f"allowed 0 <= warmup_epochs < epochs, or 'auto'")
        if self.warmup_epochs == "auto" and self.mode == "pufferfish":
            lo, hi = self.min_warmup_epochs, self.max_warmup_epochs
            if not 0 <= lo <= (hi if hi > 0 else self.epochs - 1) < self.epochs:
                shown = hi if hi > 0 else f"0 (the default cap, at most {self.epochs - 1})"
                raise ConfigError(f"min_warmup_epochs {lo} / max_warmup_epochs {shown} are invalid "
                                  f"with epochs {self.epochs}: allowed 0 <= min <= max < epochs")
        self._validate_baselines()
        self._validate_optimizer()
        self._validate_sync()

    def _validate_model(self) -> None:
        """``model`` registered (or a ``PATH.py:NAME`` spec), then its spec's own check; the
        packed LMs' byte-level BPE vocabulary (the corpus checks its own limit)."""
        try:
            spec = get_spec(self.model)
            if spec.check is not None:
                spec.check(self)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if spec.task == "lm-packed" and self.vocab_size < MIN_VOCAB:
            raise ConfigError(f"vocab_size {self.vocab_size} is too small for a byte-level BPE: "
                              f"allowed >= {MIN_VOCAB} (256 bytes and <|endoftext|>)")

    def _validate_optimizer(self) -> None:
        """The switch in steps with the mode, GaLore's rank (each key's own check is its group's)."""
        w = self.warmup_steps
        if w and self.warmup_epochs == "auto" and self.mode == "pufferfish":
            raise ConfigError("warmup_steps is invalid with warmup_epochs 'auto': allowed one "
                              "of them")
        if self.mode == "galore" and self.rank_ratio == "auto":
            raise ConfigError("rank_ratio 'auto' is invalid with mode 'galore': allowed a "
                              "number in (0, 1]")

    def _validate_baselines(self) -> None:
        """The ``lth``/``prune`` keys with the model and the epochs (see :mod:`pufferfish.baselines`)."""
        if self.mode in ("lth", "prune") and self.is_lm:
            images = (n for n in model_names() if not get_spec(n).is_lm)
            raise ConfigError(f"mode {self.mode!r} is invalid with model {self.model!r}: "
                              f"allowed {', '.join(images)}")
        if self.mode == "lth" and self.rewind_epoch >= self.epochs:
            raise ConfigError(f"rewind_epoch {self.rewind_epoch} is invalid with epochs "
                              f"{self.epochs}: allowed 0 <= rewind_epoch < epochs")
        if self.mode == "prune" and not -1 <= self.prune_epoch < self.epochs:
            raise ConfigError(f"prune_epoch {self.prune_epoch} is invalid with epochs "
                              f"{self.epochs}: allowed 0 <= prune_epoch < epochs, or -1")

    def _validate_sync(self) -> None:
        """DiLoCo's outer steps with the checkpoints (its own keys: DistributedOptions)."""
        if self.sync != "diloco":
            return
        if self.checkpoint_every_steps % self.inner_steps:
            raise ConfigError(f"checkpoint_every_steps {self.checkpoint_every_steps} is invalid "
                              f"with sync 'diloco' and inner_steps {self.inner_steps} (checkpoints "
                              "fall on outer steps): allowed a multiple of inner_steps, or 0")
    def _check_fsdp(self) -> None:
        """What FSDP2 runs here: comm hooks are DDP's; automatic choices and projected momentum
        read dense weights of every layer at once, which a sharded model does not hold."""
        if self.comm != "allreduce":
            raise ConfigError(f"comm {self.comm!r} is invalid with parallel 'fsdp' (comm hooks are "
                              "DDP's; FSDP2 all-gathers and reduce-scatters): allowed allreduce")
        if self.mode not in ("full", "pufferfish", "lowrank"):
            raise ConfigError(f"mode {self.mode!r} is invalid with parallel 'fsdp': allowed full, "
                              "pufferfish, lowrank")
        for name, value in (("rank_ratio", self.rank_ratio), ("warmup_epochs", self.warmup_epochs),
                            ("keep", "auto" if self.keep_auto else "")):
            if value == "auto":
                raise ConfigError(f"{name} 'auto' is invalid with parallel 'fsdp' (it reads every "
                                  "layer's dense weights): allowed a fixed value")
        if self.switch_momentum == "project":
            raise ConfigError(f"switch_momentum {self.switch_momentum!r} is invalid with parallel "
                              "'fsdp': allowed reset, auto")
        if self.sync == "diloco" and self.outer_switch_momentum != "reset":
            raise ConfigError(f"outer_switch_momentum {self.outer_switch_momentum!r} is invalid "
                              "with parallel 'fsdp' (projecting reads every layer's dense "
                              "weights): allowed reset")
        if self.compile:
            raise ConfigError("compile true is invalid with parallel 'fsdp' (not tested through "
                              "the re-sharding at the switch): allowed --no-compile")

    # -- derived values ------------------------------------------------------------------
    @property
    def optimizer_name(self) -> str:
        """``optimizer`` with ``auto`` resolved by the model spec's defaults (else ``sgd``)."""
        if self.optimizer != "auto":
            return self.optimizer
        return get_spec(self.model).defaults.get("optimizer", "sgd")

    @property
    def ratio(self) -> float | str:
        return "auto" if self.rank_ratio == "auto" else float(self.rank_ratio)

    @property
    def keep_auto(self) -> bool:
        """``keep = ["auto"]``: profile each layer, keep those that factorizing does not help."""
        return self.keep == ["auto"]

    @property
    def is_lm(self) -> bool:
        return get_spec(self.model).is_lm

    def run_dir(self) -> Path:
        """``out``, or the name of a fresh directory for this run, so that two runs never share one:
        ``runs/<model>-<mode>-<date>-<time>``, or under torchrun ``...-<its run id>``, the same
        for every rank and every restart of the launch (so a restart resumes it)."""
        if self.out:
            return Path(self.out)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id != "none":
            return Path(f"runs/{get_spec(self.model).name}-{self.mode}-{run_id.split('-')[0]}")
        if self.resume == "auto":
            raise ConfigError("resume 'auto' continues the run in --out: allowed with --out "
                              "(without it every run gets a fresh directory)")
        # The name only: the run makes it with one atomic mkdir, or the next free -N
        # (training/rundir.py: two runs started in the same second get one each).
        name = get_spec(self.model).name  # a PATH.py:NAME reference's spec name, not its path
        return Path(f"runs/{name}-{self.mode}-{time.strftime('%Y%m%d-%H%M%S')}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choices() -> dict[str, tuple[str, ...]]:
    """The fields that take one of a list of names, and the names (checks and ``--help``)."""
    found = {"model": model_names()}
    for group in GROUPS:
        found.update(group_choices(group))
    return found
