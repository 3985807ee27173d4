"""Named choices of full-rank layers (``preset="paper"``), found on the model or by its class name.

A preset is ``{"keep": [patterns]}``, and may name the model's own warm-up (``"warmup_epochs"``,
what the trainer callbacks use when the user gives none: LLaMA-style decoders train low rank
from the start).

A model class may carry its own ``PRESETS`` (the models in :mod:`pufferfish.models` do). A
library's class cannot, so presets for it are registered here by class name. Hugging Face's
LLaMA-style decoders (``LlamaForCausalLM`` and the families with the same module names) take the
presets of our ``llama`` model, whose module names follow HF's; they are named by module path and
imported when first asked for (as :mod:`pufferfish.modes` names the methods), because
``lowrank/`` sits below ``models/``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

__all__ = ["DEFAULT_PRESET", "presets_of", "register_presets", "resolve_preset"]

Presets = dict[str, dict[str, Any]]

DEFAULT_PRESET = "default"  # the model's "paper" preset when it has one (own or by class name)

_LLAMA = "pufferfish.models.llama:Llama"
_BY_CLASS_NAME: dict[str, Presets | str] = {
    name: _LLAMA for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
}


def register_presets(class_name: str, presets: Presets | str) -> None:
    """Presets for models of a class that cannot carry ``PRESETS`` itself (a library's class):
    a dict, or ``"module:Class"`` of a class whose ``PRESETS`` fit it."""
    _BY_CLASS_NAME[class_name] = presets


def presets_of(model: nn.Module) -> Presets:
    """``model.PRESETS`` if it has them, else those registered for its class name, else none."""
    own = getattr(model, "PRESETS", None)
    if own:
        return own
    found = _BY_CLASS_NAME.get(type(model).__name__, {})
    if isinstance(found, str):
        module, name = found.split(":")
        found = getattr(importlib.import_module(module), name).PRESETS
    return found


def resolve_preset(model: nn.Module, name: str | None) -> dict[str, Any]:
    """The one answer to "which preset does ``model`` get": its ``keep`` patterns and, maybe, its
    own ``warmup_epochs``, for ``factorize``, the plan, the Recipe, the callbacks and the CLI.

    ``None``: no preset. ``"default"``: the model's ``"paper"`` preset if it has one (its own
    ``PRESETS`` or those registered for its class name), else none, so that a default never takes
    a preset's warm-up without its keep list. Another name: that preset, or a one-line
    ``ValueError`` naming the allowed ones."""
    if name is None:
        return {}
    presets = presets_of(model)
    if name == DEFAULT_PRESET:
        return presets.get("paper", {})
    if name not in presets:
        allowed = ", ".join(sorted(presets)) or "none: pass keep/include patterns instead"
        raise ValueError(f"{type(model).__name__} has no preset {name!r}: allowed {allowed}, "
                         f"{DEFAULT_PRESET!r} or None")
    return presets[name]
