"""The loop's optimizer: SGD (the paper's CNN and LSTM recipe) or AdamW (the LM recipe).

One function builds it from a method's parameter groups, at the start, after every change of
the model (the switch) and on resume, so the three always agree on group order and settings.
AdamW splits each group in two: *decay* (every parameter of two or more dimensions that no
``nn.Embedding`` holds: linear and conv weights, and low-rank factors, which replace such
weights) and *no decay* (biases, norm scales, embedding tables). The split is a rule of the
parameter, not of its name, so factors made at the switch land in their weight's group. SGD keeps
one weight decay for everything (unchanged from the paper's recipe). The LR is set at every step
from :func:`~pufferfish.training.schedule.lr_at`, so no scheduler state exists.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TrainConfig

__all__ = ["RUN_FIELDS", "build_optimizer", "decay_split"]

# What a resume may not change: the saved optimizer state is of this kind.
RUN_FIELDS = ("optimizer",)


def decay_split(groups: list[dict[str, Any]], model: nn.Module) -> list[dict[str, Any]]:
    """Each group as a decay group and a no-decay group (``weight_decay`` 0), empty ones left
    out, in the order given; see the module docstring for the rule."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out: list[dict[str, Any]] = []
    for group in groups:
        params = list(group["params"])
        decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
        chosen = {id(p) for p in decay}
        rest = [p for p in params if id(p) not in chosen]
        if decay:
            out.append({**group, "params": decay})
        if rest:
            out.append({**group, "params": rest, "weight_decay": 0.0})
    return out


def build_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]],
                    model: nn.Module) -> torch.optim.Optimizer:
    """``cfg.optimizer_name``'s optimizer on ``groups`` (each with its ``weight_decay``)."""
    if cfg.optimizer_name == "adamw":
        return torch.optim.AdamW(decay_split(groups, model), lr=cfg.lr,
                                 betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov and cfg.momentum > 0,
                           weight_decay=cfg.weight_decay)
