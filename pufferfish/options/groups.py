"""The training options by concern: one dataclass per group, each with its fields (one line each:
``name: type = default  # help``, the help ``--help`` shows) and the checks that read only its own
fields. :class:`~pufferfish.config.TrainConfig` inherits them all (``cfg.lr`` as before) and adds
the checks across groups and the derived values; ``pufferfish bench``'s
:class:`~pufferfish.bench.config.BenchConfig` inherits the groups whose fields it shares.
A group's ``SECTION`` is its TOML table: ``[optim] lr = 0.05`` is ``lr = 0.05``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from ..distributed.buckets import parse_bucket_mb
from ..distributed.hooks import all_hook_options, hook_names, with_option_fields
from ..modes import mode_names
from .checks import ConfigError, OptionGroup, as_float, non_negative, positive

__all__ = ["GROUPS", "HOOK_OPTIONS", "BaselineOptions", "BatchOptions", "DataOptions",
           "DistributedOptions", "LMOptions", "MethodOptions", "ModelOptions", "OptimizerOptions",
           "RunOptions", "SubsetOptions", "SwitchOptions", "TrainingOptions"]

SCHEDULES = ("multistep", "cosine", "constant")
NONFINITE = ("stop", "skip")
SWITCH_MOMENTUM = ("reset", "project")  # DiLoCo's outer momentum at the switch
# The inner optimizer's state at the switch; what each value means, and when the switch happens:
# pufferfish/switch/schedule.py (the one home of both).
SWITCH_STATE = ("auto", "reset", "project")
OPTIMIZERS = ("auto", "sgd", "adamw")
GALORE_PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")
SYNCS = ("ddp", "diloco")
PARALLEL = ("ddp", "fsdp")
BACKENDS = ("auto", "gloo", "nccl")
# auto: each layer's fastest kernel, timed at the switch; a name: that kernel wherever a layer has it
KERNELS = ("auto", "fused", "loop")
LOGGERS = ("none", "tensorboard")  # training/board.py
# The comm hooks' options (powersgd_rank, topk_ratio, ...) are fields placed after ``comm``,
# with their defaults and allowed values from the hook registry (pufferfish.distributed.hooks).
HOOK_OPTIONS = all_hook_options()


@dataclass
class ModelOptions(OptionGroup):
    """The network and its size (its name is checked against the models by the configuration)."""

    SECTION: ClassVar[str] = "network"
    model: str = "resnet18"  # the network: the paper's models, llama (the tokenizers package: the [lm] extra), or your pufferfish.models.ModelSpec as PATH.py:NAME; `pufferfish factorize --model NAME` shows one
    width: float = 1.0  # channel multiplier (images) / size multiplier of the paper's dims (LMs)

    def check(self) -> None:
        positive("width", self.width)


@dataclass
class DataOptions(OptionGroup):
    """The dataset and where its files (and the files derived from them) are."""

    SECTION: ClassVar[str] = "dataset"
    data: str = "fashion-mnist"  # fashion-mnist, cifar10, kjv, or a path to a UTF-8 text file
    data_dir: str = ""  # directory of the dataset's files (empty: the dataset's default)
    cache_dir: str = ""  # derived files (the BPE tokenizer and token streams; empty: $XDG_CACHE_HOME/pufferfish or ~/.cache/pufferfish), never beside your data
    download: bool = False  # fetch missing dataset files from their official URLs


@dataclass
class SubsetOptions(OptionGroup):
    """How much of the dataset: the validation split held out, the examples trained and tested."""

    SECTION: ClassVar[str] = "dataset"
    val_subset: int = 5000  # images: hold out N training images (a fixed draw, the same for every seed and mode) as the validation split choices are made on (0: none)
    train_subset: int = 0  # use only the first N training examples (0: all; images: all not held out by val_subset)
    test_subset: int = 0  # evaluate only the first N examples of the validation and test splits (0: all)

    def check(self) -> None:
        non_negative(self, "train_subset", "val_subset", "test_subset")


@dataclass
class MethodOptions(OptionGroup):
    """The method (``--mode``) and what it factorizes: ranks, the layers kept full-rank, kernels."""

    SECTION: ClassVar[str] = "method"
    CHOICES: ClassVar = {"mode": mode_names, "kernel": KERNELS}
    mode: str = "pufferfish"  # full, pufferfish (warm-up, then factorize), lowrank (from step 0), galore, lth, prune
    rank_ratio: str = "0.25"  # rank as a fraction of each layer's full rank, or "auto"
    max_rank_ratio: float = 0.25  # rank_ratio auto: at most this fraction of full rank (1: no cap)
    preset: str = "paper"  # the model's preset of full-rank layers ("none": no preset)
    keep: list[str] = field(default_factory=list)  # extra globs of layers kept full-rank, or auto
    keep_first: int = 0  # also keep the first K factorizable layers full-rank
    extra_bn: bool = False  # BatchNorm between the two factors of each conv
    kernel: str = "auto"  # low-rank layers with several kernels (the LSTM's): auto (the fastest, timed at the switch), fused or loop
    frobenius_decay: float = 0.0  # λ of Frobenius decay on low-rank layers (0: plain weight decay)

    def check(self) -> None:
        non_negative(self, "keep_first")
        non_negative(self, "frobenius_decay", finite=True)
        if self.rank_ratio != "auto":
            r = as_float("rank_ratio", self.rank_ratio, "a number in (0, 1] or 'auto'")
            if not 0 < r <= 1:
                raise ConfigError(f"rank_ratio {r} is out of range: allowed 0 < ratio <= 1 or 'auto'")
        if not 0 < self.max_rank_ratio <= 1:
            raise ConfigError(f"max_rank_ratio {self.max_rank_ratio!r} is out of range: "
                              "allowed 0 < ratio <= 1")


@dataclass
class SwitchOptions(OptionGroup):
    """When Pufferfish switches to low rank, and the optimizer state and LR after the switch
    (the warm-up's checks against the epochs and the mode are the configuration's)."""

    SECTION: ClassVar[str] = "switch"
    CHOICES: ClassVar = {"switch_momentum": SWITCH_STATE}
    # 10%: the share every image claim ran (2 of 20 epochs), docs/benchmarks.md
    warmup_epochs: str = "10%"  # full-rank epochs before the switch: N, P% of the epochs, or auto
    min_warmup_epochs: int = 1  # warmup_epochs auto: never switch before this epoch
    max_warmup_epochs: int = 0  # warmup_epochs auto: switch here at the latest (0: a tenth of the run, >= 150 steps)
    switch_threshold: float = 0.05  # warmup_epochs auto: "settled" = stable ranks move less per epoch
    switch_window: float = 1.0  # warmup_epochs auto: epochs over which that change is averaged
    stable_rank_every_steps: int = 0  # warmup_epochs auto: observe every N steps (0: 4 per epoch)
    switch_momentum: str = "auto"  # the optimizer state at the switch: reset (the paper), project onto the factors, or auto (SGD: reset; AdamW: reset with an LR re-warm-up)
    warmup_steps: float = 0.0  # switch before optimizer step N, or this fraction of the run if < 1 (0: off)
    switch_lr_warmup: float = 0.0  # after the switch, the LR ramps up again over N steps, or this fraction of the run if < 1 (ReLoRA's re-warm-up; 0: off, or switch_momentum auto's)

    def check(self) -> None:
        non_negative(self, "stable_rank_every_steps")
        non_negative(self, "switch_threshold", "switch_lr_warmup", finite=True)
        positive("switch_window", self.switch_window)
        w = self.warmup_steps
        if not (math.isfinite(w) and w >= 0 and (w < 1 or w == int(w))):
            raise ConfigError(f"warmup_steps {w!r} is invalid: allowed an integer number of "
                              "steps >= 1, a fraction of the run in (0, 1), or 0 (off)")


@dataclass
class BaselineOptions(OptionGroup):
    """The other methods' keys: GaLore, Lottery Ticket (lth), network slimming (prune)."""

    SECTION: ClassVar[str] = "baselines"
    CHOICES: ClassVar = {"galore_proj_type": GALORE_PROJ_TYPES}
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

    def check(self) -> None:
        positive("galore_scale", self.galore_scale)
        positive("galore_update_proj_gap", self.galore_update_proj_gap)
        non_negative(self, "target_params", "rounds", "rewind_epoch")
        if not 0 < self.prune_rate < 1:
            raise ConfigError(f"prune_rate {self.prune_rate!r} is invalid: allowed 0 < rate < 1")
        if not 0 <= self.prune_ratio < 1:
            raise ConfigError(f"prune_ratio {self.prune_ratio!r} is invalid: allowed 0 <= ratio < 1")
        if not (self.slim_l1 >= 0 and math.isfinite(self.slim_l1)):
            raise ConfigError(f"slim_l1 {self.slim_l1!r} is invalid: allowed >= 0")


@dataclass
class BatchOptions(OptionGroup):
    """The batch of one step, per process."""

    SECTION: ClassVar[str] = "training"
    batch_size: int = 128  # examples per step (per micro-batch with grad_accum), per process
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step (one gradient sync each)

    def check(self) -> None:
        positive("batch_size", self.batch_size)
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ConfigError(f"grad_accum {self.grad_accum!r} is invalid: allowed an integer >= 1 "
                              "(micro-batches per optimizer step)")


@dataclass
class TrainingOptions(OptionGroup):
    """How long and how a run trains: epochs, the LR schedule, precision, non-finite steps, seed."""

    SECTION: ClassVar[str] = "training"
    CHOICES: ClassVar = {"schedule": SCHEDULES, "nonfinite": NONFINITE}
    epochs: int = 10  # passes over the training data
    eval_batch_size: int = 512  # examples per forward pass when testing
    schedule: str = "multistep"  # learning rate: multistep (x0.1 at milestones), cosine, constant
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])  # multistep: LR x0.1 at these fractions of the epochs
    lr_warmup_epochs: float = 0.0  # linear LR warm-up from 0
    amp: bool = False  # bf16 autocast on CPU, fp16 autocast + GradScaler on CUDA
    nonfinite: str = "stop"  # on a non-finite loss/gradient: stop (named error) or skip the step
    seed: int = 0  # initial weights, data order and augmentation

    def check(self) -> None:
        positive("epochs", self.epochs)
        positive("eval_batch_size", self.eval_batch_size)
        non_negative(self, "lr_warmup_epochs", finite=True)
        if sorted(self.milestones) != list(self.milestones) or not all(
                0 < m < 1 for m in self.milestones):
            raise ConfigError(f"milestones {self.milestones!r} are invalid: allowed increasing "
                              "fractions of the epochs, each in (0, 1)")


@dataclass
class OptimizerOptions(OptionGroup):
    """The optimizer and its hyperparameters (the LR schedule is :class:`TrainingOptions`')."""

    SECTION: ClassVar[str] = "optim"
    CHOICES: ClassVar = {"optimizer": OPTIMIZERS}
    optimizer: str = "auto"  # sgd, adamw (auto: adamw for llama, else sgd)
    lr: float = 0.1  # learning rate (after the LR warm-up; llama: a function of the width, see 'model defaults' below)
    momentum: float = 0.9  # SGD momentum (0: none)
    nesterov: bool = False  # Nesterov momentum
    weight_decay: float = 1e-4  # weight decay (SGD: L2; AdamW: decoupled, not on norms/biases/embeddings)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw, galore: beta1, beta2
    adam_eps: float = 1e-8  # adamw, galore: epsilon
    grad_clip: float = 0.0  # max gradient norm (0: off); the LM recipe uses 0.25

    def check(self) -> None:
        positive("lr", self.lr)
        non_negative(self, "weight_decay", "grad_clip", "momentum", finite=True)
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"adam_betas {self.adam_betas!r} are invalid: allowed two numbers "
                              "in [0, 1), e.g. 0.9,0.999")
        positive("adam_eps", self.adam_eps)


@dataclass
class LMOptions(OptionGroup):
    """The language models' keys: sequences, vocabulary, dropout, a budget in tokens (llama's
    context and vocabulary limits are checked with the model)."""

    SECTION: ClassVar[str] = "lm"
    bptt: int = 35  # language models: tokens per training sequence
    max_vocab: int = 0  # keep the N-1 most frequent training words, map the rest to <unk> (0: all)
    dropout: float = 0.65  # language models: dropout probability
    seq_len: int = 256  # llama: tokens per packed sequence (the model's RoPE table is this long)
    vocab_size: int = 4096  # llama: tokens of the byte-level BPE trained on the corpus
    eval_every_steps: int = 0  # also evaluate every N optimizer steps (0: at epoch ends only)
    tokens_per_param: float = 0.0  # llama: train on N x the full-rank model's parameters in tokens, in the fewest passes <= --epochs (0: --epochs over --train-subset)

    def check(self) -> None:
        positive("bptt", self.bptt)
        non_negative(self, "max_vocab", "eval_every_steps")
        non_negative(self, "tokens_per_param", finite=True)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout {self.dropout!r} is invalid: allowed 0 <= dropout < 1")


@dataclass
@with_option_fields(after="comm", options=HOOK_OPTIONS)
class DistributedOptions(OptionGroup):
    """The processes: backend, DDP or FSDP2, the comm hook and its options, DiLoCo, buckets."""

    SECTION: ClassVar[str] = "distributed"
    CHOICES: ClassVar = {"backend": BACKENDS, "parallel": PARALLEL, "comm": hook_names,
                         "sync": SYNCS, "outer_switch_momentum": SWITCH_MOMENTUM}
    backend: str = "auto"  # process-group backend: auto is nccl on CUDA, gloo on CPU
    parallel: str = "ddp"  # ddp (replicas, comm hooks) or fsdp (FSDP2: weights, grads, optimizer state sharded)
    comm: str = "allreduce"  # DDP comm hook (gradient compression baselines; needs torchrun)
    # ... then one field per comm-hook option (see HOOK_OPTIONS)
    sync: str = "ddp"  # ddp (gradients every step) or diloco (weights every inner_steps steps)
    inner_steps: int = 50  # diloco: optimizer steps each worker takes alone between outer steps (not tuned: the studies ran 5 to 100)
    outer_lr: float = 0.7  # diloco: outer Nesterov SGD learning rate on the pseudo-gradients
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum, 0 <= m < 1
    outer_switch_momentum: str = "reset"  # diloco + pufferfish: outer momentum at the switch
    bn_batches: int = 8  # diloco: training batches per process that recompute the synchronized weights' BatchNorm statistics before an evaluation or checkpoint (0: the replicas' average)
    shard_size: int = 0  # fsdp + diloco: processes sharding one replica (0: LOCAL_WORLD_SIZE)
    timeout_s: float = 300.0  # process-group timeout: a vanished peer is an error after this
    bucket_mb: str = "auto"  # DDP gradient bucket cap in MiB, torch (1 MiB, then 25), or auto (timed)

    def check(self) -> None:
        positive("timeout_s", self.timeout_s)
        non_negative(self, "bn_batches")
        for option in HOOK_OPTIONS:
            try:
                option.check(getattr(self, option.key))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        try:
            parse_bucket_mb(self.bucket_mb)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # sync and the DiLoCo keys (see pufferfish.distributed.diloco)
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) \
                or self.inner_steps < 1:
            raise ConfigError(f"inner_steps {self.inner_steps!r} is invalid: allowed an integer >= 1")
        positive("outer_lr", self.outer_lr)
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
        if self.sync == "diloco" and self.comm != "allreduce":
            raise ConfigError(f"comm {self.comm!r} is invalid with sync 'diloco' (no gradient is "
                              "sent per step, the pseudo-gradients are all-reduced): allowed "
                              "allreduce, or sync ddp")


@dataclass
class RunOptions(OptionGroup):
    """The run directory, checkpoints, resuming, and how the process runs and reports."""

    SECTION: ClassVar[str] = "run"
    CHOICES: ClassVar = {"logger": LOGGERS}
    out: str = ""  # run directory (empty: a fresh runs/<model>-<mode>-<date-time> per run)
    resume: str = ""  # run directory to continue, or "auto": continue --out if it has a checkpoint
    overwrite: bool = False  # a new run may replace the earlier run in --out (its files only)
    checkpoint_every_epochs: int = 1  # checkpoint every N epochs (0: only after the last one)
    checkpoint_every_steps: int = 0  # also checkpoint every N steps (0: only at epoch ends)
    keep_checkpoints: int = 3  # newest checkpoints kept; older ones are removed
    threads: int = 0  # torch intra-op threads per process (0: torch's default)
    channels_last: bool = True  # conv weights in NHWC memory order: faster conv kernels on the CPU (oneDNN; GPUs not measured)
    progress: bool = True  # tqdm progress bar on rank 0
    verbose: bool = False  # print the whole configuration at the start (always in RUN_DIR/config.toml)
    logger: str = "none"  # also log to: none (metrics.jsonl/.csv only) or tensorboard (RUN_DIR/tb, rank 0)
    compile: bool = False  # torch.compile the model (compiled again once after the switch)
    compile_backend: str = "inductor"  # torch.compile backend (eager, aot_eager: for debugging)

    def check(self) -> None:
        non_negative(self, "checkpoint_every_epochs", "checkpoint_every_steps", "threads")
        positive("keep_checkpoints", self.keep_checkpoints)
        if self.overwrite and self.resume == "auto":
            raise ConfigError("overwrite true is invalid with resume 'auto' (continue the run if "
                              "there is one): allowed one of them")


# The groups in the order of their fields: --help, config.toml and FIELDS list them so.
GROUPS: tuple[type[OptionGroup], ...] = (
    ModelOptions, DataOptions, SubsetOptions, MethodOptions, SwitchOptions, BaselineOptions,
    BatchOptions, TrainingOptions, OptimizerOptions, LMOptions, DistributedOptions, RunOptions)
