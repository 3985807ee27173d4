"""What a training *method* may do; the loop does everything else.

A method changes the model between epochs (Pufferfish factorizes it once; Lottery Ticket prunes and
rewinds it every round; Network Slimming thins it), may add a loss term, may give some parameters
their own optimizer group, and may restart the LR schedule. The loop asks it at fixed points and,
when it says the parameters changed, rebuilds the optimizer, the DDP wrapper and the comm hook
through the same code that built them at the start. The base class is the method that does
nothing: training the model as it is.

A method is a stateful component of a run like any other: :meth:`Method.state_dict` goes into
each checkpoint under ``"method"`` and :meth:`Method.load_state_dict` gets it back on resume,
before the weights are loaded (it rebuilds the architecture the weights need).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...config import TrainConfig
from ..optim import build_optimizer

__all__ = ["Change", "Method"]


@dataclass
class Change:
    """A change of the model, logged by the loop and saved as ``RUN_DIR/<name>.txt/.json``."""

    name: str  # e.g. "factorization", "prune-round-2"
    text: str  # printed on rank 0
    record: dict[str, Any] = field(default_factory=dict)  # written as JSON


class Method:
    """The interface, and the no-op method; subclasses override what they need."""

    name = "full"
    # Configuration fields that define what this method computes: a resume with any of them
    # changed is refused (startup.check_resumable), other flags may change.
    run_fields: tuple[str, ...] = ("mode",)

    def __init__(self, cfg: TrainConfig | None = None) -> None:
        self.cfg = cfg

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        """Called once before training starts (also before a resume), with the initial model."""

    def total_epochs(self, cfg: TrainConfig) -> int:
        return cfg.epochs

    def schedule_step(self, global_step: int, steps_per_epoch: int) -> int:
        """The step the LR schedule is at (a method that restarts training restarts it)."""
        return global_step

    def check_steps(self, steps_per_epoch: int) -> None:
        """Refuse (ConfigError) a plan the run's optimizer steps cannot hold, before the run
        writes anything (called once the data's step count is known)."""

    def start_text(self, steps_per_epoch: int) -> str | None:
        """A line said at the start of a fresh run (what the method will do when), or None."""
        return None

    def lr_scale(self, global_step: int, steps_per_epoch: int) -> float:
        """A factor on the schedule's LR at ``global_step`` (a method's own re-warm-up)."""
        return 1.0

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (rebuilt with the optimizer after each change)."""
        return [{"params": list(model.parameters()), "weight_decay": cfg.weight_decay}]

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        """The optimizer on :meth:`param_groups` (SGD or AdamW, ``cfg.optimizer``); a method
        with an optimizer of its own (GaLore) overrides this."""
        return build_optimizer(cfg, self.param_groups(model, cfg), model)

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        """Change ``model`` in place before ``epoch`` if the method says so; return what changed.

        A non-None return makes the loop rebuild the optimizer (fresh state), DDP and comm hook.
        """
        return None

    def carry_state(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                    before: dict[str, torch.Tensor], model: nn.Module) -> None:
        """After a change, the loop's fresh optimizer ``new`` may inherit state from ``old``
        (``before``: the model's named parameters before the change). Default: none, every
        parameter starts from zero momentum."""

    def on_step_start(self, epoch: int, step: int, steps: int, model: nn.Module) -> Change | None:
        """Before step ``step`` (0-based) of ``steps`` in ``epoch``: as :meth:`on_epoch_start`,
        a change of the model mid-epoch (the switch at ``warmup_steps``), or None."""
        return None

    def carry_outer_state(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                          before: dict[str, torch.Tensor], model: nn.Module) -> None:
        """As :meth:`carry_state`, for DiLoCo's outer optimizer (its momentum on the
        synchronized weights, ``--sync diloco``). Default: none, the outer momentum restarts."""

    def on_step_end(self, epoch: int, step: int, steps: int, model: nn.Module) -> None:
        """After optimizer step ``step`` (1-based) of ``steps`` in ``epoch``: observe only."""

    def extra_loss(self, model: nn.Module) -> torch.Tensor | None:
        """A term added to the task's loss (a regularizer), or None."""
        return None

    def on_epoch_end(self, epoch: int, model: nn.Module) -> dict[str, Any]:
        """Extra keys for this epoch's metrics row."""
        return {}

    def model_figures(self, model: nn.Module, example_input: Any) -> dict[str, Any]:
        """What the metrics rows say about the model's size; asked again only after a change."""
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {"params": sum(p.numel() for p in model.parameters()), "grad_bytes": 4 * trainable}

    def state_dict(self) -> dict[str, Any]:
        """Plain data (loadable with ``weights_only=True``) describing the method's progress."""
        return {}

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """On resume, before the weights are loaded: rebuild the architecture ``state`` records."""
