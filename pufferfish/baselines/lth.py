"""``--mode lth``: the Lottery Ticket baseline, iterative magnitude pruning with rewinding.

Frankle & Carbin (ICLR 2019), with the "late rewinding" of Frankle et al. (ICML 2020): train a
round of ``epochs`` epochs; at its end remove ``prune_rate`` (20%) of the *remaining* prunable
weights by global magnitude; set every surviving value (weights, biases, BatchNorm parameters and
statistics) back to what it was after ``rewind_epoch`` epochs of the first round (0: the initial
weights); restart the LR schedule with a fresh optimizer; repeat. ``L`` rounds of pruning cost
``(L + 1) · epochs`` epochs of training in all, which is the price of the method and what
``cost_epochs`` in the metrics rows counts.

Prunable: the weights of every conv and linear layer except the output layer (``lth_exclude``,
default the model's last Linear); biases and BatchNorm are never pruned. Masks are applied with
``torch.nn.utils.prune`` (``weight_orig * weight_mask``), so pruned weights are exactly zero in every
forward pass whatever the optimizer does to ``weight_orig``.

What is *not* gained: the network keeps its dense shapes. The ``params`` column counts the
*nonzero* parameters, but ``macs`` (and wall time, and the bytes DDP all-reduces: the gradient of
``weight_orig`` is dense) are those of the dense network, because dense kernels multiply the
zeros too; only sparse kernels, which this package does not use, could turn the sparsity into speed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

from ..config import ConfigError, TrainConfig
from ..lowrank.counting import count_params
from ..lowrank.selection import ModuleIndex
from ..method import FullRankMethod
from ..training.methods.base import Change
from .common import output_layer_name

__all__ = ["LotteryTicketMethod", "prunable_modules", "prune_global", "round_counts"]

DEFAULT_ROUNDS = 3
_PRUNABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def prunable_modules(model: nn.Module, exclude: list[str] | None = None) -> dict[str, nn.Module]:
    """Name -> module for every conv/linear layer whose weight LTH may prune.

    ``exclude``: globs of module names left dense (empty or None: the output layer only); a glob
    matching no module is an error (:mod:`pufferfish.lowrank.selection`).
    """
    excluded = ModuleIndex(model).select(exclude) if exclude else {output_layer_name(model)}
    skip = tuple(f"{name}." for name, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention))  # its out_proj is not called as a module
    return {name: m for name, m in model.named_modules()
            if isinstance(m, _PRUNABLE) and name not in excluded
            and not (skip and name.startswith(skip))}


def round_counts(prunable: int, rate: float, rounds: int, keep: int | None) -> list[int]:
    """How many weights each pruning round removes.

    Each round removes ``round(rate · remaining)``. With a target (``keep`` prunable weights left)
    the rounds continue until it is reached, the last one removing only what is left to reach it
    exactly; ``rounds`` (when > 0) caps their number. Without a target there are ``rounds`` rounds
    (default 3).
    """
    counts: list[int] = []
    remaining = prunable
    if keep is None:
        for _ in range(rounds or DEFAULT_ROUNDS):
            n = round(rate * remaining)
            counts.append(n)
            remaining -= n
        return counts
    while remaining > keep and (rounds == 0 or len(counts) < rounds):
        n = min(max(1, round(rate * remaining)), remaining - keep)
        counts.append(n)
        remaining -= n
    return counts


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight the forward pass uses (``weight_orig · weight_mask`` once pruned)."""
    if hasattr(module, "weight_mask"):
        return module.weight_orig * module.weight_mask
    return module.weight


@torch.no_grad()
def prune_global(modules: dict[str, nn.Module], n: int) -> dict[str, torch.Tensor]:
    """Remove the ``n`` smallest-magnitude *surviving* weights over all ``modules`` together.

    Exactly ``n`` go (a stable sort breaks ties by position, so the choice is deterministic, the
    same on every DDP rank and on resume). Returns the new masks (bool) by module name; the first
    pruning of a module installs ``torch.nn.utils.prune``'s reparametrization, later ones update its
    ``weight_mask`` buffer in place.
    """
    weights = {name: effective_weight(m).detach() for name, m in modules.items()}
    alive = {name: (m.weight_mask.bool() if hasattr(m, "weight_mask")
                    else torch.ones_like(weights[name], dtype=torch.bool))
             for name, m in modules.items()}
    scores = torch.cat([weights[name].abs()[alive[name]].flatten().float() for name in modules])
    if not 0 <= n <= scores.numel():
        raise ValueError(f"cannot prune {n} of {scores.numel()} surviving weights")
    keep_flat = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    keep_flat[torch.argsort(scores, stable=True)[:n]] = False
    masks: dict[str, torch.Tensor] = {}
    offset = 0
    for name, module in modules.items():
        mask = alive[name].clone()
        count = int(mask.sum())
        mask[alive[name]] = keep_flat[offset:offset + count]
        offset += count
        apply_mask(module, mask)
        masks[name] = mask
    return masks


def apply_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Make ``module.weight = weight_orig · mask`` (installing the reparametrization if needed)."""
    if hasattr(module, "weight_mask"):
        module.weight_mask.copy_(mask.to(module.weight_mask.dtype))
        with torch.no_grad():
            module.weight = module.weight_orig * module.weight_mask
    else:
        prune.custom_from_mask(module, "weight", mask.to(module.weight.device))


class LotteryTicketMethod(FullRankMethod):
    """Iterative magnitude pruning with rewinding (see the module docstring)."""

    name = "lth"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.modules: dict[str, nn.Module] = {}
        self.counts: list[int] = []  # weights removed at the start of round 1, 2, ...
        self.prunable = 0  # prunable weights of the dense model
        self.masks: dict[str, torch.Tensor] = {}
        self.rewind: dict[str, torch.Tensor] = {}
        self.round = 0

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        self.modules = prunable_modules(model, cfg.lth_exclude)
        self.prunable = sum(m.weight.numel() for m in self.modules.values())
        keep = None
        if cfg.target_params:
            total = count_params(model)
            keep = cfg.target_params - (total - self.prunable)
            if keep <= 0:
                raise ConfigError(
                    f"target_params {cfg.target_params:,} is unreachable by lth: the "
                    f"{total - self.prunable:,} parameters it never prunes exceed it")
            keep = min(keep, self.prunable)
        self.counts = round_counts(self.prunable, cfg.prune_rate, cfg.rounds, keep)

    @property
    def rounds(self) -> int:
        return len(self.counts)

    def total_epochs(self, cfg: TrainConfig) -> int:
        return (self.rounds + 1) * cfg.epochs

    def schedule_step(self, global_step: int, steps_per_epoch: int) -> int:
        """Every round restarts the LR schedule from its first step."""
        return global_step % (self.cfg.epochs * steps_per_epoch)

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        if epoch == self.cfg.rewind_epoch and not self.rewind:
            self.rewind = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if epoch == 0 or epoch % self.cfg.epochs:
            return None
        r = epoch // self.cfg.epochs
        n = self.counts[r - 1]
        self.masks = prune_global(self.modules, n)
        rewind_to(model, self.rewind)
        self.round = r
        density = self.alive() / self.prunable
        params = self.nonzero_params(model)
        text = (f"LTH round {r}/{self.rounds} at epoch {epoch}: pruned {n:,} weights by global "
                f"magnitude, {self.alive():,} of {self.prunable:,} prunable weights left (density "
                f"{density:.4f}), {params:,} nonzero parameters; rewound to epoch "
                f"{self.cfg.rewind_epoch}, LR schedule restarted")
        return Change(f"prune-round-{r}", text, {
            "round": r, "epoch": epoch, "pruned": n, "density": density, "params": params,
            "rewind_epoch": self.cfg.rewind_epoch,
            "layer_density": {name: float(m.float().mean()) for name, m in self.masks.items()}})

    def alive(self) -> int:
        """Prunable weights still unmasked."""
        pruned = sum(int((~m).sum()) for m in self.masks.values())
        return self.prunable - pruned

    def nonzero_params(self, model: nn.Module) -> int:
        """All parameters minus the masked weights (what a sparse format would have to store)."""
        return count_params(model) - (self.prunable - self.alive())

    def on_epoch_end(self, epoch: int, model: nn.Module) -> dict[str, Any]:
        return {"round": epoch // self.cfg.epochs, "density": self.alive() / self.prunable,
                "cost_epochs": epoch + 1, "params": self.nonzero_params(model),
                "dense_params": count_params(model)}

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "counts": list(self.counts),
                "masks": {k: v.cpu() for k, v in self.masks.items()},
                "rewind": {k: v.cpu() for k, v in self.rewind.items()}}

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Re-install the saved masks so the checkpoint's ``weight_orig``/``weight_mask`` fit."""
        if list(state["counts"]) != self.counts:
            raise ConfigError(f"lth schedule {self.counts} differs from the checkpoint's "
                              f"{list(state['counts'])}: rounds/prune_rate/target_params changed")
        for name, mask in state["masks"].items():
            apply_mask(self.modules[name], mask.bool())
        self.masks = {k: v.bool() for k, v in state["masks"].items()}
        device = next(model.parameters()).device
        self.rewind = {k: v.to(device) for k, v in state["rewind"].items()}
        self.round = int(state["round"])


@torch.no_grad()
def rewind_to(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Set every parameter and buffer (masks excepted) to its saved value.

    ``saved`` was taken from the dense model, so a pruned weight's saved ``<m>.weight`` goes into
    ``<m>.weight_orig``; masked entries of ``weight_orig`` get their saved values too, which is
    harmless: the mask zeroes them.
    """
    current = model.state_dict()
    for key, value in saved.items():
        target = key if key in current else key + "_orig"
        if target not in current:
            raise KeyError(f"cannot rewind {key!r}: the model has no such parameter or buffer")
        current[target].copy_(value)
    for module in model.modules():
        if hasattr(module, "weight_mask"):
            module.weight = module.weight_orig * module.weight_mask
