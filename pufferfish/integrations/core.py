"""What every trainer callback shares: the switch done in place, and resuming after it.

A trainer owns the model wrapper, the optimizer and the scheduler, and its loop keeps them in
local variables a callback cannot reassign. So the switch changes nothing's identity:

1. the user's module is factorized in place (:meth:`pufferfish.Recipe.switch`);
2. each of the trainer's optimizers is edited in place (:func:`pufferfish.swap_parameters`): same
   object, same groups and hyperparameters, so the trainer's LR scheduler continues exactly;
3. the trainer's DDP wrapper is rebuilt in place
   (:func:`~pufferfish.distributed.env.rebuild_ddp_in_place`): the same object with a new reducer
   over the new parameters, every option and comm hook kept; its construction broadcasts rank 0's
   parameters, so the replicas are identical.

Resuming from a checkpoint written after the switch needs two things a trainer does not know:

- the factorized structure, before the weights are loaded: :func:`rebuild_on_load` makes the
  module's ``load_state_dict`` rebuild the low-rank modules its factor keys describe
  (:func:`pufferfish.load_factorized`) before loading, so the trainer's own loading works;
- the optimizer's parameter order. The trainer builds a fresh optimizer on the factorized model
  and loads the saved state by position, but the switched optimizer holds its parameters in
  another order (the factors were appended where the dense weights left). The callback's state
  records each group's parameter names; :func:`restore_order` puts the loaded state back on the
  right tensors and the groups in the saved order, or fails naming the difference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ..distributed import fsdp
from ..distributed.env import ddp_options, rebuild_ddp_in_place
from ..lowrank import LowRankModule, load_factorized
from ..lowrank.factorize import factorizable_modules
from ..lowrank.presets import resolve_preset
from ..recipe import ParameterSwap, Recipe, check_optimizer
from ..switch.schedule import OBSERVATIONS_PER_EPOCH

__all__ = ["TrainerSwitch", "optimizer_order", "rebuild_on_load", "restore_order"]


class TrainerSwitch:
    """A :class:`~pufferfish.Recipe` driven by a trainer's events; the core of each callback.

    Args:
        warmup_epochs: the switch at the start of this epoch (or ``"auto"``), as in ``Recipe``.
            When neither it nor ``warmup_steps`` is given: the model's preset's own
            (``PRESETS[preset]["warmup_epochs"]``: 0 for LLaMA-style decoders, the best on
            validation at every language-model budget measured), else 2.
        warmup_steps: instead, the switch before this optimizer step (runs that count steps).
        verbose: print the factorization report when switching (rank 0 only).
        recipe_options: every other argument of :class:`~pufferfish.Recipe` (``rank_ratio``,
            ``keep``, ``preset``, ``keep_first``, ``extra_bn``, ``example_input``, ...).
    """

    def __init__(self, warmup_epochs: int | str | None = None, warmup_steps: int | None = None,
                 verbose: bool = True, **recipe_options: Any) -> None:
        if warmup_steps is not None:
            if warmup_epochs is not None:
                raise ValueError(f"warmup_epochs {warmup_epochs!r} and warmup_steps "
                                 f"{warmup_steps!r} are both given: allowed one of them")
            if not (isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool)
                    and warmup_steps >= 0):
                raise ValueError(f"warmup_steps {warmup_steps!r} is invalid: allowed an integer "
                                 ">= 0 (optimizer steps before the switch)")
        self.warmup_steps = warmup_steps
        epochs = 0 if warmup_steps is not None else (2 if warmup_epochs is None else warmup_epochs)
        self.recipe = Recipe(warmup_epochs=epochs, **recipe_options)
        self._amp_given = "amp_dtype" in recipe_options
        if warmup_steps is not None:  # the schedule's switch in steps
            self._reschedule(warmup_steps=warmup_steps)
        self._model_decides = warmup_epochs is None and warmup_steps is None
        self.verbose = verbose
        self.switched_at_step: int | None = None
        self.parameter_swaps: list[ParameterSwap] = []
        self._observed_slot = -1

    @property
    def switched(self) -> bool:
        return self.recipe.switched

    def _reschedule(self, **changes: Any) -> None:
        policy = self.recipe.switch_owner.policy
        policy.schedule = dataclasses.replace(policy.schedule, **changes)

    def follow_amp(self, dtype: torch.dtype | None) -> None:
        """The trainer's autocast dtype (None: none), under which ``keep="auto"`` and the kernel
        choice time the layers, unless the recipe was given its own ``amp_dtype``."""
        if not self._amp_given:
            self.recipe.switch_owner.plan.amp_dtype = dtype

    # --- when ---------------------------------------------------------------------------------

    def start(self, module: nn.Module, epoch: float, resumed: bool) -> None:
        """At the start of training (at ``epoch``, a resumed run's or 0): check the recipe
        against ``module`` now, not at the switch (keep patterns, preset), and for automatic
        choices record the stable ranks at initialization (a resumed run restored them)."""
        self._observed_slot = math.floor(epoch * OBSERVATIONS_PER_EPOCH + 1e-9)
        if self.switched:
            return
        if self._model_decides:  # no warm-up given: the model's preset may carry its own
            preset = resolve_preset(module, self.recipe.switch_owner.plan.preset)
            if "warmup_epochs" in preset:
                self._reschedule(warmup=preset["warmup_epochs"])
        if self.recipe.detector is None or not resumed:
            self.recipe.observe(0, module)  # a check only, for fixed choices

    @staticmethod
    def check_optimizers(module: nn.Module, optimizers: Sequence[Any]) -> None:
        """Some trainer optimizer holds the module's own parameters (not ZeRO's flat copies,
        which the switch cannot edit: the factors would never train), else one line. Another
        optimizer may hold tensors of its own (SAC's temperature)."""
        inner = [innermost(opt) for opt in optimizers]
        mine = {id(p) for p in module.parameters()}
        if inner and not any(id(p) in mine for opt in inner for g in opt.param_groups
                             for p in g["params"]):
            check_optimizer(inner[0], module)  # its one-line refusal

    def due_at_epoch(self, epoch: int, module: nn.Module) -> bool:
        """Whether to switch at the start of ``epoch`` (epoch-based warm-up only)."""
        return self.recipe.should_switch(epoch, module)

    def due_at_step(self, step: int) -> bool:
        """Whether to switch before optimizer step ``step`` (step-based warm-up only)."""
        return not self.switched and self.recipe.schedule.due_at_step(step)

    def observe(self, epoch: float, module: nn.Module) -> None:
        """Feed the automatic switch a few times per epoch (a no-op for fixed warm-ups)."""
        if self.recipe.detector is None or self.switched:
            return
        slot = math.floor(epoch * OBSERVATIONS_PER_EPOCH + 1e-9)
        if slot > self._observed_slot:
            self._observed_slot = slot
            self.recipe.observe(slot / OBSERVATIONS_PER_EPOCH, module)

    # --- the switch ---------------------------------------------------------------------------

    def switch(self, epoch: int, step: int, module: nn.Module,
               optimizers: Sequence[torch.optim.Optimizer],
               ddp: DistributedDataParallel | None) -> None:
        """Factorize ``module``, edit ``optimizers`` and rebuild ``ddp``, each in place.

        A ``fully_shard``-ed module (Lightning's ``ModelParallelStrategy``) is switched by the
        recipe, which gathers one layer at a time, shards the factors and edits the optimizer."""
        if fsdp.is_sharded(module):
            if len(optimizers) != 1:
                raise RuntimeError(f"a fully_shard-ed model is switched with one optimizer: "
                                   f"found {len(optimizers)}")
            self.recipe.switch(epoch, module, innermost(optimizers[0]))
            self.parameter_swaps = [self.recipe.parameter_swap]
        else:  # each optimizer edited as the recipe edits one (its state: carry_state's)
            before = dict(module.named_parameters(remove_duplicate=False))
            self.recipe.switch(epoch, module, None)
            if ddp is not None:  # first: its construction broadcasts rank 0's factors, which
                # the carried optimizer state is then computed from on every rank
                rebuild_ddp_in_place(ddp, register_hooks=self.recipe.on_wrap is None)
                if self.recipe.on_wrap is not None:
                    self.recipe.on_wrap(ddp)
            self.parameter_swaps = [self.recipe.carry_into(innermost(opt), module, before)
                                    for opt in optimizers]
        self.recipe.parameter_swap = self.parameter_swaps[0] if self.parameter_swaps else None
        self.switched_at_step = step
        if self.verbose and _is_main():
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """The switch as text: when, the factorization report, the automatic choices, the
        optimizer edits."""
        lines = [f"pufferfish: switched to low rank at epoch {self.recipe.switched_at}, "
                 f"step {self.switched_at_step}"]
        if self.recipe.report is not None:
            lines.append(str(self.recipe.report))
        decisions = self.recipe.describe_decisions()
        if decisions:
            lines.append(decisions)
        lines += [str(swap) for swap in self.parameter_swaps]
        return "\n".join(lines)

    # --- checkpoints --------------------------------------------------------------------------

    def state(self, module: nn.Module | None,
              optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, Any]:
        """JSON-able progress: the recipe's state, the switch step, and after the switch each
        optimizer's parameter order by name (what :func:`restore_order` needs)."""
        state: dict[str, Any] = {"recipe": self.recipe.state_dict(),
                                 "switched_at_step": self.switched_at_step}
        if self.switched and module is not None:
            state["optimizer_order"] = [optimizer_order(innermost(opt), module)
                                        for opt in optimizers]
        return state

    def restore(self, state: dict[str, Any], module: nn.Module,
                optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Apply :meth:`state` once the trainer has restored the model and optimizer state.

        After the switch the model must already be factorized (:func:`rebuild_on_load` did it
        while the trainer loaded the weights): if it is not, the weights were loaded into the
        dense model, and this fails rather than train a wrong model.
        """
        self.recipe.load_state_dict(state.get("recipe", {}), module)
        self.switched_at_step = state.get("switched_at_step")
        if not self.switched:
            return
        if not any(isinstance(m, LowRankModule) for m in module.modules()):
            raise RuntimeError(
                f"this checkpoint was written after the Pufferfish switch (epoch "
                f"{self.recipe.switched_at}) but {type(module).__name__} is dense: its factorized "
                "weights were not loaded. Give the callback to the trainer before it loads the "
                "checkpoint (Trainer(callbacks=[PufferfishCallback(...)])), so that it rebuilds "
                "the low-rank structure first")
        for opt, order in zip(optimizers, state.get("optimizer_order") or []):
            if order is not None:
                restore_order(innermost(opt), module, order)


# ---------------------------------------------------------------------------------------------
# Resume: structure before weights, optimizer order after them
# ---------------------------------------------------------------------------------------------

def rebuild_on_load(module: nn.Module) -> RemovableHandle:
    """Make ``module.load_state_dict`` rebuild the low-rank modules a factorized state dict has.

    A pre-hook of the root module: when a state dict holds entries of a factorizable module that
    its dense form lacks (``fc.u.weight`` instead of ``fc.weight``), :func:`pufferfish.load_factorized`
    rebuilds those modules at the saved ranks and loads every value strictly (a state dict that
    fits neither form is a ``ValueError`` naming the keys); the ongoing load then finds the
    structure it expects. Any other state dict loads as before.
    """
    busy = [False]

    def hook(mod: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if busy[0] or prefix or not _describes_low_rank(mod, state_dict):
            return
        busy[0] = True
        try:
            load_factorized(mod, state_dict)
        finally:
            busy[0] = False

    return module.register_load_state_dict_pre_hook(hook)


def _describes_low_rank(module: nn.Module, state_dict: dict[str, Any]) -> bool:
    expected = module.state_dict(keep_vars=True).keys()
    extra = [k for k in state_dict if k not in expected]
    if not extra:
        return False
    prefixes = [name + "." for name in factorizable_modules(module)]
    return any(k.startswith(p) for k in extra for p in prefixes)


def optimizer_order(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[list[str]] | None:
    """Each parameter group's parameters by name in ``module``; None if one has no name there."""
    names = {id(p): n for n, p in module.named_parameters()}
    if not all(id(p) in names for g in optimizer.param_groups for p in g["params"]):
        return None
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def restore_order(optimizer: torch.optim.Optimizer, module: nn.Module,
                  saved: list[list[str]]) -> None:
    """Undo a positional optimizer load whose parameter order differs from the saved one.

    ``optimizer.load_state_dict`` gives the parameter at (group i, position j) the state saved at
    (i, j). When the saved optimizer held ``saved[i][j]`` there and this one holds another
    parameter, each state moves to the parameter it was saved for, and each group's parameters
    take the saved order (and membership), so the optimizer is the one that was saved.
    """
    current = optimizer_order(optimizer, module)
    if current == saved:
        return
    flat_saved = [n for group in saved for n in group]
    flat_now = [n for group in current or [] for n in group]
    if current is None or sorted(flat_saved) != sorted(flat_now) or (
            [len(g) for g in saved] != [len(g) for g in current]):
        raise ValueError(
            "the optimizer built on resume does not hold the parameters the saved one held "
            f"(saved groups of {[len(g) for g in saved]} parameters, now "
            f"{[len(g) for g in current or []]}; differing names: "
            f"{sorted(set(flat_saved) ^ set(flat_now))[:5]}): build it from the model's "
            "parameters as in the saved run")
    by_name = dict(module.named_parameters())
    moved = {}
    for group, names in zip(optimizer.param_groups, saved):
        for p, saved_name in zip(group["params"], names):
            if p in optimizer.state:
                moved[saved_name] = optimizer.state.pop(p)
    for group, names in zip(optimizer.param_groups, saved):
        group["params"][:] = [by_name[n] for n in names]
    for name, value in moved.items():
        _check_state_shape(name, by_name[name], value)
        optimizer.state[by_name[name]] = value


def _check_state_shape(name: str, param: torch.Tensor, state: dict[str, Any]) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
            raise ValueError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, "
                             f"the parameter {tuple(param.shape)}: the checkpoint does not fit")


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a trainer's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``)."""
    for attribute in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer):
            return innermost(inner)
    return optimizer


# Wrappers whose parameters are flattened or sharded where a switch cannot replace them (FSDP1
# with flat parameters, DeepSpeed's ZeRO): the switch would fail on some ranks and not others.
UNSUPPORTED_WRAPPERS = ("FullyShardedDataParallel", "DeepSpeedEngine")


def check_wrapper(ddp: nn.Module | None) -> None:
    """Fail now, not at the switch, if a wrapper cannot be rebuilt in place, or if it is one
    the switch cannot work under (:data:`UNSUPPORTED_WRAPPERS`), in one line."""
    names = {c.__name__ for c in type(ddp).__mro__}
    bad = next((n for n in UNSUPPORTED_WRAPPERS if n in names), None)
    if bad is not None:
        raise ValueError(f"a model wrapped by {type(ddp).__name__} is invalid for the Pufferfish "
                         "switch (its parameters are flattened or sharded in place): allowed "
                         "DDP, FSDP2's fully_shard (Lightning's ModelParallelStrategy), or one "
                         "process")
    if isinstance(ddp, DistributedDataParallel):
        ddp_options(ddp)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def json_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments a JSON checkpoint can hold (tensors and callables it cannot)."""
    def plain(value: Any) -> bool:
        if isinstance(value, str | int | float | bool) or value is None:
            return True
        if isinstance(value, list | tuple):
            return all(plain(v) for v in value)
        return isinstance(value, dict) and all(isinstance(k, str) and plain(v)
                                               for k, v in value.items())
    return {k: list(v) if isinstance(v, tuple) else v for k, v in arguments.items() if plain(v)}
