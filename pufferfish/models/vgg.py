"""VGG-19 with batch norm, CIFAR variant (512-512 hidden classifier), as used in Pufferfish."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .resnet import scale_width

__all__ = ["VGG19BN", "VGG19_CFG"]

VGG19_CFG: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                              512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]


class VGG19BN(nn.Module):
    """VGG-19-BN for small images.

    Features are named ``features.conv1 .. features.conv16`` (with ``bn<i>``, ``relu<i>`` and
    ``pool1 .. pool5``); the classifier is ``classifier.fc1`` (512->512), ``fc2`` (512->512) and
    ``fc3`` (512->num_classes). A pool that would shrink a map below 1x1 (28x28 inputs reach 1x1
    after four pools) becomes an identity, and an adaptive average pool to 1x1 precedes the
    classifier, so 28x28 and 32x32 inputs both work. At width 1.0 with 10 classes it has
    20,565,834 parameters (conv layers carry a bias, as in the reference implementations;
    20,560,330 without the conv biases).
    """

    PRESETS: dict[str, dict] = {
        # As the authors' LowRankVGG19 (hwang595/Pufferfish, lowrank_vgg.py): conv1..conv9 and the
        # last classifier layer stay full-rank; conv10..conv16 and the hidden FC layers fc1, fc2
        # are factorized. 8,376,138 parameters at CIFAR-10 shapes: theirs (8,370,634) plus our
        # conv biases (5,504).
        "paper": {"keep": [f"features.conv{i}" for i in range(1, 10)] + ["classifier.fc3"]},
    }

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: float = 1.0,
                 image_size: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.image_size = image_size
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        channels, size, conv_i, pool_i = in_channels, image_size, 0, 0
        for v in VGG19_CFG:
            if v == "M":
                pool_i += 1
                if size >= 2:
                    layers[f"pool{pool_i}"] = nn.MaxPool2d(2, 2)
                    size //= 2
                else:
                    layers[f"pool{pool_i}"] = nn.Identity()
            else:
                conv_i += 1
                out = scale_width(int(v), width)
                layers[f"conv{conv_i}"] = nn.Conv2d(channels, out, 3, padding=1)
                layers[f"bn{conv_i}"] = nn.BatchNorm2d(out)
                layers[f"relu{conv_i}"] = nn.ReLU(inplace=True)
                channels = out
        self.features = nn.Sequential(layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        hidden = scale_width(512, width)
        head: OrderedDict[str, nn.Module] = OrderedDict()
        if dropout > 0:
            head["drop1"] = nn.Dropout(dropout)
        head["fc1"] = nn.Linear(channels, hidden)
        head["relu1"] = nn.ReLU(inplace=True)
        if dropout > 0:
            head["drop2"] = nn.Dropout(dropout)
        head["fc2"] = nn.Linear(hidden, hidden)
        head["relu2"] = nn.ReLU(inplace=True)
        head["fc3"] = nn.Linear(hidden, num_classes)
        self.classifier = nn.Sequential(head)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            # Linear layers keep PyTorch's default init, as in the CIFAR VGG the paper builds on
            # (chengyangfu/pytorch-vgg-cifar10). torchvision's N(0, 0.01) suits its 4096-wide
            # head; on a 256-512-wide head it shrinks the logits and the gradients reaching the
            # convs by ~100x, and the network sat at chance for the first epochs.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(batch, in_channels, H, W)`` -> logits ``(batch, num_classes)``."""
        out = torch.flatten(self.avgpool(self.features(x)), 1)
        return self.classifier(out)
