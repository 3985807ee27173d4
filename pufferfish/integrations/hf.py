"""Pufferfish in the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[PufferfishCallback()])``.

The Trainer keeps its model wrapper in a local variable of its training loop (``model`` in
``_inner_training_loop``, the DDP wrapper that accelerate built under ``torchrun``), in
``trainer.model_wrapped`` and in ``accelerator._models``; a callback can replace none of them.
So the switch changes no object's identity (see :mod:`pufferfish.integrations.core`): the model
is factorized in place, the Trainer's optimizer is edited in place (its LR scheduler continues
exactly), and the DDP wrapper is rebuilt in place, the same object with a reducer over the new
parameters. A callback is not given the wrapper: it is the one ``DistributedDataParallel`` whose
``module`` is the Trainer's model, found once among live objects at the start of training.

When: ``warmup_epochs=E`` switches at ``on_epoch_begin`` of epoch E (0-based: after E full-rank
epochs); ``warmup_steps=S`` at ``on_step_begin`` before optimizer step S, for runs set by
``max_steps``. ``warmup_epochs="auto"`` observes stable ranks 4 times an epoch.

Checkpoints and resume: the callback is an ``ExportableState``, so its progress (the switch
epoch and step, the optimizer's parameter order by name, the automatic switch's record) is in
each checkpoint's ``trainer_state.json``. Passed to ``Trainer(callbacks=[...])``, it also makes
the model rebuild its low-rank structure when the Trainer loads factorized weights on
``train(resume_from_checkpoint=...)``; the optimizer state, loaded by position, is then put back
on the tensors it was saved for. A callback added later (``trainer.add_callback``) cannot do the
first part, and a run resumed after the switch then stops with an error saying so, rather than
train the dense model the Trainer loaded half of (it loads weights with ``strict=False``).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pufferfish.integrations.hf needs the transformers package (and "
                      "accelerate, which its Trainer uses): pip install transformers "
                      "accelerate") from error

from ..distributed import fsdp
from ..lowrank import FactorizationReport
from ..recipe import Recipe
from . import core

__all__ = ["PufferfishCallback"]


class PufferfishCallback(TrainerCallback, ExportableState):
    """Full-rank warm-up, then the switch to the factorized model, inside ``Trainer.train``.

    Args:
        warmup_epochs: full-rank epochs before the switch, or ``"auto"`` (default: the model's
            preset's, 0 for LLaMA-style decoders, else 2).
        rank_ratio, keep: as in :class:`pufferfish.Recipe`.
        warmup_steps: instead of ``warmup_epochs``: optimizer steps before the switch.
        verbose: print the factorization report at the switch (rank 0 only).
        recipe_options: the other arguments of :class:`pufferfish.Recipe` (``preset``,
            ``keep_first``, ``extra_bn``, ``example_input``, ``max_rank_ratio``, ``on_wrap``, ...).

    After the switch, :attr:`report` is the factorization report and :attr:`recipe` the recipe.
    """

    def __init__(self, warmup_epochs: int | str | None = None, rank_ratio: float | str = 0.25,
                 keep: Any = (), *, warmup_steps: int | None = None, verbose: bool = True,
                 **recipe_options: Any) -> None:
        self.switcher = core.TrainerSwitch(warmup_epochs, warmup_steps, verbose,
                                           rank_ratio=rank_ratio, keep=keep, **recipe_options)
        self._arguments = dict(warmup_epochs=warmup_epochs, rank_ratio=rank_ratio, keep=keep,
                               warmup_steps=warmup_steps, verbose=verbose, **recipe_options)
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._wrapper: weakref.ref[DistributedDataParallel] | None = None
        self._load_hook: Any = None

    @property
    def recipe(self) -> Recipe:
        return self.switcher.recipe

    @property
    def report(self) -> FactorizationReport | None:
        return self.switcher.recipe.report

    # --- Trainer events -----------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        if model is not None and self._load_hook is None:
            self._load_hook = core.rebuild_on_load(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module,
                       optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        self._model, self._optimizer = model, optimizer
        resumed = state.global_step > 0  # the Trainer restored weights and optimizer
        saved = _saved_state(state, type(self).__name__) if resumed else None
        if saved is not None:
            self.switcher.restore(saved, model, [optimizer])
        self.switcher.check_optimizers(model, [optimizer])
        self.switcher.follow_amp(amp_dtype(args))
        self.switcher.start(model, state.epoch, resumed)
        wrapper = _find_wrapper(model)
        core.check_wrapper(wrapper)
        self._wrapper = weakref.ref(wrapper) if wrapper is not None else None

    def on_epoch_begin(self, args: Any, state: Any, control: Any, model: nn.Module,
                       optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        epoch = int(state.epoch + 1e-9)
        if self.switcher.due_at_epoch(epoch, model):
            self._switch(epoch, state.global_step, model, optimizer)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module,
                      optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if self.switcher.due_at_step(state.global_step):
            self._switch(int(state.epoch + 1e-9), state.global_step, model, optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module,
                    **kwargs: Any) -> None:
        self.switcher.observe(state.epoch, model)

    def _switch(self, epoch: int, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> None:
        wrapper = self._wrapper() if self._wrapper is not None else _find_wrapper(model)
        if wrapper is not None and wrapper.module is not model:
            wrapper = _find_wrapper(model)
        self.switcher.switch(epoch, step, model, [optimizer], wrapper)

    # --- checkpoints (ExportableState: saved in trainer_state.json) ---------------------------

    def state(self) -> dict[str, Any]:
        optimizers = [self._optimizer] if self._optimizer is not None else []
        return {"args": core.json_arguments(self._arguments),
                "attributes": {"saved_state": self.switcher.state(self._model, optimizers)}}


def _saved_state(state: Any, name: str) -> dict[str, Any] | None:
    """This callback's state in a resumed ``TrainerState`` (first of several of its kind)."""
    stored = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if isinstance(stored, list):
        stored = stored[0] if stored else None
    return (stored or {}).get("attributes", {}).get("saved_state")


def _find_wrapper(model: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` around ``model`` (None on one process).

    The Trainer does not hand it to callbacks; it is the one live DDP object whose ``module`` is
    the Trainer's model. A wrapper left over from an earlier ``train`` call is collected first.
    """
    if not core.distributed() or fsdp.is_sharded(model):  # FSDP2: no wrapper, switched in place
        return None
    for attempt in range(2):
        found = [o for o in gc.get_objects()
                 if issubclass(type(o), DistributedDataParallel) and o.module is model]
        if len(found) == 1:
            return found[0]
        if attempt == 0:
            gc.collect()
    if not found:
        raise RuntimeError(
            f"PufferfishCallback found no DistributedDataParallel around the "
            f"{type(model).__name__} in this {torch.distributed.get_world_size()}-process run: "
            "allowed are one process, DDP and FSDP2 (fully_shard); FSDP1 and DeepSpeed flatten "
            "the parameters the switch replaces into buffers of their own)")
    raise RuntimeError(f"PufferfishCallback found {len(found)} DistributedDataParallel wrappers "
                       f"around the {type(model).__name__}: allowed is one")


def amp_dtype(args: Any) -> torch.dtype | None:
    """The Trainer's autocast dtype from its ``TrainingArguments``: ``mixed_precision`` (which
    transformers also reads from ``ACCELERATE_MIXED_PRECISION``, ``accelerate launch``'s), else
    the ``bf16`` and ``fp16`` flags."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    mixed = getattr(args, "mixed_precision", None)
    if mixed in dtypes:
        return dtypes[mixed]
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return torch.float16 if getattr(args, "fp16", False) else None
