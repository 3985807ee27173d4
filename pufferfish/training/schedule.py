"""Learning rate as a pure function of the step.

A function rather than a ``torch.optim.lr_scheduler`` object, because the Pufferfish switch builds a
new optimizer mid-training and resume restarts mid-run: with ``lr = lr_at(step)`` there is no
scheduler state to carry across either, and the schedule continues exactly where it was.
"""

from __future__ import annotations

import math

from ..config import TrainConfig

__all__ = ["lr_at", "milestone_step"]


def lr_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """The learning rate at global ``step`` (0-based) for ``cfg``'s schedule.

    - linear warm-up from ~0 to ``cfg.lr`` over ``cfg.lr_warmup_epochs`` epochs (Goyal et al.,
      for large effective batches), then
    - ``multistep``: ×0.1 at each milestone (fractions of the run, paper: 50% and 75%; see
      :func:`milestone_step`);
      ``cosine``: half a cosine from ``cfg.lr`` to 0 over the run; ``constant``.
    """
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.lr_warmup_epochs * steps_per_epoch)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "multistep":
        passed = sum(step >= milestone_step(m, cfg.epochs, steps_per_epoch)
                     for m in cfg.milestones)
        return cfg.lr * 0.1**passed
    if cfg.schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * cfg.lr * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr


def milestone_step(fraction: float, epochs: int, steps_per_epoch: int) -> int:
    """The global step at which a ``fraction`` milestone decays the LR.

    At the epoch boundary nearest ``fraction`` of the epochs when one lies inside the run (the
    paper's epoch milestones: 150 and 225 of 300), else at that fraction of the run's steps, never
    before step 1: a 1-epoch try decays half-way through, not from its first step (the nearest
    boundary would be epoch 0), and a 2-epoch run's 75% milestone still happens."""
    epoch = round(fraction * epochs)
    if 1 <= epoch < epochs:
        return epoch * steps_per_epoch
    return max(1, round(fraction * epochs * steps_per_epoch))
