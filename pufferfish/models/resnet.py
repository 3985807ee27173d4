"""CIFAR-style ResNet-18 (3x3 stem, no max-pool), as used in the Pufferfish paper."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "ResNet18", "scale_width"]


def scale_width(channels: int, width: float) -> int:
    """``channels * width`` rounded to an int, at least 1."""
    return max(1, round(channels * width))


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with a residual connection (1x1 conv+BN projection on shape change)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for small images (CIFAR 32x32, Fashion-MNIST 28x28).

    ``width`` multiplies the stage widths 64/128/256/512. ``image_size`` is only recorded: the
    global average pool makes the network work for any input size of at least 8 pixels.
    At width 1.0 with 10 classes it has 11,173,962 parameters.
    """

    PRESETS: dict[str, dict] = {
        # The authors' HybridResNet (hwang595/Pufferfish, resnet_cifar10.py) keeps the stem, the
        # first BasicBlock (a block counter: only layer1.0), the 1x1 projection shortcuts and the
        # classifier full-rank, and factorizes the 3x3 convs of every block from layer1.1 on.
        # At CIFAR-10 shapes: 3,336,266 parameters, the paper's 3,336,138 plus this model's stem
        # BatchNorm (128), which HybridResNet does not have.
        "paper": {"keep": ["conv1", "layer1.0.*", "*.shortcut.*", "fc"]},
    }

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: float = 1.0,
                 image_size: int = 32) -> None:
        super().__init__()
        self.image_size = image_size
        widths = [scale_width(c, width) for c in (64, 128, 256, 512)]
        self.in_planes = widths[0]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.layer1 = self._make_layer(widths[0], 2, stride=1)
        self.layer2 = self._make_layer(widths[1], 2, stride=2)
        self.layer3 = self._make_layer(widths[2], 2, stride=2)
        self.layer4 = self._make_layer(widths[3], 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[3] * BasicBlock.expansion, num_classes)
        self._init_weights()

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes * BasicBlock.expansion
        return nn.Sequential(*layers)

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(batch, in_channels, H, W)`` -> logits ``(batch, num_classes)``."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = torch.flatten(self.avgpool(out), 1)
        return self.fc(out)
