"""``--mode prune``: structured channel pruning, Network Slimming / Early-Bird style.

Liu et al. (ICCV 2017) train with an L1 penalty on the BatchNorm scales γ so that unimportant
channels get |γ| near zero, then remove the channels with the smallest |γ| and fine-tune; You et
al. (ICLR 2020, "Early-Bird tickets") showed the cut can be made early in training. Here: the
penalty ``slim_l1 · Σ|γ|`` is added to the loss for the epochs before ``prune_epoch`` (default
half of them); at the start of ``prune_epoch`` the channels are ranked globally by |γ| and the
lowest are removed, ``prune_ratio`` of them or as many as it takes to get at or below
``target_params``; the remaining epochs fine-tune the thinner network (fresh optimizer, the LR
schedule continues). Total cost: ``epochs`` epochs, like full-rank training.

Unlike the lottery ticket, the result is a genuinely smaller dense network: fewer parameters, fewer
MACs, less latency and fewer gradient bytes for DDP to all-reduce.

The surgery uses Torch-Pruning's dependency graph (Fang et al., CVPR 2023): channels coupled by a
residual addition (the stem, every block's second conv and the projection shortcuts of a ResNet
stage) form one group and are removed together, with the input channels of every consumer. The
ranking is ours: a channel's score is the mean |γ| over the BatchNorms of its group; groups without
a BatchNorm (VGG's hidden Linear layers) and the output layer are never pruned; every group keeps at
least one channel. Ties (the all-ones γ of an untrained network) are cut evenly across groups,
and the order is total, so every DDP rank and every resume picks the same plan.
The plan (root module name -> removed channel indices) is the method's state: replaying it on the
freshly built network rebuilds the same architecture before the checkpoint's weights are loaded.

Why not Torch-Pruning's own ``MetaPruner`` with ``BNScaleImportance``: its global threshold
(``importance <= k-th smallest``) cuts a tied group all at once or, past its ratio cap, not at all
(an untrained network is not thinned), it normalizes scores per group by default where Network
Slimming ranks raw |γ|, and it has no parameter target. Two traps of ``build_dependency`` that
:func:`_graph` guards against: it leaves the model in eval mode, and it needs autograd enabled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..config import ConfigError, TrainConfig
from ..lowrank.counting import count_params
from ..method import FullRankMethod
from ..training.methods.base import Change
from .common import output_layer_name

__all__ = ["Plan", "SlimmingMethod", "apply_plan", "choose_plan", "params_after", "zero_channels"]

Plan = list[list[Any]]  # [[root module name, [removed output-channel indices]], ...]


def _graph(model: nn.Module, example_input: Any) -> Any:
    """Torch-Pruning's dependency graph of ``model``, traced without disturbing its state.

    ``build_dependency`` runs a forward pass and leaves the model in eval mode; the training flags
    are put back (and eval mode during the trace keeps BatchNorm statistics untouched).
    """
    try:
        import torch_pruning as tp
    except ImportError:
        raise ConfigError("mode 'prune' needs Torch-Pruning: pip install 'torch-pruning>=1.6'") from None

    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.enable_grad():  # the trace follows autograd's graph
            return tp.DependencyGraph().build_dependency(model, example_inputs=example_input)
    finally:
        for m, training in flags:
            m.training = training


def _groups(graph: Any, model: nn.Module) -> list[tuple[str, nn.Module, list[tuple[Any, list[int]]]]]:
    """(root name, root module, [(dependency, indices)]) of every channel group, full width."""
    output = model.get_submodule(output_layer_name(model))
    names = {id(m): name for name, m in model.named_modules()}
    found = []
    for group in graph.get_all_groups(ignored_layers=[output],
                                      root_module_types=(nn.Conv2d, nn.Linear)):
        root = group[0].dep.target.module
        found.append((names[id(root)], root, [(d.dep, list(d.idxs)) for d in group]))
    return found


def _out_fn(graph: Any, module: nn.Module) -> Any:
    return graph.get_pruner_of_module(module).prune_out_channels


def _bn_deps(graph: Any, deps: list[tuple[Any, list[int]]]) -> list[tuple[_BatchNorm, list[int]]]:
    return [(dep.target.module, idxs) for dep, idxs in deps
            if isinstance(dep.target.module, _BatchNorm) and graph.is_out_channel_pruning_fn(dep.handler)]


def choose_plan(model: nn.Module, example_input: Any, ratio: float = 0.5,
                target_params: int = 0) -> Plan:
    """The channels to remove: the lowest mean |γ| globally, to ``ratio`` or ``target_params``.

    With ``target_params`` the number of removed channels is the smallest whose network has at most
    that many parameters (found by bisection on exact counts, see :func:`params_after`); if even
    the most that may go (all but one channel per group) leaves more, that is the plan.
    """
    graph = _graph(model, example_input)
    candidates = []  # (score, position in the group, group index, channel)
    groups = []
    for name, root, deps in _groups(graph, model):
        bns = _bn_deps(graph, deps)
        if not bns or all(bn.weight is None for bn, _ in bns):
            continue  # no BatchNorm scale to rank this group by
        gi = len(groups)
        channels = len(bns[0][1])
        score = torch.stack([bn.weight.detach().abs().float().cpu()[idxs]
                             for bn, idxs in bns if bn.weight is not None]).mean(0)
        groups.append((name, root, channels))
        candidates += [(float(score[c]), c / channels, gi, c) for c in range(channels)]
    # Ties (e.g. the all-ones γ of an untrained network) are cut evenly across groups, by
    # relative position, rather than emptying the first groups; the order is total, so the plan
    # is deterministic.
    candidates.sort()

    def plan_for(n: int) -> Plan:
        removed: dict[int, list[int]] = {}
        for _, _, gi, c in candidates:
            if n == 0:
                break
            if len(removed.get(gi, [])) < groups[gi][2] - 1:  # keep one channel per group
                removed.setdefault(gi, []).append(c)
                n -= 1
        return [[groups[gi][0], sorted(idxs)] for gi, idxs in sorted(removed.items())]

    most = sum(channels - 1 for _, _, channels in groups)
    if not target_params:
        return plan_for(min(most, round(ratio * len(candidates))))
    lo, hi = 0, most  # smallest n with params_after(plan_for(n)) <= target
    if _count(graph, model, plan_for(hi)) > target_params:
        return plan_for(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if _count(graph, model, plan_for(mid)) <= target_params:
            hi = mid
        else:
            lo = mid + 1
    return plan_for(lo)


def params_after(model: nn.Module, example_input: Any, plan: Plan) -> int:
    """The parameter count ``model`` would have after ``plan``, computed without changing it."""
    return _count(_graph(model, example_input), model, plan)


def _count(graph: Any, model: nn.Module, plan: Plan) -> int:
    """Exact count from the new shapes of the conv, linear and BatchNorm layers the plan touches."""
    cut_out: dict[nn.Module, set[int]] = {}
    cut_in: dict[nn.Module, set[int]] = {}
    for name, idxs in plan:
        root = model.get_submodule(name)
        for d in graph.get_pruning_group(root, _out_fn(graph, root), idxs):
            side = cut_out if graph.is_out_channel_pruning_fn(d.dep.handler) else cut_in
            side.setdefault(d.dep.target.module, set()).update(int(i) for i in d.idxs)
    total = count_params(model)
    for module in set(cut_out) | set(cut_in):
        if not isinstance(module, nn.Conv2d | nn.Linear | _BatchNorm):
            if any(True for _ in module.parameters(recurse=False)):
                raise NotImplementedError(f"cannot count the pruned size of {type(module).__name__}")
            continue
        n_out, n_in = len(cut_out.get(module, ())), len(cut_in.get(module, ()))
        before = sum(p.numel() for p in module.parameters(recurse=False))
        if isinstance(module, _BatchNorm):
            after = before // module.num_features * (module.num_features - n_out)
        elif isinstance(module, nn.Linear):
            after = (module.out_features - n_out) * (module.in_features - n_in)
            after += 0 if module.bias is None else module.out_features - n_out
        else:
            k = module.weight[0, 0].numel()
            out_c, in_c = module.out_channels - n_out, module.in_channels - n_in
            after = out_c * (in_c // module.groups) * k + (0 if module.bias is None else out_c)
        total -= before - after
    return total


def apply_plan(model: nn.Module, example_input: Any, plan: Plan) -> None:
    """Physically remove the plan's channels (and their consumers' input channels), in place."""
    if not plan:
        return
    graph = _graph(model, example_input)
    for name, idxs in plan:
        root = model.get_submodule(name)
        graph.get_pruning_group(root, _out_fn(graph, root), list(idxs)).prune()


def zero_channels(model: nn.Module, example_input: Any, plan: Plan) -> None:
    """Zero γ and β of the plan's channels in every BatchNorm of their groups, keeping shapes.

    Each such channel then outputs exactly zero (also through residual additions, whose every
    term is zeroed), so the masked network computes what the pruned one does: the check that the
    surgery removed the right channels.
    """
    graph = _graph(model, example_input)
    for name, idxs in plan:
        root = model.get_submodule(name)
        for d in graph.get_pruning_group(root, _out_fn(graph, root), list(idxs)):
            module = d.dep.target.module
            if isinstance(module, _BatchNorm) and graph.is_out_channel_pruning_fn(d.dep.handler):
                with torch.no_grad():
                    module.weight[list(d.idxs)] = 0
                    module.bias[list(d.idxs)] = 0


class SlimmingMethod(FullRankMethod):
    """L1 on BatchNorm scales, one global channel cut at ``prune_epoch``, then fine-tuning."""

    name = "prune"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.at = cfg.prune_epoch if cfg.prune_epoch >= 0 else cfg.epochs // 2
        self.example_input: Any = None
        self.plan: Plan = []
        self.pruned = False

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        self.example_input = example_input

    def extra_loss(self, model: nn.Module) -> torch.Tensor | None:
        """``slim_l1 · Σ|γ|`` over all BatchNorms, until the cut (the sparsity-training phase)."""
        if self.pruned or self.cfg.slim_l1 == 0:
            return None
        scales = [m.weight.abs().sum() for m in model.modules()
                  if isinstance(m, _BatchNorm) and m.weight is not None]
        return self.cfg.slim_l1 * torch.stack(scales).sum() if scales else None

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        if self.pruned or epoch != self.at:
            return None
        before = count_params(model)
        self.plan = choose_plan(model, self.example_input, self.cfg.prune_ratio,
                                self.cfg.target_params)
        apply_plan(model, self.example_input, self.plan)
        self.pruned = True
        after = count_params(model)
        removed = sum(len(idxs) for _, idxs in self.plan)
        goal = (f"target {self.cfg.target_params:,} parameters" if self.cfg.target_params
                else f"ratio {self.cfg.prune_ratio}")
        text = (f"network slimming at epoch {epoch}: removed {removed:,} channels by |γ| ({goal}); "
                f"parameters {before:,} -> {after:,} ({before / max(1, after):.2f}x fewer)")
        return Change("channel-pruning", text, {
            "epoch": epoch, "params_before": before, "params_after": after,
            "channels_removed": removed, "plan": self.plan,
            "target_params": self.cfg.target_params, "prune_ratio": self.cfg.prune_ratio})

    def on_epoch_end(self, epoch: int, model: nn.Module) -> dict[str, Any]:
        return {"pruned": self.pruned, "prune_epoch": self.at, "cost_epochs": epoch + 1}

    def state_dict(self) -> dict[str, Any]:
        return {"pruned": self.pruned, "plan": [[name, list(idxs)] for name, idxs in self.plan]}

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Replay the saved plan on the freshly built model: the checkpoint's shapes, exactly."""
        self.plan = [[name, [int(i) for i in idxs]] for name, idxs in state["plan"]]
        self.pruned = bool(state["pruned"])
        apply_plan(model, self.example_input, self.plan)
