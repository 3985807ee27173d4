"""Adam's second moment at the switch: is the projected one the factors' real one?

``--switch-momentum project`` gives each factor of ``W = L R`` the dense weight's Adam state
projected: the first moment by the chain rule (exact), the second ``V`` of ``W`` as ``V (R∘R)ᵀ``
and ``(L∘L)ᵀ V``, which is the factor gradients' expected square only if the entries of the
dense gradient are uncorrelated. Gradients of a layer are close to low rank, so they are not.
This measures it on a full-rank run's checkpoint (weights and Adam state): factorize as the
switch does, project the state, then take the factors' gradients on ``--batches`` training
batches at the checkpoint's weights (one process, the run's global batch) and compare, per
factor, the bias-corrected projected second moment with the mean squared gradient measured, and
with the correlated bound ``(√V |R|ᵀ)²`` (Minkowski: no correlation can exceed it). Adam's step
is ``m̂/√v̂``: a ratio r of projected to real second moment scales the first steps by ``1/√r``.

    python benchmarks/switch_moments.py runs/full/checkpoints/ckpt-000000014.pt --batches 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from pufferfish import factorize
from pufferfish.distributed.env import DistEnv
from pufferfish.switch import projected_state
from pufferfish.training.checkpoint import load_checkpoint
from pufferfish.training.optim import build_optimizer
from pufferfish.training.startup import load_run_config
from pufferfish.training.tasks import build_task


def _abs_projection(state: dict, before: dict, model: torch.nn.Module) -> dict:
    """The correlated bound: √V projected through |factors|, squared."""
    ghost = copy.deepcopy(model)
    with torch.no_grad():
        for p in ghost.parameters():
            p.abs_()
    # √V as a first moment: projected linearly (chain rule) through the |factors|
    roots = {t: {"exp_avg": s["exp_avg_sq"].sqrt()} for t, s in state.items() if "exp_avg_sq" in s}
    back = dict(zip(ghost.parameters(), model.parameters(), strict=True))
    return {back[g]: s["exp_avg"].square() for g, s in projected_state(roots, before, ghost).items()}


def _mean_squares(task: Any, model: torch.nn.Module, batches: list, params: list) -> dict:
    """Each of ``params``' mean squared gradient over ``batches`` at the model's weights."""
    squares = {p: torch.zeros_like(p) for p in params}
    for batch in batches:
        model.zero_grad()
        task.loss(model, batch).backward()
        for p in params:
            squares[p] += p.grad.square() / len(batches)
    return squares


def measure(ckpt: Path, batches: int) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """(factor name, median projected / real, median bound / real) per factor parameter, and
    per dense weight the switch replaces its own Adam second moment / real (the staleness that
    full-rank training has too)."""
    saved = load_checkpoint(ckpt)
    world = int(saved.get("world_size", 1))
    cfg = load_run_config(ckpt.parent.parent / "config.toml",
                          {"batch_size": world * saved["config"]["batch_size"]})
    task = build_task(cfg, DistEnv())
    model = task.model
    model.load_state_dict(saved["model"])
    optimizer = build_optimizer(cfg, [{"params": list(model.parameters()),
                                       "weight_decay": cfg.weight_decay}], model)
    optimizer.load_state_dict(saved["optimizer"])
    beta2 = optimizer.param_groups[0]["betas"][1]
    task.start_epoch(0)
    data = [b for _, b in zip(range(batches), task.train_loader, strict=False)]

    def ratio(v: torch.Tensor, step: Any, real: torch.Tensor) -> float:
        return float((v / (1 - beta2 ** float(step)) / real.clamp_min(1e-30)).median())

    before = dict(model.named_parameters(remove_duplicate=False))
    state = optimizer.state
    dense_squares = _mean_squares(task, model, data, [p for p in before.values() if p in state])
    factorize(model, rank_ratio=float(cfg.rank_ratio), preset="paper")
    alive = {id(p) for p in model.parameters()}
    stale = {n: ratio(state[t]["exp_avg_sq"], state[t]["step"], dense_squares[t])
             for n, t in before.items() if id(t) not in alive and t in state}
    projected = projected_state(state, before, model)
    bound = _abs_projection(state, before, model)
    squares = _mean_squares(task, model, data, list(projected))
    names = {p: n for n, p in model.named_parameters()}
    rows = [(names[p], ratio(st["exp_avg_sq"], st["step"], squares[p]),
             ratio(bound[p], st["step"], squares[p])) for p, st in projected.items()]
    return rows, stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="a full-rank AdamW run's ckpt-*.pt")
    ap.add_argument("--batches", type=int, default=8)
    args = ap.parse_args(argv)
    if not args.checkpoint.is_file():
        print(f"switch_moments: checkpoint {str(args.checkpoint)!r} is not a file: allowed a "
              "ckpt-*.pt of a full-rank AdamW run", file=sys.stderr)
        return 2
    rows, stale = measure(args.checkpoint, args.batches)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for name, proj, bound in rows:
        parts = name.split(".")
        kinds.setdefault(f"{parts[-3]}.{parts[-2]}", []).append((proj, bound))
    dense: dict[str, list[float]] = {}
    for name, value in stale.items():
        dense.setdefault(name.split(".")[-2], []).append(value)
    print(f"{args.checkpoint}: Adam's bias-corrected second moment / the mean squared gradient "
          f"measured on {args.batches} batches, median over entries, then over layers\n")
    print("| factor | projected (uncorrelated) | correlated bound | the dense weight's own |")
    print("|---|---|---|---|")
    for kind, vals in sorted(kinds.items()):
        print(f"| {kind} | {statistics.median(v for v, _ in vals):.3g} | "
              f"{statistics.median(b for _, b in vals):.3g} | "
              f"{statistics.median(dense[kind.split('.')[0]]):.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
