"""What a training *method* may do; the loop does everything else.

A method changes the model between epochs (Pufferfish factorizes it once; Lottery Ticket prunes and
rewinds it every round; Network Slimming thins it), may add a loss term, and may restart the LR
schedule. The loop asks it at fixed points and, when it says the parameters changed, rebuilds the
optimizer, the DDP wrapper and the comm hook through the same code that built them at the start.
Full-rank training is the method that does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig

__all__ = ["Change", "FullRank", "Method"]


@dataclass
class Change:
    """A change of the model, logged by the loop and saved as ``RUN_DIR/<name>.txt/.json``."""

    name: str  # e.g. "factorization", "prune-round-2"
    text: str  # printed on rank 0
    record: dict[str, Any] = field(default_factory=dict)  # written as JSON


class Method:
    """The no-op method (full-rank training); subclasses override what they need."""

    name = "full"

    def __init__(self, cfg: TrainConfig | None = None) -> None:
        self.cfg = cfg

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        """Called once before training starts (not on resume), with the initial model."""

    def total_epochs(self, cfg: TrainConfig) -> int:
        return cfg.epochs

    def schedule_step(self, global_step: int, steps_per_epoch: int) -> int:
        """The step the LR schedule is at (a method that restarts training restarts it)."""
        return global_step

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        """Change ``model`` in place before ``epoch`` if the method says so; return what changed.

        A non-None return makes the loop rebuild the optimizer (fresh state), DDP and comm hook.
        """
        return None

    def on_step_end(self, epoch: int, step: int, steps: int, model: nn.Module) -> None:
        """After optimizer step ``step`` (1-based) of ``steps`` in ``epoch``: observe, not change."""

    def extra_loss(self, model: nn.Module) -> torch.Tensor | None:
        return None

    def on_epoch_end(self, epoch: int, model: nn.Module) -> dict[str, Any]:
        """Extra keys for this epoch's metrics row."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Plain data (loadable with ``weights_only=True``) describing the method's progress."""
        return {}

    def restore(self, state: dict[str, Any], model: nn.Module) -> None:
        """On resume, before the weights are loaded: rebuild the architecture ``state`` records."""


FullRank = Method
