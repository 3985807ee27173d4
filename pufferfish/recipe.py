"""The Pufferfish schedule: full-rank warm-up, then one switch to the factorized model.

The switch is the method's single moment of surgery, :meth:`Recipe.switch`, and it is a drop-in:
the optimizer, LR scheduler and DDP wrapper the user built keep working, unchanged.

1. factorize the (unwrapped) model in place, identically on every rank (same weights, same plan);
2. edit the user's optimizer in place (:func:`swap_parameters`): the same object, the same
   parameter groups with every hyperparameter and learning rate. Each replaced dense weight leaves
   its group; its factors join that group, a new bias the group of the old bias (decay / no-decay
   groups survive). The state of every parameter is then what
   :func:`~pufferfish.switch.carry_state` says, as in ``pufferfish train``: with ``"reset"`` (the
   paper, the default) every parameter of the model starts empty, surviving ones too (momentum
   and Adam moments from zero, Adam's step count from 0); with ``"project"`` survivors keep theirs
   and the factors get their dense weight's, projected;
3. the LR scheduler needs nothing: it holds the same optimizer, whose groups and LRs did not
   change, so the LR sequence is exactly that of the run without the switch (any
   ``torch.optim.lr_scheduler`` or ``transformers`` schedule);
4. re-wrap DDP with every option of the user's wrapper (``find_unused_parameters``, buffers,
   buckets, static graph, ...: :func:`~pufferfish.distributed.env.rewrap_ddp`; the constructor
   broadcasts rank 0's parameters, so replicas are identical) and register the user's comm hook
   on it again, or call ``on_wrap`` with the new wrapper instead.

Use it from your own loop::

    recipe = pufferfish.Recipe(warmup_epochs=2, rank_ratio=0.25, preset="paper")
    for epoch in range(epochs):
        model, optimizer, scheduler = recipe.on_epoch_start(epoch, model, optimizer, scheduler)
        train_one_epoch(model, optimizer, scheduler)  # the same optimizer and scheduler objects

``model`` changes only when it is a DDP wrapper (a new one). The arguments are checked when the
recipe is built, its keep patterns and preset against the model at the first call
(:meth:`~Recipe.on_epoch_start`, :meth:`~Recipe.observe`), not hours later at the switch.

Gradient accumulation (``accum`` micro-batches per optimizer step) needs nothing from the
recipe: accumulate inside ``train_one_epoch`` as usual. The switch falls at an epoch start, so
between optimizer steps; zero the gradients at the start of each group, so that an epoch's
incomplete last group (dropped, as ``pufferfish train`` drops it) is not carried into the next
step. Divide each loss by ``accum`` and run the group's first backward passes under
``model.no_sync()`` (DDP; FSDP2: ``model.set_requires_gradient_sync(False)``): the gradients, and
a comm hook such as PowerSGD with its error feedback, are then synchronized once per optimizer
step::

    for i, batch in enumerate(loader):  # micro-batches
        if i % accum == 0:
            optimizer.zero_grad()
        last = (i + 1) % accum == 0
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model, batch) / accum).backward()
        if last:
            optimizer.step()
            scheduler.step()

Count steps as optimizer steps (the scheduler's, ``observe(epoch + step / steps, model)``), and
after the switch use the wrapper ``on_epoch_start`` returned: it is a new one.

``warmup_epochs="auto"`` switches when every layer's stable rank has settled, ``rank_ratio="auto"``
picks per-layer ranks from the stable ranks, ``keep="auto"`` profiles each layer and keeps those
that factorizing does not make cheaper (see :mod:`pufferfish.auto`). With ``warmup_epochs="auto"``,
also call ``recipe.observe(epoch + step / steps, model)`` a few times per epoch (the CLI does, 4
times): the plateau test is a change per epoch over a 1-epoch window, and observations within it
average out noise and catch a rank that moves and comes back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .distributed import fsdp
from .distributed.buckets import AUTO, TORCH, bucket_overrides, parse_bucket_mb
from .distributed.env import ddp_of, ddp_options, rebuild_ddp_in_place, rewrap_ddp, unwrapped
from .lowrank.presets import DEFAULT_PRESET
from .switch import (
    FactorizationPlan,
    Switch,
    SwitchPolicy,
    SwitchSchedule,
    carry_state,
    install_state,
)

__all__ = ["ParameterSwap", "Recipe", "swap_parameters"]


class Recipe:
    """When and how a model is switched from full-rank to low-rank, for a hand-written loop.

    A thin facade over :class:`~pufferfish.switch.Switch` (:attr:`switch_owner`: the policy that
    says when and the plan that says how, with one state): it adds what a hand-written loop needs
    at the switch, the in-place edit of its optimizer and the re-wrap of its DDP.

    Args:
        warmup_epochs: full-rank epochs before the switch (the paper: about 10% of training);
            0 factorizes at the start of epoch 0 (spectral initialization of a low-rank model);
            ``"auto"``: when every tracked layer's stable rank has stopped changing.
        rank_ratio: rank as a fraction of each layer's full rank (paper: 1/4), or ``"auto"``.
        max_rank_ratio: with ``rank_ratio="auto"``, no layer's rank exceeds this fraction of its
            full rank (default 1/4: never larger than the paper's preset); None: no budget.
        keep: glob patterns of layers kept full-rank, or ``"auto"`` (profile; preset still applies).
        preset: the model's named preset of full-rank layers (``"paper"``), or None; by default
            ``"paper"`` where the model has it (its own ``PRESETS`` or by class name: HF's
            ``LlamaForCausalLM``), as ``pufferfish train`` does.
        keep_first: also keep the first K factorizable layers full-rank (hybrid network).
        extra_bn: BatchNorm between the factors of each conv.
        example_input: a batch for the forward-order trace, MAC counts and ``keep="auto"``.
        on_wrap: called with the new DDP wrapper at the switch, e.g. to register a comm hook
            with fresh state; without it, the old wrapper's comm hooks are registered again.
        min_warmup, max_warmup: bounds of the automatic switch epoch.
        switch_threshold, switch_window: the automatic switch's plateau test, see
            :class:`~pufferfish.auto.SwitchDetector` (change per epoch, window in epochs).
        switch_momentum: what the optimizer carries, the one meaning of
            :mod:`pufferfish.switch.schedule`: ``"reset"`` (the paper): every parameter's state
            starts empty, survivors' included; ``"project"``: survivors keep theirs, a replaced
            weight's SGD momentum or Adam moments are projected onto its factors
            (:func:`~pufferfish.switch.projected_state`); ``"auto"``: ``"reset"``.
            (``pufferfish train``'s ``auto`` also re-warms the LR after an AdamW reset: it owns
            the schedule; here your scheduler does, and a short ramp of it after the switch,
            :meth:`~pufferfish.switch.SwitchSchedule.lr_scale`, is what the LM budget study
            measured best with AdamW.)
        bucket_mb: DDP's gradient bucket cap (MiB) of the wrapper re-built at the switch, sized
            for the smaller model; ``"torch"``: torch's default; None: the user's wrapper's.
            (``"auto"``, timed on real steps, is ``pufferfish train``'s: it owns the steps.)
        amp_dtype: the dtype of your forward's autocast (``torch.float16``, ``torch.bfloat16``),
            or None: ``keep="auto"`` and the kernel choice time the layers under it, as they
            train (the trainer callbacks read it from the trainer's mixed precision).
    """

    def __init__(
        self,
        warmup_epochs: int | str = 2,
        rank_ratio: float | str = 0.25,
        keep: Iterable[str] | str = (),
        max_rank_ratio: float | None = 0.25,
        preset: str | None = DEFAULT_PRESET,
        keep_first: int = 0,
        extra_bn: bool = False,
        example_input: Any = None,
        on_wrap: Callable[[DistributedDataParallel], Any] | None = None,
        min_warmup: int = 1,
        max_warmup: int | None = None,
        switch_threshold: float = 0.05,
        switch_window: float = 1.0,
        switch_momentum: str = "reset",
        bucket_mb: float | str | None = None,
        amp_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(keep, str) and isinstance(keep, Iterable):
            keep = list(keep)  # checked, then used: an iterator must be read once
        _check_arguments(locals())
        schedule = SwitchSchedule(warmup=warmup_epochs, min_warmup=min_warmup,
                                  max_warmup=max_warmup, momentum=switch_momentum)
        policy = SwitchPolicy(schedule, track=rank_ratio == "auto", threshold=switch_threshold,
                              window=switch_window)
        plan = FactorizationPlan(rank_ratio, keep, max_rank_ratio=max_rank_ratio, preset=preset,
                                 keep_first=keep_first, extra_bn=extra_bn,
                                 example_input=example_input, amp_dtype=amp_dtype)
        self.switch_owner = Switch(policy, plan)
        self.on_wrap = on_wrap
        self.bucket_mb = bucket_mb
        self.parameter_swap: ParameterSwap | None = None  # what the switch did to the optimizer
        self._wrapper_checked = False

    # What the switch owner knows, under the names this class has always had.
    schedule = property(lambda self: self.switch_owner.policy.schedule)
    switch_momentum = property(lambda self: self.schedule.momentum)
    warmup_epochs = property(lambda self: self.switch_owner.policy.warmup_epochs)
    rank_ratio = property(lambda self: self.switch_owner.plan.rank_ratio)
    example_input = property(lambda self: self.switch_owner.plan.example_input)
    switched_at = property(lambda self: self.switch_owner.policy.switched_at)
    switched = property(lambda self: self.switch_owner.switched)
    detector = property(lambda self: self.switch_owner.policy.detector)
    tracker = property(lambda self: self.switch_owner.policy.tracker)
    report = property(lambda self: self.switch_owner.plan.report)
    decisions = property(lambda self: self.switch_owner.plan.decisions)

    def observe(self, t: float, model: nn.Module) -> dict[str, float]:
        """Stable ranks of the full-rank layers after ``t`` epochs; feeds the switch detector.

        For automatic choices only (else ``{}``). ``t`` may be fractional (``epoch + step /
        steps``): observing a few times per epoch lets the detector see a whole window in short
        runs. The first call records the stable ranks at initialization (Cuttlefish's reference):
        make it before training, as :meth:`on_epoch_start` does at epoch 0. Cached per ``t``.
        """
        self._check_wrapper(model)
        return self.switch_owner.observe(t, unwrapped(model))

    def should_switch(self, epoch: int, model: nn.Module) -> bool:
        """Whether to factorize at the start of ``epoch``; the same answer on every rank.

        With ``warmup_epochs="auto"``: at the first epoch boundary at or after the detector fired
        (it may fire between boundaries when observed every N steps).
        """
        self._check_wrapper(model)
        return self.switch_owner.due(epoch, unwrapped(model))

    def on_epoch_start(self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        """Call at the start of every epoch: :meth:`switch` when it is time, else nothing.

        Returns ``(model, optimizer, scheduler)``, the same objects except a DDP ``model``
        re-wrapped at the switch. The first call checks keep patterns and preset against
        ``model``; with automatic choices, epoch 0 records the stable ranks at initialization.
        """
        check_optimizer(optimizer, model)
        if self.should_switch(epoch, model):
            return self.switch(epoch, model, optimizer, scheduler)
        if self.detector is not None and epoch == 0:
            self.observe(0, model)
        return model, optimizer, scheduler

    def _check_wrapper(self, model: nn.Module) -> None:
        """At the first call: a DDP wrapper that could not be rebuilt at the switch fails now."""
        if not self._wrapper_checked and not self.switched and ddp_of(model) is not None:
            ddp_options(ddp_of(model))
        self._wrapper_checked = True

    def factorize_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """The arguments of :func:`pufferfish.factorize` this recipe uses for ``model``."""
        return self.switch_owner.plan.factorize_kwargs(unwrapped(model), self.tracker,
                                                       self.switch_owner.policy.unsettled())

    def describe_decisions(self) -> str:
        """The automatic choices of the last switch as text, for the factorization report."""
        return self.switch_owner.describe()

    def state_dict(self) -> dict[str, Any]:
        """Progress to checkpoint: switch epoch, the stable-rank record of automatic runs, and
        the factorized ranks and kernels (:meth:`pufferfish.switch.Switch.state_dict`)."""
        return self.switch_owner.state_dict()

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Restore :meth:`state_dict` (before the switch: ``model`` is still full-rank)."""
        self.switch_owner.load_state_dict(state, model)

    def switch(self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
        """Factorize ``model``; keep ``optimizer`` and ``scheduler`` (see the module docs).

        Returns ``(model, optimizer, scheduler)``: ``optimizer`` and ``scheduler`` are the same
        objects, edited in place (what changed is in :attr:`parameter_swap`); ``model`` is a new
        wrapper when it was a DDP wrapper, else the same module (under ``torch.compile``'s
        wrapper a DDP is rebuilt in place: the compiled wrapper holds the same object).
        """
        self._check_wrapper(model)
        inner = unwrapped(model)
        sharded = fsdp.is_sharded(inner)
        if sharded and self.schedule.carry == "project":
            raise ValueError("switch_momentum 'project' is invalid on a fully_shard-ed model (it "
                             "needs each dense weight's whole momentum): allowed 'reset'")
        before = dict(inner.named_parameters(remove_duplicate=False))
        owners = _owners(inner)
        self.switch_owner.switch(epoch, inner)
        if sharded:  # the factors sharded again: the units that hold them are rebuilt
            fsdp.shard(inner)
            before = _follow_resharded(optimizer, before, owners, _owners(inner),
                                       dict(inner.named_parameters(remove_duplicate=False)))
        # The DDP wrapper first: its construction broadcasts rank 0's factors, which the
        # optimizer's carried state (projected momentum) is then computed from on every rank.
        ddp = ddp_of(model)
        buckets = ({} if self.bucket_mb is None else bucket_overrides(
            None if self.bucket_mb == TORCH else float(self.bucket_mb)))
        if ddp is model:  # a new wrapper, returned
            model = ddp = rewrap_ddp(ddp, register_hooks=self.on_wrap is None, **buckets)
        elif ddp is not None:  # under torch.compile's wrapper, which holds it: the same object
            rebuild_ddp_in_place(ddp, register_hooks=self.on_wrap is None, **buckets)
        if ddp is not None and self.on_wrap is not None:
            self.on_wrap(ddp)
        if optimizer is not None:
            self.parameter_swap = self.carry_into(optimizer, inner, before)
        return model, optimizer, scheduler


    def carry_into(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                   before: Mapping[str, torch.Tensor]) -> ParameterSwap:
        """Edit ``optimizer`` after ``model`` (unwrapped) was switched (``before``: its named
        parameters until then): the parameters swapped in place (:func:`swap_parameters`), and
        every parameter's state what :func:`~pufferfish.switch.carry_state` says, as in
        ``pufferfish train`` (reset: all empty, survivors too; project: survivors' kept,
        factors' projected)."""
        carried = carry_state(optimizer.state, before, model, self.schedule.carry)
        swap = swap_parameters(optimizer, before,
                               dict(model.named_parameters(remove_duplicate=False)))
        if not isinstance(optimizer, torch.optim.LBFGS):  # its state is global: reset entirely
            install_state(optimizer, model, carried)
        return swap


def check_optimizer(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> None:
    """An optimizer over none of ``model``'s parameters (another model's, a copy's) would be
    edited at the switch to no effect, and then nothing trains: refused in one line."""
    if optimizer is None:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if held and not any(id(p) in held for p in unwrapped(model).parameters()):
        raise ValueError(f"optimizer {type(optimizer).__name__} holds none of the model's "
                         f"parameters ({len(held)} others): allowed an optimizer built over "
                         "this model's parameters (model.parameters())")


# --------------------------------------------------------------------------------------------
# The user's optimizer across the switch
# --------------------------------------------------------------------------------------------

@dataclass
class ParameterSwap:
    """What :func:`swap_parameters` did to an optimizer.

    Attributes:
        removed: names of the parameters taken out of the optimizer (their state deleted).
        added: name -> index of the parameter group each new parameter joined.
        notes: one line per placement that did not follow a same-kind predecessor (a parameter
            with no predecessor, an ambiguous one, one left out); empty when every new parameter
            simply took the place of the weight or bias it replaces.
    """

    removed: list[str] = field(default_factory=list)
    added: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        groups = sorted(set(self.added.values()))
        lines = [f"optimizer: {len(self.removed)} parameter(s) removed, {len(self.added)} added"
                 + (f" (to group(s) {', '.join(map(str, groups))})" if groups else "")]
        return "\n".join(lines + [f"  {note}" for note in self.notes])


def swap_parameters(optimizer: torch.optim.Optimizer, before: Mapping[str, torch.Tensor],
                    after: Mapping[str, torch.Tensor]) -> ParameterSwap:
    """Edit ``optimizer`` in place after modules of its model were replaced (e.g. by factorize).

    ``before`` and ``after`` are the model's named parameters before and after the replacement,
    ``dict(model.named_parameters(remove_duplicate=False))`` (every name, so that a tied weight is
    seen under each of its names). The optimizer object, its ``param_groups`` list, every group
    dict and every hyperparameter in it stay as they are, so an LR scheduler, a trainer or the
    user holding them keeps working and the LR schedule continues exactly. Only two things change:

    - a parameter that is gone from the model leaves its group's ``params`` list, and its
      ``optimizer.state`` entry (momentum, Adam moments, ...) is deleted: the momentum reset of
      the paper. Every other parameter keeps its state: it is the same tensor, still valid.
    - a new parameter is appended to the group of the parameter it replaces, found by module: it
      belongs to the replaced module at the deepest qualified name that prefixes its own (a
      low-rank module sits where the dense one was), and a matrix (factor, ``ndim >= 2``) joins
      the group of that module's replaced matrices, a vector (bias, norm scale, ``ndim <= 1``)
      the group of its replaced vectors: weight decay on weights but not on biases stays so.
      Without a replaced parameter of its kind it joins the group of its module's other replaced
      parameters; outside any replaced module, that of its module's other parameters, else
      group 0. A new parameter whose module was not optimized at all is left out. Each such
      decision is a line of the returned report's ``notes``.

    New parameters start without state; ``torch.optim`` optimizers create it at their next step
    (momentum from zero, Adam's step count from 0 for them alone). :class:`torch.optim.LBFGS`,
    whose state is a function of all its parameters together, is reset entirely. Optimizers that
    keep copies of their parameters elsewhere (``ZeroRedundancyOptimizer``) are not supported.
    """
    after_ids = {id(p) for p in after.values()}
    before_ids = {id(p) for p in before.values()}
    gone = {id(p): p for p in before.values() if id(p) not in after_ids}
    replaced = {name: p for name, p in before.items() if after.get(name) is not p}
    new: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in after.items():
        if id(p) not in before_ids:
            new.setdefault(id(p), (name, p))

    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    swap = ParameterSwap()
    named_once = {id(p): name for name, p in reversed(list(before.items()))}  # first name of each
    swap.removed = [named_once[i] for i in gone if i in group_of]
    appended: dict[int, list[torch.Tensor]] = {}
    for name, p in new.values():
        group = _group_for(name, p, replaced, after, group_of, swap.notes)
        if group is not None:
            swap.added[name] = group
            appended.setdefault(group, []).append(p)

    for i, group in enumerate(optimizer.param_groups):
        # Slice assignment: the same list object (LBFGS, for one, holds on to it).
        group["params"][:] = [p for p in group["params"] if id(p) not in gone] + appended.get(i, [])
    for p in gone.values():
        optimizer.state.pop(p, None)
    if isinstance(optimizer, torch.optim.LBFGS):
        optimizer.state.clear()
        optimizer._numel_cache = None  # type: ignore[attr-defined]
    return swap


def _owners(model: nn.Module) -> dict[str, int]:
    """Parameter name -> id of the module holding it."""
    return {f"{prefix}.{n}".lstrip("."): id(m)
            for prefix, m in model.named_modules(remove_duplicate=False)
            for n, _ in m.named_parameters(recurse=False)}


def _follow_resharded(optimizer: torch.optim.Optimizer | None,
                      before: Mapping[str, torch.Tensor], owners_before: Mapping[str, int],
                      owners_after: Mapping[str, int], after: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """A parameter of a module that stayed (its FSDP2 unit rebuilt around it) is a new shard of
    the same values: it takes its predecessor's place in the optimizer, with its state (same mesh
    and placement, so the state's shards fit). Returns ``before`` with these new tensors, for
    :func:`swap_parameters`, which then sees only the replaced layers."""
    moved = {id(p): after[n] for n, p in before.items()
             if n in after and after[n] is not p and owners_after.get(n) == owners_before[n]}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"][:] = [moved.get(id(p), p) for p in group["params"]]
        for p in [p for p in optimizer.state if id(p) in moved]:
            optimizer.state[moved[id(p)]] = optimizer.state.pop(p)
    return {n: moved.get(id(p), p) for n, p in before.items()}


def _group_for(name: str, param: torch.Tensor, replaced: Mapping[str, torch.Tensor],
               after: Mapping[str, torch.Tensor], group_of: Mapping[int, int],
               notes: list[str]) -> int | None:
    """The group index a new parameter joins (see :func:`swap_parameters`), None: left out."""
    kind = "matrix" if param.dim() >= 2 else "vector"
    owners = [m for m in {n.rpartition(".")[0] for n in replaced} if _within(name, m)]
    if not owners:  # not inside a replaced module
        module = name.rpartition(".")[0]
        siblings = sorted({group_of[id(p)] for n, p in after.items()
                           if n.rpartition(".")[0] == module and id(p) in group_of})
        group = siblings[0] if siblings else 0
        notes.append(f"{name}: no replaced predecessor; joined group {group} "
                     + (f"with module {module!r}'s other parameters" if siblings
                        else "(its module has no other optimized parameter)"))
        return group
    owner = max(owners, key=len)
    predecessors = {n: p for n, p in replaced.items() if n.rpartition(".")[0] == owner}
    optimized = {n: group_of[id(p)] for n, p in predecessors.items() if id(p) in group_of}
    if not optimized:
        notes.append(f"{name}: left out, as {owner or 'the model'}'s replaced parameters "
                     f"({', '.join(predecessors)}) were not in the optimizer")
        return None
    if name in optimized:  # the same name, a new tensor (e.g. a low-rank LSTM's biases)
        return optimized[name]
    same_kind = {n: g for n, g in optimized.items()
                 if (predecessors[n].dim() >= 2) == (kind == "matrix")}
    choice = same_kind or optimized
    group = next(iter(choice.values()))
    if not same_kind:
        notes.append(f"{name}: no replaced {kind} in {owner!r}; joined group {group} of "
                     f"{', '.join(choice)}")
    elif len(set(choice.values())) > 1:
        notes.append(f"{name}: the replaced {kind}s of {owner!r} were in groups "
                     f"{sorted(set(choice.values()))}; joined group {group} of {next(iter(choice))}")
    return group


def _within(name: str, module: str) -> bool:
    return module == "" or name.startswith(module + ".")




def _check_arguments(args: Mapping[str, Any]) -> None:
    """Every argument of :class:`Recipe` in range, or ValueError naming it and what is allowed."""
    def bad(name: str, allowed: str) -> ValueError:
        return ValueError(f"{name} {args[name]!r} is invalid: allowed {allowed}")

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
            value)

    def ratio(value: Any) -> bool:
        return number(value) and 0 < value <= 1

    warmup = args["warmup_epochs"]
    if warmup != "auto" and not (isinstance(warmup, int) and not isinstance(warmup, bool)
                                 and warmup >= 0):
        raise bad("warmup_epochs", "an integer >= 0 or 'auto'")
    if args["rank_ratio"] != "auto" and not ratio(args["rank_ratio"]):
        raise bad("rank_ratio", "a number in (0, 1] or 'auto'")
    if args["max_rank_ratio"] is not None and not ratio(args["max_rank_ratio"]):
        raise bad("max_rank_ratio", "a number in (0, 1] or None")
    keep = args["keep"]
    if not isinstance(keep, str) and (not isinstance(keep, Iterable) or not all(
            isinstance(p, str) for p in keep)):
        raise bad("keep", "'auto', a glob pattern or a list of glob patterns (strings)")
    if keep == "auto" and args["example_input"] is None:
        raise ValueError("keep='auto' needs an example_input to profile the layers: pass "
                         "example_input=<a batch>")
    if args["preset"] is not None and not isinstance(args["preset"], str):
        raise bad("preset", "a preset name (string) or None")
    first = args["keep_first"]
    if not (isinstance(first, int) and not isinstance(first, bool) and first >= 0):
        raise bad("keep_first", "an integer >= 0")
    if not isinstance(args["extra_bn"], bool):
        raise bad("extra_bn", "True or False")
    if args["amp_dtype"] not in (None, torch.float16, torch.bfloat16):
        raise bad("amp_dtype", "torch.float16, torch.bfloat16 or None")
    if args["on_wrap"] is not None and not callable(args["on_wrap"]):
        raise bad("on_wrap", "a callable taking the new DistributedDataParallel, or None")
    if not (number(args["min_warmup"]) and args["min_warmup"] >= 0):
        raise bad("min_warmup", "a number of epochs >= 0")
    high = args["max_warmup"]
    if high is not None and not number(high):
        raise bad("max_warmup", "None or a number of epochs")
    detector = "auto" in (warmup, args["rank_ratio"])  # the only user of min/max_warmup
    if detector and high is not None and high < args["min_warmup"]:
        raise bad("max_warmup", f"None or a number of epochs >= min_warmup ({args['min_warmup']})")
    if not (number(args["switch_threshold"]) and args["switch_threshold"] >= 0):
        raise bad("switch_threshold", "a number >= 0 (relative change per epoch)")
    if not (number(args["switch_window"]) and args["switch_window"] > 0):
        raise bad("switch_window", "a number of epochs > 0")
    if args["switch_momentum"] not in ("auto", "reset", "project"):
        raise bad("switch_momentum", "'reset', 'project' or 'auto' (= 'reset')")
    bucket_mb = args["bucket_mb"]
    with_none = "None, 'torch' or a bucket cap in MiB > 0"
    if bucket_mb is not None and (bucket_mb == AUTO or isinstance(bucket_mb, bool)):
        raise bad("bucket_mb", with_none + " ('auto' times real steps: pufferfish train)")
    if bucket_mb is not None:
        try:
            parse_bucket_mb(bucket_mb)
        except ValueError:
            raise bad("bucket_mb", with_none) from None
