"""Time a layer the way training runs it: forward + backward on the input it really receives.

:func:`capture_inputs` records what each layer of a model is called with; :func:`time_steps`
times layers on those inputs, interleaved so that drift on a shared machine hits all of them.
Used by the keep profiler (:mod:`.keep`) and the kernel choice (:mod:`.kernels`).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..lowrank.counting import call_with_example

__all__ = ["autocast", "capture_inputs", "input_shapes", "time_steps"]

_MIN_REPEAT_S = 1e-3  # each timed repeat runs enough steps to last at least this long


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple | list):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, found.append)
    return found


def input_shapes(args: tuple[Any, ...]) -> list[list[int]] | None:
    shapes = [list(t.shape) for t in _tensors(args)]
    return shapes or None


def autocast(device: torch.device, amp_dtype: torch.dtype | None
             ) -> contextlib.AbstractContextManager:
    """A forward's autocast as the run's (``amp_dtype`` None: none), entered anew for each
    forward as a training step does: the weights' casts are paid each time, not cached."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)


def capture_inputs(model: nn.Module, example_input: Any, modules: list[nn.Module],
                   amp_dtype: torch.dtype | None = None
                   ) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
    """id(module) -> the (args, kwargs) of its first call, as detached leaves.

    Run with gradients on (so that the tensors that need an input gradient in training are
    known, and so that no-grad fast paths such as the fused Transformer layer do not bypass the
    submodules) but in eval mode; under the run's autocast (``amp_dtype``), so that each layer
    gets the dtype it trains on.
    """
    captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if id(module) not in captured:
            captured[id(module)] = (_map_tensors(args, leaf), _map_tensors(kwargs, leaf))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with torch.enable_grad(), autocast(device, amp_dtype):
            call_with_example(model, example_input)
    finally:
        for h in handles:
            h.remove()
        for m, training in flags:
            m.training = training
    return captured


def time_steps(layers: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any],
               repeats: int, warmup: int, amp_dtype: torch.dtype | None = None) -> list[float]:
    """Median milliseconds of one forward + backward step of each layer, timed interleaved;
    each forward under the run's autocast (``amp_dtype``), each backward outside it."""
    for layer in layers:
        layer.train()
    leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    device = next(layers[0].parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    def step(layer: nn.Module) -> None:
        for p in layer.parameters():
            p.grad = None
        for t in leaves:
            t.grad = None
        with autocast(device, amp_dtype):
            outs = [t for t in _tensors(layer(*args, **kwargs)) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    def run(layer: nn.Module, number: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(number):
            step(layer)
        sync(device)
        return time.perf_counter() - start

    with torch.enable_grad():
        for _ in range(max(0, warmup)):
            for layer in layers:
                step(layer)
        single = max(max(run(layer, 1) for layer in layers), 1e-7)
        number = max(1, min(1000, math.ceil(_MIN_REPEAT_S / single)))
        times: list[list[float]] = [[] for _ in layers]
        for _ in range(repeats):
            for layer, record in zip(layers, times, strict=True):
                record.append(run(layer, number) / number)
    return [statistics.median(record) * 1e3 for record in times]
