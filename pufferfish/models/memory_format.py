"""Channels-last weights for training, minus the convolutions oneDNN gets wrong that way.

``to_channels_last`` is the one place a model is put in NHWC memory order (``pufferfish train``'s
``--channels-last``, the bench's). It keeps one kind of convolution in NCHW: a strided 1x1
convolution with fewer than 16 input channels per group. On CPU, oneDNN (3.12, in torch 2.13)
computes its weight gradient in NHWC with the ``jit_1x1`` kernel of AVX2 (and of AVX-512 without
``avx512_core``'s brgemm kernels), whose reduce-to-unit-stride workspace is indexed by the input
block (8 or 16 channels) instead of the input channels, so it writes past the end of that
workspace: heap corruption ("double free or corruption", "free(): invalid next size") or wrong
gradients, uxlfoundation/oneDNN#6035. A network-slimming cut or a narrow ``--width`` makes such a
shortcut (ResNet-18 at width 0.125 pruned by half: ``layer2.0.shortcut.0``, 4 input channels).
In NCHW (weight and input both contiguous) oneDNN takes its blocked-source path, which is right;
these layers are the cheapest of the network, so the cost is a copy of their small input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["onednn_nhwc_hazard", "to_channels_last"]

# The largest input-channel block of oneDNN's jit_1x1 kernels (8 on AVX2, 16 on AVX-512): a
# strided 1x1 convolution with fewer input channels per group overruns the workspace in NHWC.
_IC_BLOCK = 16


def onednn_nhwc_hazard(conv: nn.Module) -> bool:
    """Whether ``conv`` is a convolution whose NHWC weight gradient oneDNN corrupts (#6035)."""
    return (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (1, 1)
            and tuple(conv.stride) != (1, 1) and conv.in_channels // conv.groups < _IC_BLOCK)


def _nchw_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: the input of a hazardous convolution in NCHW (a copy if it was not).

    Checked at each call: the hook travels with the module's hooks when a low-rank layer
    replaces it (lowrank/swap.py), and does nothing there.
    """
    if not onednn_nhwc_hazard(module) or not args or not isinstance(args[0], torch.Tensor):
        return None
    return (args[0].contiguous(), *args[1:])


def to_channels_last(model: nn.Module) -> list[str]:
    """Every 4-D weight of ``model`` channels-last, in place (the parameters stay the same
    objects), except those of the convolutions :func:`onednn_nhwc_hazard` names, which stay NCHW
    and get their input in NCHW. Returns those convolutions' qualified names.

    Safe to call again (after a pruning cut or a low-rank swap changed the layers): each call
    looks at the layers as they are, and registers the input hook at most once per layer. Other
    tensors keep their layout: ``Module.to(memory_format=)`` would refuse a model with any 5-D
    weight (a ``Conv3d``), which has no 2-D channels-last.
    """
    with torch.no_grad():
        for module in model.modules():
            for name, tensor in [*module.named_parameters(recurse=False),
                                 *module.named_buffers(recurse=False)]:
                if tensor.dim() == 4:
                    nhwc = tensor.to(memory_format=torch.channels_last)  # as Module.to restrides
                    if isinstance(tensor, nn.Parameter):
                        tensor.data = nhwc  # the same Parameter object, as Module.to keeps it
                        if tensor.grad is not None:  # and its gradient in the same layout
                            tensor.grad = tensor.grad.to(memory_format=torch.channels_last)
                    else:
                        setattr(module, name, nhwc)
    kept = []
    for name, module in model.named_modules():
        if not onednn_nhwc_hazard(module):
            continue
        module.to(memory_format=torch.contiguous_format)
        if _nchw_input not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_nchw_input)
        kept.append(name)
    return kept
