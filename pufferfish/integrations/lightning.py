"""Pufferfish in Lightning: ``Trainer(..., callbacks=[PufferfishCallback()])``.

The switch (see :mod:`pufferfish.integrations.core`) factorizes the ``LightningModule`` in place,
edits each of ``trainer.optimizers`` in place (the schedulers in ``trainer.lr_scheduler_configs``
hold the same optimizers and continue exactly) and, under ``strategy="ddp"``, rebuilds the
strategy's ``DistributedDataParallel`` (``trainer.strategy.model``) in place, so the strategy,
its optimizer wrappers and the fit loop keep the objects they hold.

When: ``warmup_epochs=E`` at ``on_train_epoch_start`` of epoch E (after E full-rank epochs),
``warmup_steps=S`` at ``on_train_batch_start`` before optimizer step S.

Checkpoints and resume: the callback's ``state_dict`` (switch epoch and step, each optimizer's
parameter order by name, the automatic switch's record) is saved in Lightning checkpoints. On
``fit(ckpt_path=...)`` its ``setup`` has made the module's ``load_state_dict`` rebuild the
low-rank structure from the factor keys before Lightning loads the weights; once Lightning has
loaded the optimizer states (by position), ``on_train_start`` puts them back on the tensors they
were saved for.

Imports ``lightning.pytorch``, or ``pytorch_lightning`` when only that is installed: use the
callback with the ``Trainer`` of the same package.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning import Callback  # type: ignore[no-redef]
    except ImportError as error:
        raise ImportError("pufferfish.integrations.lightning needs Lightning: pip install "
                          "lightning") from error

from ..lowrank import FactorizationReport
from ..recipe import Recipe
from . import core

__all__ = ["PufferfishCallback"]


class PufferfishCallback(Callback):
    """Full-rank warm-up, then the switch to the factorized model, inside ``Trainer.fit``.

    Args:
        warmup_epochs: full-rank epochs before the switch (default 2), or ``"auto"``.
        rank_ratio, keep: as in :class:`pufferfish.Recipe`.
        warmup_steps: instead of ``warmup_epochs``: optimizer steps before the switch.
        verbose: print the factorization report at the switch (rank 0 only).
        recipe_options: the other arguments of :class:`pufferfish.Recipe` (``preset``,
            ``keep_first``, ``extra_bn``, ``example_input``, ``max_rank_ratio``, ``on_wrap``, ...).

    Keep patterns name modules of the ``LightningModule`` (``"net.0"`` for its ``self.net[0]``).
    After the switch, :attr:`report` is the factorization report and :attr:`recipe` the recipe.
    """

    def __init__(self, warmup_epochs: int | str | None = None, rank_ratio: float | str = 0.25,
                 keep: Any = (), *, warmup_steps: int | None = None, verbose: bool = True,
                 **recipe_options: Any) -> None:
        self.switcher = core.TrainerSwitch(warmup_epochs, warmup_steps, verbose,
                                           rank_ratio=rank_ratio, keep=keep, **recipe_options)
        self._module: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending: dict[str, Any] | None = None
        self._load_hook: Any = None

    @property
    def recipe(self) -> Recipe:
        return self.switcher.recipe

    @property
    def report(self) -> FactorizationReport | None:
        return self.switcher.recipe.report

    # --- Trainer hooks ------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if stage == "fit" and self._load_hook is None:  # before Lightning loads a checkpoint
            self._load_hook = core.rebuild_on_load(pl_module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict  # applied once the optimizers exist: on_train_start

    def state_dict(self) -> dict[str, Any]:
        return self.switcher.state(self._module, self._optimizers)

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._module, self._optimizers = pl_module, list(trainer.optimizers)
        resumed = self._pending is not None or trainer.global_step > 0
        if self._pending is not None:
            self.switcher.restore(self._pending, pl_module, self._optimizers)
            self._pending = None
        core.check_wrapper(trainer.strategy.model)
        self.switcher.check_optimizers(pl_module, self._optimizers)
        self.switcher.follow_amp(amp_dtype(trainer.precision))
        self.switcher.start(pl_module, trainer.current_epoch, resumed)

    def on_train_epoch_start(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.switcher.due_at_epoch(trainer.current_epoch, pl_module):
            self._switch(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any,
                             batch_idx: int) -> None:
        if self.switcher.due_at_step(trainer.global_step):
            self._switch(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        batches = trainer.num_training_batches
        if isinstance(batches, int | float) and 0 < batches < float("inf"):
            self.switcher.observe(trainer.current_epoch + (batch_idx + 1) / batches, pl_module)

    def _switch(self, trainer: Any, pl_module: nn.Module) -> None:
        wrapper = trainer.strategy.model
        self.switcher.switch(trainer.current_epoch, trainer.global_step, pl_module,
                             list(trainer.optimizers),
                             wrapper if isinstance(wrapper, DistributedDataParallel) else None)


def amp_dtype(precision: Any) -> torch.dtype | None:
    """The Trainer's autocast dtype from its ``precision`` (``"16-mixed"``, ``"bf16-mixed"``;
    ``"*-true"`` casts the model itself, no autocast)."""
    return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(str(precision))
