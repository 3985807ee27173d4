"""GaLore (Zhao et al., ICML 2024) as a method: full-rank weights, low-rank optimizer state.

The layers Pufferfish would factorize (the model's preset, ``keep``, ``keep_first``, at
``rank_ratio``) keep their dense weights, and the optimizer projects each of their 2-D weights'
gradients onto a rank-r subspace (r: the rank that layer would be factorized at), refreshed by an
SVD of the gradient every ``galore_update_proj_gap`` steps, runs Adam there, and projects the
update back scaled by ``galore_scale``; every other parameter gets plain AdamW (the decay /
no-decay groups of :mod:`pufferfish.training.optim`). DDP still ships full-size gradients.

The optimizer is ``pytorch-optimizer``'s ``GaLore``: maintained, pure PyTorch, runs on CPU. The
authors' ``galore-torch`` imports ``bitsandbytes`` (a CUDA library) at import. Its projectors
are Python objects in the optimizer state; :class:`GaLoreMethod` saves them as tensors
(``ortho_matrix``, ``last_svd_step``) so that checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, TrainConfig
from ..lowrank import factorize
from ..method import FullRankMethod
from ..training.optim import decay_split

__all__ = ["GaLoreMethod", "galore_optimizer", "galore_ranks"]


def galore_ranks(model: nn.Module, cfg: TrainConfig) -> dict[str, int]:
    """Parameter name -> projection rank: every 2-D weight of the layers ``cfg``'s switch would
    factorize, at that layer's rank (decided on a copy; ``model`` is untouched)."""
    ghost = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = factorize(ghost, rank_ratio=float(cfg.rank_ratio), keep=list(cfg.keep),
                           preset=None if cfg.preset == "none" else cfg.preset,
                           keep_first=cfg.keep_first)
    ranks: dict[str, int] = {}
    for module_name, rank in report.ranks.items():
        module = model.get_submodule(module_name)
        prefix = f"{module_name}." if module_name else ""
        for name, p in module.named_parameters():
            if p.dim() == 2:
                ranks[prefix + name] = rank
    return ranks


class GaLoreMethod(FullRankMethod):
    """Full-rank training with GaLore's optimizer on the layers Pufferfish would factorize."""

    name = "galore"
    run_fields = ("mode", "rank_ratio", "preset", "keep", "keep_first", "galore_update_proj_gap",
                  "galore_scale", "galore_proj_type")

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        _checkpointable_galore()  # the package is checked now: a missing one is exit 2
        self.ranks: dict[str, int] = {}

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        self.ranks = galore_ranks(model, cfg)
        if not self.ranks:
            raise ConfigError(f"mode 'galore' is invalid with model {cfg.model!r}: none of the "
                              "layers its preset factorizes has a 2-D weight to project; allowed "
                              "models with linear layers (transformer, llama)")

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        return galore_optimizer(model, self.ranks, cfg)

    def model_figures(self, model: nn.Module, example_input: Any) -> dict[str, Any]:
        return {**super().model_figures(model, example_input), "galore_params": len(self.ranks)}

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": dict(self.ranks)}

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        self.ranks = dict(state["ranks"])


def galore_optimizer(model: nn.Module, ranks: dict[str, int],
                     cfg: TrainConfig) -> torch.optim.Optimizer:
    """GaLore groups (one per rank, decayed) for the weights in ``ranks``, then AdamW's decay /
    no-decay groups for every other parameter; ``cfg``'s LR, betas, epsilon and GaLore keys."""
    named = dict(model.named_parameters())
    projected: dict[int, list[torch.Tensor]] = {}
    for name, rank in ranks.items():
        projected.setdefault(rank, []).append(named[name])
    chosen = {id(p) for ps in projected.values() for p in ps}
    groups = [{"params": ps, "weight_decay": cfg.weight_decay, "rank": rank,
               "update_proj_gap": cfg.galore_update_proj_gap, "scale": cfg.galore_scale,
               "projection_type": cfg.galore_proj_type}
              for rank, ps in sorted(projected.items())]
    rest = [p for p in model.parameters() if id(p) not in chosen]
    groups += decay_split([{"params": rest, "weight_decay": cfg.weight_decay}], model)
    return _checkpointable_galore()(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                    eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def _checkpointable_galore() -> type[torch.optim.Optimizer]:
    """``pytorch_optimizer.GaLore`` whose state dict holds each projector as plain tensors."""
    try:
        from pytorch_optimizer import GaLore
        from pytorch_optimizer.optimizer.utils.galore import GaLoreProjector
    except ImportError:
        raise ConfigError("mode 'galore' needs the package pytorch-optimizer, which is not "
                          "installed: pip install pytorch-optimizer (the [galore] extra)") from None

    class CheckpointableGaLore(GaLore):
        def state_dict(self) -> dict[str, Any]:
            saved = super().state_dict()
            saved["state"] = {i: {k: _projector_state(v) if k == "projector" else v
                                  for k, v in s.items()} for i, s in saved["state"].items()}
            return saved

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            projectors: dict[int, dict[str, Any]] = {}
            state: dict[int, dict[str, Any]] = {}
            for i, s in state_dict["state"].items():
                s = dict(s)
                if "projector" in s:
                    projectors[i] = s.pop("projector")
                state[i] = s
            super().load_state_dict({**state_dict, "state": state})
            owners = [(p, g) for g in self.param_groups for p in g["params"]]
            for i, saved in projectors.items():
                p, group = owners[i]
                projector = GaLoreProjector(rank=group["rank"],
                                            update_proj_gap=group["update_proj_gap"],
                                            scale=group["scale"],
                                            projection_type=group["projection_type"])
                ortho = saved["ortho_matrix"]
                projector.ortho_matrix = (tuple(t.to(p.device) for t in ortho)
                                          if isinstance(ortho, list) else ortho.to(p.device))
                projector.last_svd_step = int(saved["last_svd_step"])
                self.state[p]["projector"] = projector

    return CheckpointableGaLore


def _projector_state(projector: Any) -> dict[str, Any]:
    ortho = projector.ortho_matrix
    return {"ortho_matrix": list(ortho) if isinstance(ortho, tuple) else ortho,
            "last_svd_step": projector.last_svd_step}
