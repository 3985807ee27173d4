"""Refuse, before anything is written, a state that ``torch.load(weights_only=True)`` could not
read back, naming the key: a run never discovers at resume time that its checkpoints are
unloadable. What is allowed is listed in the package docstring."""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError

_LEAF_TYPES = (
    type(None), bool, int, float, complex, str, bytes, bytearray,
    torch.dtype, torch.device, torch.Size,
)
_DICT_TYPES = (dict, OrderedDict, Counter)
_SEQ_TYPES = (list, tuple, set)


def _key_path(parent: str, key: Any) -> str:
    return f"{parent}[{key!r}]"


def check_weights_only_safe(obj: Any, where: str = "state", _seen: set[int] | None = None) -> None:
    """Refuse values ``torch.load(weights_only=True)`` could not read back, naming the key."""
    if _seen is None:
        _seen = set()
    t = type(obj)
    if t in _LEAF_TYPES:
        return
    if t is torch.Tensor or t is nn.Parameter:
        return
    if id(obj) in _seen:
        return
    if t in _DICT_TYPES:
        _seen.add(id(obj))
        for k, v in obj.items():
            if type(k) not in _LEAF_TYPES:
                raise CheckpointError(
                    f"cannot save {where}: key {k!r} has type {t.__module__}.{type(k).__qualname__}; "
                    "use str/int keys"
                )
            check_weights_only_safe(v, _key_path(where, k), _seen)
        return
    if t in _SEQ_TYPES:
        _seen.add(id(obj))
        for i, v in enumerate(obj):
            check_weights_only_safe(v, _key_path(where, i), _seen)
        return
    raise CheckpointError(
        f"cannot save {where}: {t.__module__}.{t.__qualname__} would not load with "
        f"torch.load(weights_only=True); {_conversion_hint(obj)}"
    )


def _conversion_hint(obj: Any) -> str:
    mod = type(obj).__module__ or ""
    if mod.startswith("numpy"):
        return "convert numpy values (float(x), int(x), torch.from_numpy(a))"
    if isinstance(obj, torch.Tensor):
        return "convert the tensor subclass to a plain tensor (t.as_subclass(torch.Tensor))"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "convert the namedtuple with ._asdict() or tuple(x)"
    if isinstance(obj, Mapping):
        return "convert the mapping with dict(x)"
    if isinstance(obj, os.PathLike):
        return "store the path as str(x)"
    if callable(obj):
        return "callables cannot be stored; store a name or config instead"
    return "convert it to plain dicts/lists/numbers/strings/tensors"
