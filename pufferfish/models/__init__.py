"""The paper's models: CIFAR ResNet-18, VGG-19-BN, the LSTM LM and a small Transformer LM.

Every model class has ``PRESETS["paper"]["keep"]``: fnmatch patterns (``*`` also matches dots)
on qualified module names from ``named_modules()`` naming the layers the paper keeps full-rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .lstm_lm import LSTMLanguageModel
from .resnet import ResNet18
from .transformer import TransformerLM
from .vgg import VGG19BN


def resnet18(**kwargs: Any) -> ResNet18:
    """CIFAR-style ResNet-18."""
    return ResNet18(**kwargs)


def vgg19_bn(**kwargs: Any) -> VGG19BN:
    """CIFAR-style VGG-19 with batch norm."""
    return VGG19BN(**kwargs)


def lstm_lm(**kwargs: Any) -> LSTMLanguageModel:
    """Two-layer LSTM language model with tied embeddings."""
    return LSTMLanguageModel(**kwargs)


def transformer_lm(**kwargs: Any) -> TransformerLM:
    """Decoder-only Transformer language model."""
    return TransformerLM(**kwargs)


MODELS = {
    "resnet18": resnet18,
    "vgg19_bn": vgg19_bn,
    "lstm": lstm_lm,
    "transformer": transformer_lm,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by its name in :data:`MODELS`."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}: allowed resnet18, vgg19_bn, lstm, transformer") from None
    return factory(**kwargs)


__all__ = [
    "MODELS",
    "VGG19BN",
    "LSTMLanguageModel",
    "ResNet18",
    "TransformerLM",
    "build_model",
    "lstm_lm",
    "resnet18",
    "transformer_lm",
    "vgg19_bn",
]
