"""All training configuration in one place: one dataclass, TOML files, command-line overrides.

Every field of :class:`TrainConfig` is a TOML key and a ``--flag`` (underscores become dashes), so a
shipped config file is just a set of overrides of these defaults. Values are checked once, here,
with one-line errors that name the bad value and what is allowed. Reading and writing them (TOML,
flag strings, the shipped configs) is :mod:`pufferfish.configfile`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data.bpe import MIN_VOCAB
from .distributed.buckets import parse_bucket_mb
from .distributed.hooks import all_hook_options, hook_names, with_option_fields
from .models import get_spec, model_names
from .modes import mode_names

__all__ = ["ConfigError", "TrainConfig", "choices"]

WARMUP_ALLOWED = "an integer >= 0, a percentage of the epochs such as '20%', or 'auto'"
SCHEDULES = ("multistep", "cosine", "constant")
NONFINITE = ("stop", "skip")
SWITCH_MOMENTUM = ("reset", "project")  # DiLoCo's outer momentum at the switch
# The inner optimizer's state at the switch. auto: SGD's momentum reset (the paper; the image
# models' recipe unchanged); Adam's moments reset, and after the LR warm-up the LR re-warmed over
# AUTO_SWITCH_LR_WARMUP of the run (ReLoRA's pairing): fresh moments come from the factors' own
# gradients, not the dense weights' stale second moment, and take small steps until they have
# averaged a few (docs/benchmarks.md, "Where the switch's cost comes from").
SWITCH_STATE = ("auto", "reset", "project")
AUTO_SWITCH_LR_WARMUP = 0.05
OPTIMIZERS = ("auto", "sgd", "adamw")
GALORE_PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")
SYNCS = ("ddp", "diloco")
PARALLEL = ("ddp", "fsdp")
# auto: each layer's fastest kernel, timed at the switch; a name: that kernel wherever a layer has it
KERNELS = ("auto", "fused", "loop")
LOGGERS = ("none", "tensorboard")  # training/board.py
# The automatic switch's default cap (max_warmup_epochs 0): a tenth of the run, the paper's warm-up,
# but at least this many optimizer steps, which the short-run grids needed (docs/benchmarks.md).
CAP_FRACTION, CAP_MIN_STEPS = 0.1, 150  # the optimizer state of the factors at the switch
# The comm hooks' options (powersgd_rank, topk_ratio, ...) are fields placed after ``comm``,
# with their defaults and allowed values from the hook registry (pufferfish.distributed.hooks).
HOOK_OPTIONS = all_hook_options()


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line naming it."""


@dataclass
@with_option_fields(after="comm", options=HOOK_OPTIONS)
class TrainConfig:
    # What to train
    model: str = "resnet18"  # the network: the paper's models, llama (the tokenizers package: the [lm] extra), or your pufferfish.models.ModelSpec as PATH.py:NAME; `pufferfish factorize --model NAME` shows one
    width: float = 1.0  # channel multiplier (images) / size multiplier of the paper's dims (LMs)
    data: str = "fashion-mnist"  # fashion-mnist, cifar10, kjv, or a path to a UTF-8 text file
    data_dir: str = ""  # directory of the dataset's files (empty: the dataset's default)
    cache_dir: str = ""  # derived files (the BPE tokenizer and token streams; empty: $XDG_CACHE_HOME/pufferfish or ~/.cache/pufferfish), never beside your data
    download: bool = False  # fetch missing dataset files from their official URLs
    val_subset: int = 5000  # images: hold out N training images (a fixed draw, the same for every seed and mode) as the validation split choices are made on (0: none)
    train_subset: int = 0  # use only the first N training examples (0: all; images: all not held out by val_subset)
    test_subset: int = 0  # evaluate only the first N examples of the validation and test splits (0: all)
    # The method
    mode: str = "pufferfish"  # full, pufferfish (warm-up, then factorize), lowrank (from step 0), galore, lth, prune
    warmup_epochs: str = "20%"  # full-rank epochs before the switch: N, P% of the epochs, or auto
    min_warmup_epochs: int = 1  # warmup_epochs auto: never switch before this epoch
    max_warmup_epochs: int = 0  # warmup_epochs auto: switch here at the latest (0: a tenth of the run, >= 150 steps)
    switch_threshold: float = 0.05  # warmup_epochs auto: "settled" = stable ranks move less per epoch
    switch_window: float = 1.0  # warmup_epochs auto: epochs over which that change is averaged
    stable_rank_every_steps: int = 0  # warmup_epochs auto: observe every N steps (0: 4 per epoch)
    rank_ratio: str = "0.25"  # rank as a fraction of each layer's full rank, or "auto"
    max_rank_ratio: float = 0.25  # rank_ratio auto: at most this fraction of full rank (1: no cap)
    preset: str = "paper"  # the model's preset of full-rank layers ("none": no preset)
    keep: list[str] = field(default_factory=list)  # extra globs of layers kept full-rank, or auto
    keep_first: int = 0  # also keep the first K factorizable layers full-rank
    extra_bn: bool = False  # BatchNorm between the two factors of each conv
    kernel: str = "auto"  # low-rank layers with several kernels (the LSTM's): auto (the fastest, timed at the switch), fused or loop
    frobenius_decay: float = 0.0  # λ of Frobenius decay on low-rank layers (0: plain weight decay)
    switch_momentum: str = "auto"  # the optimizer state at the switch: reset (the paper), project onto the factors, or auto (SGD: reset; AdamW: reset with an LR re-warm-up)
    warmup_steps: float = 0.0  # switch before optimizer step N, or this fraction of the run if < 1 (0: off)
    switch_lr_warmup: float = 0.0  # after the switch, the LR ramps up again over N steps, or this fraction of the run if < 1 (ReLoRA's re-warm-up; 0: off, or switch_momentum auto's)
    galore_update_proj_gap: int = 200  # galore: optimizer steps between the projectors' SVDs
    galore_scale: float = 0.25  # galore: scale of the update projected back (the paper's 0.25)
    galore_proj_type: str = "std"  # galore: std, reverse_std, right, left, full
    # Baselines (pufferfish.baselines): lth = lottery ticket, prune = network slimming
    target_params: int = 0  # lth/prune: total parameter count to reach (0: by rounds/prune_ratio)
    rounds: int = 0  # lth: pruning rounds L, each retrained `epochs` (0: what target needs, else 3)
    prune_rate: float = 0.2  # lth: fraction of the remaining prunable weights cut per round
    rewind_epoch: int = 0  # lth: rewind to the weights after this epoch of round 0 (0: init)
    lth_exclude: list[str] = field(default_factory=list)  # lth: never pruned (empty: output layer)
    prune_ratio: float = 0.5  # prune: fraction of the BatchNorm'd channels removed
    prune_epoch: int = -1  # prune: epoch at whose start channels are cut (-1: epochs // 2)
    slim_l1: float = 1e-4  # prune: L1 penalty on BatchNorm scales before the cut
    # Optimisation
    epochs: int = 10  # passes over the training data
    batch_size: int = 128  # examples per step (per micro-batch with grad_accum), per process
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step (one gradient sync each)
    eval_batch_size: int = 512  # examples per forward pass when testing
    optimizer: str = "auto"  # sgd, adamw (auto: adamw for llama, else sgd)
    lr: float = 0.1  # learning rate (after the LR warm-up; llama: 1e-2 x 0.125 / width, chosen on validation at width 0.125 only, other widths scaled as 1/width, not measured)
    momentum: float = 0.9  # SGD momentum (0: none)
    nesterov: bool = False  # Nesterov momentum
    weight_decay: float = 1e-4  # weight decay (SGD: L2; AdamW: decoupled, not on norms/biases/embeddings)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw, galore: beta1, beta2
    adam_eps: float = 1e-8  # adamw, galore: epsilon
    schedule: str = "multistep"  # learning rate: multistep (x0.1 at milestones), cosine, constant
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])  # multistep: LR x0.1 at these fractions of the epochs
    lr_warmup_epochs: float = 0.0  # linear LR warm-up from 0
    grad_clip: float = 0.0  # max gradient norm (0: off); the LM recipe uses 0.25
    amp: bool = False  # bf16 autocast on CPU, fp16 autocast + GradScaler on CUDA
    nonfinite: str = "stop"  # on a non-finite loss/gradient: stop (named error) or skip the step
    seed: int = 0  # initial weights, data order and augmentation
    # Language models
    bptt: int = 35  # language models: tokens per training sequence
    max_vocab: int = 0  # keep the N-1 most frequent training words, map the rest to <unk> (0: all)
    dropout: float = 0.65  # language models: dropout probability
    seq_len: int = 256  # llama: tokens per packed sequence (the model's RoPE table is this long)
    vocab_size: int = 4096  # llama: tokens of the byte-level BPE trained on the corpus
    eval_every_steps: int = 0  # also evaluate every N optimizer steps (0: at epoch ends only)
    tokens_per_param: float = 0.0  # llama: train on N x the full-rank model's parameters in tokens, in the fewest passes <= --epochs (0: --epochs over --train-subset)
    # Distributed
    backend: str = "auto"  # process-group backend: auto is nccl on CUDA, gloo on CPU
    parallel: str = "ddp"  # ddp (replicas, comm hooks) or fsdp (FSDP2: weights, grads, optimizer state sharded)
    comm: str = "allreduce"  # DDP comm hook (gradient compression baselines; needs torchrun)
    # ... then one field per comm-hook option (see HOOK_OPTIONS)
    sync: str = "ddp"  # ddp (gradients every step) or diloco (weights every inner_steps steps)
    inner_steps: int = 50  # diloco: optimizer steps each worker takes alone between outer steps
    outer_lr: float = 0.7  # diloco: outer Nesterov SGD learning rate on the pseudo-gradients
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum, 0 <= m < 1
    outer_switch_momentum: str = "reset"  # diloco + pufferfish: outer momentum at the switch
    bn_batches: int = 8  # diloco: training batches per process that recompute the synchronized weights' BatchNorm statistics before an evaluation or checkpoint (0: the replicas' average)
    shard_size: int = 0  # fsdp + diloco: processes sharding one replica (0: LOCAL_WORLD_SIZE)
    timeout_s: float = 300.0  # process-group timeout: a vanished peer is an error after this
    bucket_mb: str = "auto"  # DDP gradient bucket cap in MiB, torch (1 MiB, then 25), or auto (timed)
    # Run directory and checkpoints
    out: str = ""  # run directory (empty: a fresh runs/<model>-<mode>-<date-time> per run)
    resume: str = ""  # run directory to continue, or "auto": continue --out if it has a checkpoint
    overwrite: bool = False  # a new run may replace the earlier run in --out (its files only)
    checkpoint_every_epochs: int = 1  # checkpoint every N epochs (0: only after the last one)
    checkpoint_every_steps: int = 0  # also checkpoint every N steps (0: only at epoch ends)
    keep_checkpoints: int = 3  # newest checkpoints kept; older ones are removed
    threads: int = 0  # torch intra-op threads per process (0: torch's default)
    channels_last: bool = True  # conv weights in NHWC memory order: faster conv kernels (CPU, GPU)
    progress: bool = True  # tqdm progress bar on rank 0
    verbose: bool = False  # print the whole configuration at the start (always in RUN_DIR/config.toml)
    logger: str = "none"  # also log to: none (metrics.jsonl/.csv only) or tensorboard (RUN_DIR/tb, rank 0)
    compile: bool = False  # torch.compile the model (compiled again once after the switch)
    compile_backend: str = "inductor"  # torch.compile backend (eager, aot_eager: for debugging)

    def __post_init__(self) -> None:
        self.validate()

    # -- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        self._validate_model()
        for name, allowed in choices().items():
            if name != "model":
                _choice(name, getattr(self, name), allowed)
        if self.parallel == "fsdp":
            self._check_fsdp()
        _positive("width", self.width)
        _positive("epochs", self.epochs)
        _positive("batch_size", self.batch_size)
        _positive("eval_batch_size", self.eval_batch_size)
        _positive("lr", self.lr)
        _positive("bptt", self.bptt)
        _positive("timeout_s", self.timeout_s)
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ConfigError(f"grad_accum {self.grad_accum!r} is invalid: allowed an integer >= 1 "
                              "(micro-batches per optimizer step)")
        for name in ("max_vocab", "train_subset", "val_subset", "test_subset", "keep_first",
                     "checkpoint_every_epochs", "checkpoint_every_steps", "threads",
                     "stable_rank_every_steps", "eval_every_steps", "bn_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 0")
        _positive("keep_checkpoints", self.keep_checkpoints)
        for name in ("weight_decay", "grad_clip", "lr_warmup_epochs", "frobenius_decay", "momentum",
                     "switch_threshold", "tokens_per_param", "switch_lr_warmup"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout {self.dropout!r} is invalid: allowed 0 <= dropout < 1")
        for option in HOOK_OPTIONS:
            try:
                option.check(getattr(self, option.key))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        try:
            parse_bucket_mb(self.bucket_mb)
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
            lo, hi = self.min_warmup_epochs, self.latest_auto_switch
            if not 0 <= lo <= hi < self.epochs:
                raise ConfigError(f"min_warmup_epochs {lo} / max_warmup_epochs {hi} are invalid "
                                  f"with epochs {self.epochs}: allowed 0 <= min <= max < epochs")
        _positive("switch_window", self.switch_window)
        if self.rank_ratio != "auto":
            r = _float("rank_ratio", self.rank_ratio, "a number in (0, 1] or 'auto'")
            if not 0 < r <= 1:
                raise ConfigError(f"rank_ratio {r} is out of range: allowed 0 < ratio <= 1 or 'auto'")
        if not 0 < self.max_rank_ratio <= 1:
            raise ConfigError(f"max_rank_ratio {self.max_rank_ratio!r} is out of range: "
                              "allowed 0 < ratio <= 1")
        if self.overwrite and self.resume == "auto":
            raise ConfigError("overwrite true is invalid with resume 'auto' (continue the run if "
                              "there is one): allowed one of them")
        self._validate_baselines()
        self._validate_optimizer()
        self._validate_sync()
        if sorted(self.milestones) != list(self.milestones) or not all(
                0 < m < 1 for m in self.milestones):
            raise ConfigError(f"milestones {self.milestones!r} are invalid: allowed increasing "
                              "fractions of the epochs, each in (0, 1)")

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
        """The AdamW/GaLore keys and the switch in steps."""
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"adam_betas {self.adam_betas!r} are invalid: allowed two numbers "
                              "in [0, 1), e.g. 0.9,0.999")
        _positive("adam_eps", self.adam_eps)
        _positive("galore_scale", self.galore_scale)
        _positive("galore_update_proj_gap", self.galore_update_proj_gap)
        w = self.warmup_steps
        if not (math.isfinite(w) and w >= 0 and (w < 1 or w == int(w))):
            raise ConfigError(f"warmup_steps {w!r} is invalid: allowed an integer number of "
                              "steps >= 1, a fraction of the run in (0, 1), or 0 (off)")
        if w and self.warmup_epochs == "auto" and self.mode == "pufferfish":
            raise ConfigError("warmup_steps is invalid with warmup_epochs 'auto': allowed one "
                              "of them")
        if self.mode == "galore" and self.rank_ratio == "auto":
            raise ConfigError("rank_ratio 'auto' is invalid with mode 'galore': allowed a "
                              "number in (0, 1]")

    def _validate_baselines(self) -> None:
        """The ``lth``/``prune`` keys (see :mod:`pufferfish.baselines`)."""
        for name in ("target_params", "rounds", "rewind_epoch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} {getattr(self, name)!r} is invalid: allowed >= 0")
        if not 0 < self.prune_rate < 1:
            raise ConfigError(f"prune_rate {self.prune_rate!r} is invalid: allowed 0 < rate < 1")
        if not 0 <= self.prune_ratio < 1:
            raise ConfigError(f"prune_ratio {self.prune_ratio!r} is invalid: allowed 0 <= ratio < 1")
        if not (self.slim_l1 >= 0 and math.isfinite(self.slim_l1)):
            raise ConfigError(f"slim_l1 {self.slim_l1!r} is invalid: allowed >= 0")
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
        """``sync`` and the DiLoCo keys (see :mod:`pufferfish.distributed.diloco`)."""
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) \
                or self.inner_steps < 1:
            raise ConfigError(f"inner_steps {self.inner_steps!r} is invalid: allowed an integer >= 1")
        _positive("outer_lr", self.outer_lr)
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum {self.outer_momentum!r} is invalid: allowed "
                              "0 <= outer_momentum < 1")
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) \
                or self.shard_size < 0:
            raise ConfigError(f"shard_size {self.shard_size!r} is invalid: allowed an integer >= 0")
        if self.shard_size and (self.sync != "diloco" or self.parallel != "fsdp"):
            raise ConfigError(f"shard_size {self.shard_size} is invalid without parallel 'fsdp' "
                              "and sync 'diloco' (it sizes the FSDP2 groups of DiLoCo's "
                              "replicas): allowed 0")
        if self.sync != "diloco":
            return
        if self.comm != "allreduce":
            raise ConfigError(f"comm {self.comm!r} is invalid with sync 'diloco' (no gradient is "
                              "sent per step, the pseudo-gradients are all-reduced): allowed "
                              "allreduce, or sync ddp")
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
    def switch_epoch(self) -> int | str:
        """``warmup_epochs`` parsed: the epoch the switch happens before, or ``"auto"``.

        ``P%`` is that share of the epochs rounded up, and always before the last epoch: the
        default 20% is the old default of 2 in a 10-epoch run, 1 in a 2-epoch run, and 0 (low
        rank from the start) in a 1-epoch try."""
        if self.warmup_epochs.endswith("%"):
            share = float(self.warmup_epochs[:-1]) / 100 * self.epochs
            return min(math.ceil(share - 1e-9), self.epochs - 1)
        return "auto" if self.warmup_epochs == "auto" else int(self.warmup_epochs)

    @property
    def latest_auto_switch(self) -> int:
        """The latest automatic switch epoch any run of this configuration may have:
        ``max_warmup_epochs``, or half the run (the bound of :meth:`auto_switch_cap`)."""
        if self.max_warmup_epochs > 0:
            return self.max_warmup_epochs
        return min(max(self.min_warmup_epochs, self.epochs // 2), max(0, self.epochs - 1))

    def auto_switch_cap(self, steps_per_epoch: int) -> int:
        """The latest automatic switch epoch of a run with ``steps_per_epoch`` steps per epoch.

        ``max_warmup_epochs`` when set; else the first epoch boundary after both a tenth of the
        run (the paper's warm-up) and ``CAP_MIN_STEPS`` optimizer steps, never after half the run.
        At a constant learning rate the stable ranks keep falling by ~10% per epoch until the
        first decay, so the cap, not the plateau test, decides most switches. Measured
        (docs/benchmarks.md, "auto"): on all of Fashion-MNIST (469 steps per epoch) the old cap at
        half the run switched later for no accuracy; in 8-epoch runs of 39 steps per epoch a
        switch after 1-2 epochs cost up to 3 points.
        """
        if self.max_warmup_epochs > 0:
            return self.max_warmup_epochs
        want = max(self.min_warmup_epochs, math.ceil(CAP_FRACTION * self.epochs - 1e-9),
                   math.ceil(CAP_MIN_STEPS / max(1, steps_per_epoch)))
        return min(want, self.latest_auto_switch)

    @property
    def optimizer_name(self) -> str:
        """``optimizer`` with ``auto`` resolved by the model spec's defaults (else ``sgd``)."""
        if self.optimizer != "auto":
            return self.optimizer
        return get_spec(self.model).defaults.get("optimizer", "sgd")

    @property
    def switch_state(self) -> str:
        """``switch_momentum`` with ``auto`` resolved: ``reset`` for every optimizer."""
        return "reset" if self.switch_momentum == "auto" else self.switch_momentum

    def switch_lr_rewarm(self, switch_step: int, steps_per_epoch: int) -> float:
        """The LR re-warm-up after a switch before global step ``switch_step``:
        ``switch_lr_warmup``, or, under ``switch_momentum`` auto with AdamW and none given,
        :data:`AUTO_SWITCH_LR_WARMUP` when the switch falls after the LR warm-up (inside it the
        schedule still ramps: a second ramp only slows the run, measured)."""
        if (self.switch_lr_warmup or self.switch_momentum != "auto"
                or self.optimizer_name != "adamw"
                or switch_step < round(self.lr_warmup_epochs * steps_per_epoch)):
            return self.switch_lr_warmup
        return AUTO_SWITCH_LR_WARMUP

    @property
    def warmup_share_in_steps(self) -> float:
        """``P%`` of a 1-epoch run, which no whole epoch matches: the switch is before that share
        of its optimizer steps instead of at the start (0.0: a switch in epochs, or no share)."""
        if self.epochs == 1 and self.warmup_epochs.endswith("%") and not self.warmup_steps:
            return float(self.warmup_epochs[:-1]) / 100
        return 0.0

    def switch_step(self, total_steps: int) -> int | None:
        """The optimizer step before which the switch happens (``warmup_steps``, or
        :attr:`warmup_share_in_steps`), or None. A fraction of the run is at least one step: a
        10% warm-up of a 4-step try trains one full-rank step, not none."""
        w = self.warmup_steps or self.warmup_share_in_steps
        if not w:
            return None
        return max(1, round(w * total_steps)) if w < 1 else int(w)

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
    return {"model": model_names(), "mode": tuple(mode_names()), "comm": tuple(hook_names()),
            "schedule": SCHEDULES, "backend": ("auto", "gloo", "nccl"), "nonfinite": NONFINITE,
            "switch_momentum": SWITCH_STATE, "optimizer": OPTIMIZERS,
            "galore_proj_type": GALORE_PROJ_TYPES, "sync": SYNCS,
            "outer_switch_momentum": SWITCH_MOMENTUM, "parallel": PARALLEL,
            "kernel": KERNELS, "logger": LOGGERS}


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} {value!r} is invalid: allowed {', '.join(allowed)}")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} {value!r} is invalid: allowed a number > 0")


def _int(name: str, value: str, allowed: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} {value!r} is invalid: allowed {allowed}") from None


def _float(name: str, value: str, allowed: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name} {value!r} is invalid: allowed {allowed}") from None
