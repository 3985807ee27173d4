"""Which kernel a low-rank layer with several (``kernel_options()``) runs: the fastest, measured."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..lowrank.base import LowRankModule
from . import timing

__all__ = ["kernel_variants", "time_kernels"]


def time_kernels(model: nn.Module, example_input: Any, repeats: int = 5, warmup: int = 2,
                 amp_dtype: torch.dtype | None = None) -> dict[str, dict[str, Any]]:
    """Time every low-rank layer of ``model`` that has several kernels, with each kernel.

    Why: the kernels of a layer (``LowRankLSTM``'s fused and loop kernels) compute the same
    function at very different costs depending on the device and the sizes (see
    :mod:`pufferfish.lowrank.lstm`); like ``cudnn.benchmark``, the only reliable choice is a
    measurement on the shapes the run uses. Forward + backward in train mode on the input each
    layer receives from ``example_input``, interleaved, median of ``repeats``. Nothing is
    changed: the caller runs ``module.use_kernel(name)`` (the recipe does, with rank 0's answer,
    so that every replica runs the same kernel).

    Returns:
        name -> ``{"kernel": fastest, "<kernel>_ms": ...}`` (``{"kernel", "fused_ms", "loop_ms"}``
        for a LowRankLSTM), for each such layer that ``example_input`` reaches; ties go to the
        first of ``kernel_options()``.
    """
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, LowRankModule) and len(m.kernel_options()) > 1}
    inputs = (timing.capture_inputs(model, example_input, list(layers.values()), amp_dtype)
              if layers else {})
    found: dict[str, dict[str, Any]] = {}
    for name, module in layers.items():
        captured = inputs.get(id(module))
        if captured is None:
            continue
        variants = kernel_variants(module)
        times = dict(zip(variants, timing.time_steps(list(variants.values()), *captured, repeats,
                                                     warmup, amp_dtype), strict=True))
        found[name] = {"kernel": min(times, key=times.__getitem__),
                       **{f"{kernel}_ms": ms for kernel, ms in times.items()}}
    return found




def kernel_variants(layer: LowRankModule) -> dict[str | None, LowRankModule]:
    """Kernel name -> a copy of ``layer`` running it; ``{None: layer}`` for a one-kernel layer."""
    variants: dict[str | None, LowRankModule] = {}
    for kernel in layer.kernel_options():
        variants[kernel] = copy.deepcopy(layer)
        variants[kernel].use_kernel(kernel)
    return variants or {None: layer}
