"""Channels-last training weights, and the strided 1x1 convolutions kept NCHW (oneDNN#6035)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

from pufferfish import models
from pufferfish.models.memory_format import onednn_nhwc_hazard, to_channels_last

# oneDNN's AVX2 kernels on this CPU whatever it has (AVX-512 picks other kernels): the CPU of the
# reported crash, an AMD EPYC without AVX-512. ATEN_CPU_CAPABILITY does not pick oneDNN's kernels.
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}


def strides_of(p: torch.Tensor, memory_format: torch.memory_format) -> tuple[int, ...]:
    """The strides of ``p``'s shape in ``memory_format`` (also where a 1x1 kernel makes
    ``is_contiguous`` true for both)."""
    return torch.empty(p.shape, memory_format=memory_format).stride()


def channels_last(p: torch.Tensor) -> bool:
    return p.stride() == strides_of(p, torch.channels_last)


def test_narrow_resnet_keeps_its_strided_1x1_shortcuts_with_few_channels_nchw() -> None:
    # Width 0.0625: layer2's shortcut has 4 input channels, layer3's 8, layer4's 16.
    model = models.build_model("resnet18", num_classes=10, in_channels=1, width=0.0625,
                               image_size=28)
    params = dict(model.named_parameters())
    kept = to_channels_last(model)
    assert kept == ["layer2.0.shortcut.0", "layer3.0.shortcut.0"]
    assert to_channels_last(model) == kept  # again (after a cut or a swap): the same, one hook
    for name in kept:
        conv = model.get_submodule(name)
        assert conv.weight.stride() == conv.weight.contiguous().stride()
        assert len(conv._forward_pre_hooks) == 1
    assert channels_last(model.layer4[0].shortcut[0].weight)
    assert channels_last(model.layer1[0].conv1.weight)
    assert dict(model.named_parameters()) == params  # the same objects: the optimizer's
    x = torch.randn(2, 1, 28, 28).to(memory_format=torch.channels_last)
    assert model(x).shape == (2, 10)


def test_a_model_with_a_3d_convolution_keeps_its_5d_weights() -> None:
    """``Module.to(memory_format=channels_last)`` refuses any 5-D weight; only 4-D ones move."""
    model = nn.ModuleDict({"video": nn.Conv3d(2, 4, 3), "image": nn.Conv2d(2, 4, 3)})
    model["image"](torch.randn(1, 2, 5, 5)).sum().backward()  # a live gradient moves with it
    params = dict(model.named_parameters())
    assert to_channels_last(model) == []
    assert channels_last(model["image"].weight) and channels_last(model["image"].weight.grad)
    assert model["video"].weight.is_contiguous()
    assert dict(model.named_parameters()) == params  # the same objects: the optimizer's


def test_the_hazard_is_a_strided_1x1_conv_with_fewer_than_16_input_channels_per_group() -> None:
    assert onednn_nhwc_hazard(nn.Conv2d(15, 8, 1, stride=2))
    assert onednn_nhwc_hazard(nn.Conv2d(4, 8, 1, stride=(1, 2)))
    assert onednn_nhwc_hazard(nn.Conv2d(32, 32, 1, stride=2, groups=4))
    assert not onednn_nhwc_hazard(nn.Conv2d(16, 8, 1, stride=2))
    assert not onednn_nhwc_hazard(nn.Conv2d(4, 8, 1))  # unit stride: no reduced workspace
    assert not onednn_nhwc_hazard(nn.Conv2d(4, 8, 3, stride=2))
    assert not onednn_nhwc_hazard(nn.Linear(4, 8))


CHILD = textwrap.dedent("""
    import torch
    from torch import nn
    from pufferfish.models.memory_format import to_channels_last

    torch.manual_seed(0)
    def net():
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(4, 8, 1, stride=2, bias=False))
    model, ref = net(), net()
    ref.load_state_dict(model.state_dict())
    assert to_channels_last(model) == ["2"]
    x = torch.randn(32, 1, 28, 28)
    for _ in range(3):  # the NHWC weight gradient wrote past its workspace on the first step
        model(x.to(memory_format=torch.channels_last)).square().sum().backward()
    with torch.backends.mkldnn.flags(enabled=False):  # torch's own kernels: the reference
        for _ in range(3):
            ref(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)
    print("ok")
""")


def test_strided_1x1_conv_with_4_channels_trains_channels_last_on_onednn_avx2_kernels() -> None:
    # Before the fix: "free(): invalid next size" or a segfault (SIGABRT / SIGSEGV / SIGBUS),
    # valgrind: an invalid write in jit_avx2_1x1_convolution_bwd_weights_t.
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **AVX2})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
