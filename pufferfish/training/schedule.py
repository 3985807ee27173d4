"""Learning rate as a pure function of the step.

A function rather than a ``torch.optim.lr_scheduler`` object, because the Pufferfish switch builds a
new optimizer mid-training and resume restarts mid-run: with ``lr = lr_at(step)`` there is no
scheduler state to carry across either, and the schedule continues exactly where it was.
"""

from __future__ import annotations

import math

from ..config import TrainConfig

__all__ = ["lr_at"]


def lr_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """The learning rate at global ``step`` (0-based) for ``cfg``'s schedule.

    - linear warm-up from ~0 to ``cfg.lr`` over ``cfg.lr_warmup_epochs`` epochs (Goyal et al.,
      for large effective batches), then
    - ``multistep``: ×0.1 at each milestone (fractions of the epochs, paper: 50% and 75%);
      ``cosine``: half a cosine from ``cfg.lr`` to 0 over the run; ``constant``.
    """
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.lr_warmup_epochs * steps_per_epoch)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "multistep":
        passed = sum(step >= round(m * cfg.epochs) * steps_per_epoch for m in cfg.milestones)
        return cfg.lr * 0.1**passed
    if cfg.schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * cfg.lr * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr
