"""The way back from low rank: ``merge`` to dense modules, ``load_factorized`` from a saved state.

``load_factorized`` rebuilds the factorized structure that a ``state_dict``'s keys and shapes say.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .base import LowRankModule, low_rank_class_for
from .factorize import find_candidates
from .selection import ModuleIndex
from .swap import carry_over, swapped

__all__ = ["load_factorized", "merge"]


def merge(model: nn.Module) -> nn.Module:
    """Turn every low-rank module of ``model`` back into its dense equivalent, in place.

    Returns ``model`` (or the dense module when ``model`` itself is low-rank).
    """
    if isinstance(model, LowRankModule):
        dense = model.to_dense()
        carry_over(model, dense)
        return dense
    modules = {id(m): m for m in model.modules() if isinstance(m, LowRankModule)}
    index = ModuleIndex(model)
    replacements = []
    for module in modules.values():
        dense = module.to_dense()
        carry_over(module, dense)
        replacements.append((module, dense, index.names(module)))
    with swapped(model, replacements):  # every merge built first: all or nothing
        pass
    return model


def load_factorized(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """Load a factorized model's ``state_dict`` into a freshly built dense ``model``; return it.

    Which modules are low-rank, and at which rank, is read from ``state_dict``: a module whose
    entries are not its dense ones (``fc.u.weight``/``fc.v.weight`` instead of ``fc.weight``) is
    rebuilt by its low-rank class at the rank of those factors (``rank_from_state_dict``), then
    every value is loaded, strictly: a key missing or left over, or a shape that does not fit, is a
    ``ValueError`` and leaves ``model`` as it was. The one tolerance is a tied parameter saved under
    one of its names only (Hugging Face ``save_pretrained`` drops ``lm_head.weight``).

    The way to reload a model saved factorized: build it as before (``Model(config)``), then
    ``load_factorized(model, torch.load(path, weights_only=True))`` or
    ``safetensors.torch.load_file(path)``.
    """
    index = ModuleIndex(model)
    candidates, _ = find_candidates(model)
    replacements = []
    for module in candidates:
        names = index.names(module)
        prefix = names[0] + "."
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if not set(own) - set(module.state_dict()):
            continue  # dense entries (or none: the strict check below reports them)
        cls = low_rank_class_for(module)
        assert cls is not None
        try:
            rank, options = cls.rank_from_state_dict(own)
        except KeyError:
            raise ValueError(f"state_dict entries of {names[0]!r} ({', '.join(sorted(own))}) fit "
                             f"neither a dense {type(module).__name__} nor a {cls.__name__}"
                             ) from None
        low = cls.from_dense(module, min(rank, cls.full_rank(module)), **options)
        carry_over(module, low)
        replacements.append((module, low, names))
    with swapped(model, replacements):
        _check_loadable(model, state_dict)
        model.load_state_dict(state_dict, strict=False)  # every key checked just above
    return model


def _check_loadable(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` fits ``model`` exactly (tied aliases aside)."""
    expected = model.state_dict(keep_vars=True)
    holders: dict[int, set[str]] = {}
    for key, value in expected.items():
        holders.setdefault(id(value), set()).add(key)
    missing = [k for k in expected if k not in state_dict
               and not any(alias in state_dict for alias in holders[id(expected[k])])]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [f"{k} {tuple(state_dict[k].shape)} != {tuple(expected[k].shape)}"
             for k in state_dict if k in expected and state_dict[k].shape != expected[k].shape]
    problems = [f"{what}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected),
                                   ("wrong shape", wrong)) if keys]
    if problems:
        raise ValueError(f"state_dict does not fit {type(model).__name__} (rebuilt low-rank "
                         f"where its factors say so): {'; '.join(problems)}")
