"""What a model costs: parameters and the MACs of one forward pass, and how it is called.

The flop counter sees every matmul; what it cannot see each layer class adds (``uncounted_macs``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .base import LowRankModule, low_rank_class_for

__all__ = ["call_with_example", "count_macs", "count_params"]


def count_params(model: nn.Module) -> int:
    """Parameters of ``model``, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, example_input: Any) -> int:
    """Multiply-accumulates of one forward pass (``FlopCounterMode`` FLOPs / 2), in eval mode.

    Eval mode so that counting does not update BatchNorm statistics; the training flags of every
    submodule are restored afterwards. What the flop counter cannot see is the layer classes'
    business (:mod:`pufferfish.lowrank.base`): each registered dense module adds its
    ``uncounted_macs`` (``nn.LSTM``'s fused kernel, counted analytically), and every layer's
    ``counting`` context is entered around the pass (torch's fused attention fast path is switched
    off, so attention counts as its matmuls, like training runs it; a ``LowRankLSTM`` runs
    its loop kernel, the factorized arithmetic, whichever kernel it trains with).
    """
    uncounted = [0]

    def add_uncounted(cls: type[LowRankModule], module: nn.Module, args: tuple, output: Any
                      ) -> None:
        uncounted[0] += cls.uncounted_macs(module, args, output)

    with ExitStack() as stack:
        for module in model.modules():
            cls = _layer_class(module)
            if cls is None:
                continue
            stack.enter_context(cls.counting(module))
            if not isinstance(module, LowRankModule):
                hook = module.register_forward_hook(functools.partial(add_uncounted, cls))
                stack.callback(hook.remove)
        stack.enter_context(_eval_mode(model))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            call_with_example(model, example_input)
    return counter.get_total_flops() // 2 + uncounted[0]


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode; every submodule's training flag restored on exit."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


def _layer_class(module: nn.Module) -> type[LowRankModule] | None:
    """The low-rank class that knows ``module``'s type: its own, or the one registered for it."""
    return type(module) if isinstance(module, LowRankModule) else low_rank_class_for(module)


def call_with_example(model: nn.Module, example_input: Any) -> Any:
    """Call ``model`` on ``example_input`` as every pufferfish function does.

    A ``tuple`` is the positional arguments, a mapping (a ``dict``, a Hugging Face
    ``BatchEncoding``) the keyword arguments, anything else the single argument.
    """
    example_input = _on_device_of(model, example_input)
    if isinstance(example_input, tuple):
        return model(*example_input)
    if isinstance(example_input, Mapping):
        return model(**example_input)
    return model(example_input)


def _on_device_of(model: nn.Module, example: Any) -> Any:
    """``example``'s tensors on the device of ``model``'s parameters: an example built on the CPU
    (a tokenizer's output) before a trainer moved the model to its GPU still runs at the switch."""
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    if device is None:
        return example
    if isinstance(example, torch.Tensor):
        return example.to(device) if example.device != device else example
    if isinstance(example, Mapping):
        return {k: _on_device_of(model, v) for k, v in example.items()}
    if isinstance(example, tuple) and hasattr(example, "_fields"):  # a named tuple
        return type(example)(*(_on_device_of(model, v) for v in example))
    if isinstance(example, tuple | list):
        return type(example)(_on_device_of(model, v) for v in example)
    return example
