"""Module replacement by qualified name: all or nothing, and what a replacement takes over.

Used by every change of structure: ``factorize``, ``merge`` and ``load_factorized``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["carry_over", "swapped"]


@contextmanager
def swapped(model: nn.Module, replacements: list[tuple[nn.Module, nn.Module, list[str]]]
            ) -> Iterator[None]:
    """Swap each ``(old, new, names)`` in under every name; on any error inside, swap back."""
    done: list[tuple[str, nn.Module]] = []
    try:
        for old, new, names in replacements:
            for name in names:
                _replace(model, name, new)
                done.append((name, old))
        yield
    except BaseException:
        for name, old in reversed(done):
            _replace(model, name, old)
        raise


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def carry_over(old: nn.Module, new: nn.Module) -> None:
    """Give ``new``, which replaces ``old``, what ``old`` carried besides its weights.

    Train/eval mode; the memory format (channels-last 4-D weights give channels-last factors);
    ``requires_grad``: the matrices (factors) of ``new`` are trainable iff one
    of ``old``'s ≥2-D parameters is, its vectors (biases, BN) iff one of ``old``'s vectors is (its
    matrices' flag when it has none); forward and backward hooks: the hook dictionaries are taken
    over, so a handle from ``old.register_forward_hook`` still removes the hook. State-dict hooks
    are not (they depend on parameter names): a warning names the module type.
    """
    new.train(old.training)
    if _channels_last(old):
        new.to(memory_format=torch.channels_last)
    matrices = [p.requires_grad for p in old.parameters() if p.dim() >= 2]
    vectors = [p.requires_grad for p in old.parameters() if p.dim() < 2]
    train_matrices = any(matrices) if matrices else True
    train_vectors = any(vectors) if vectors else train_matrices
    for p in new.parameters():
        p.requires_grad_(train_matrices if p.dim() >= 2 else train_vectors)
    for attr in _HOOK_DICTS:
        setattr(new, attr, getattr(old, attr))
    if any(getattr(old, attr) for attr in _STATE_DICT_HOOKS):
        warnings.warn(f"the state_dict hooks of {type(old).__name__} are not carried over to its "
                      f"{type(new).__name__} replacement", stacklevel=3)


def _channels_last(module: nn.Module) -> bool:
    """Whether a 4-D parameter of ``module`` is stored channels-last (and not also contiguous:
    a weight with one input channel or a 1x1 kernel is both, and says nothing)."""
    return any(p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)
               and not p.is_contiguous() for p in module.parameters())


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_is_full_backward_hook")


_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")
