"""What every ``pufferfish bench`` method runs, whatever synchronizes it (DDP, DiLoCo, FSDP2): the
model, its optimizer and one training step, and the timing helpers of the step workers."""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..baselines.galore import galore_optimizer, galore_ranks
from ..config import TrainConfig
from ..lowrank import factorize
from ..lowrank.counting import count_params
from ..models import build_at_width, get_spec, model_names
from ..models.memory_format import to_channels_last
from ..training.optim import build_optimizer
from ..training.step import Replica, train_step
from .usermodel import LOSS_ATTR, build_user_model, call_model, is_user_model, load_workload

__all__ = ["PUFFERFISH_RANK_RATIO", "adamw_models", "build_model", "image_models", "is_lm", "lm_models",
           "make_optimizer", "optimizer_name", "quartiles", "rank_ratio_of", "timed",
           "train_one_step"]

PUFFERFISH_RANK_RATIO = 0.25  # the paper's ratio, with the model's "paper" preset


def is_lm(model: str) -> bool:
    """Whether the bench times ``model`` (a spec's name or ``PATH.py:NAME``) on KJV token
    batches (a language model) rather than Fashion-MNIST images."""
    return get_spec(model).is_lm


def lm_models() -> tuple[str, ...]:
    """The registered language models (for messages and ``--help``)."""
    return tuple(n for n in model_names() if get_spec(n).is_lm)


def adamw_models() -> tuple[str, ...]:
    """The registered models every bench method steps with AdamW (those GaLore may join)."""
    return tuple(n for n in model_names() if get_spec(n).bench_optimizer == "adamw")


def image_models() -> tuple[str, ...]:
    """The registered image models (for messages and ``--help``)."""
    return tuple(n for n in model_names() if not get_spec(n).is_lm)


def rank_ratio_of(args: Any) -> float | None:
    """The rank ratio a factorized method of ``args`` (flags or config, a variant's applied)
    uses: ``--rank-ratio``, else the paper's 1/4 for our models and None (the Workload's own
    ``rank_ratio``) for the user's."""
    ratio = getattr(args, "rank_ratio", None)
    if ratio is not None:
        return float(ratio)
    return None if is_user_model(args.model) else PUFFERFISH_RANK_RATIO


def build_model(args: argparse.Namespace, factorized: bool) -> tuple[nn.Module, int]:
    """The model (factorized for Pufferfish methods, at :func:`rank_ratio_of`) and its full-rank
    parameter count; in ``--channels-last`` memory order and compiled when ``args`` say so."""

    torch.manual_seed(args.seed)  # same weights on every rank (DDP also broadcasts rank 0's)
    if is_user_model(args.model):  # --model PATH.py:FUNC, module:FUNC, hf:CONFIG: usermodel.py
        model, full = build_user_model(args.model, args.seq_len, factorized,
                                       rank_ratio_of(args))
        return _prepared(args, model), full
    # The LMs on KJV tokens, the image models on Fashion-MNIST's 28x28 grey images.
    model = build_at_width(args.model, args.width, vocab_size=args.vocab, max_len=args.seq_len,
                           num_classes=10, in_channels=1, image_size=28)
    full = count_params(model)
    if factorized:
        factorize(model, rank_ratio=rank_ratio_of(args), preset="paper")
    return _prepared(args, model), full


def _prepared(args: argparse.Namespace, model: nn.Module) -> nn.Module:
    """``model`` in ``--channels-last`` memory order and compiled when ``args`` say so."""
    if args.channels_last:  # as training stores them (TrainConfig.channels_last)
        to_channels_last(model)
    if args.compile:
        model.compile()
    return model


def optimizer_name(model: str, seq_len: int = 64) -> str:
    """The one optimizer every method of a workload steps with: the model spec's
    ``bench_optimizer`` (``adamw`` for our language models, the LM recipe; ``sgd`` with momentum
    for the image models, the paper's), the user's workload's own (``Workload.optimizer``)."""
    if is_user_model(model):
        return load_workload(model, seq_len).optimizer
    return get_spec(model).bench_optimizer


def make_optimizer(args: argparse.Namespace, method: str,
                   model: nn.Module) -> torch.optim.Optimizer:
    """The workload's optimizer (:func:`optimizer_name`), the same for every method so that only
    the method differs between rows: built by the training loop's
    :func:`~pufferfish.training.optim.build_optimizer` (AdamW: decay / no-decay groups). ``galore``
    (language models only: ``BenchConfig`` refuses it with SGD's image models) steps with GaLore's
    own AdamW, the same LR, betas, epsilon and weight decay, projected at the Pufferfish ranks
    (:func:`rank_ratio_of`). ``method`` may carry settings (``galore:rank_ratio=0.5``)."""
    galore = method.partition(":")[0] == "galore"
    # Only the optimizer settings are read (the user's workload: TrainConfig's default model
    # stands in for it).
    model_fields = {} if is_user_model(args.model) else {
        "model": args.model, "data": "kjv" if is_lm(args.model) else "fashion-mnist"}
    cfg = TrainConfig(optimizer=optimizer_name(args.model, args.seq_len), lr=args.lr,
                      momentum=0.9, weight_decay=1e-4,
                      rank_ratio=str(rank_ratio_of(args) or PUFFERFISH_RANK_RATIO),
                      mode="galore" if galore else "full", **model_fields)
    if galore:
        return galore_optimizer(model, galore_ranks(model, cfg), cfg)
    return build_optimizer(cfg, [{"params": list(model.parameters()),
                                  "weight_decay": cfg.weight_decay}], model)


def train_one_step(replica: Replica, micro_batches: Sequence[Any]) -> None:
    """The training loop's step (:func:`pufferfish.training.step.train_step`) on ``(input,
    target)`` micro-batches (``--grad-accum`` of them: one gradient synchronization) with
    cross-entropy (the user's workload: its own loss, carried by its model): no AMP, clipping or
    non-finite vote."""
    own_loss = getattr(replica.model, LOSS_ATTR, None)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if own_loss is not None:
            return own_loss(call_model(replica.wrapped, x), y)
        out = replica.wrapped(x)
        logits = out[0] if isinstance(out, tuple) else out  # language models: (logits, hidden)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    train_step(replica, [functools.partial(loss, x, y) for x, y in micro_batches])


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile of some step times."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]
