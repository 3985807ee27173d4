"""The paper's models (CIFAR ResNet-18, VGG-19-BN, the LSTM LM), a small Transformer LM and a
LLaMA-style decoder LM.

Every model class has ``PRESETS["paper"]["keep"]``: fnmatch patterns (``*`` also matches dots)
on qualified module names from ``named_modules()`` naming the layers the paper keeps full-rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .llama import Llama, llama_dims
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


def llama(**kwargs: Any) -> Llama:
    """LLaMA-style decoder LM (RMSNorm, RoPE, SwiGLU, untied head)."""
    return Llama(**kwargs)


MODELS = {
    "resnet18": resnet18,
    "vgg19_bn": vgg19_bn,
    "lstm": lstm_lm,
    "transformer": transformer_lm,
    "llama": llama,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by its name in :data:`MODELS`."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: allowed {', '.join(MODELS)}") from None
    return factory(**kwargs)


def build_at_width(name: str, width: float = 1.0, *, num_classes: int = 10,
                   in_channels: int = 3, image_size: int = 32, vocab_size: int | None = None,
                   dropout: float = 0.0, max_len: int = 512) -> nn.Module:
    """Model ``name`` scaled by ``width`` for the data's shapes: the one home of the width rule.

    Image models take ``width`` as their channel multiplier. The LSTM LM gets embedding and hidden
    size ``round(1500 * width)`` (at least 8; 1500 is the paper's); the Transformer LM 4 heads and
    ``d_model = round(256 * width)`` rounded down to a multiple of 4 (at least 32), feed-forward
    4x, dropout at most 0.2; ``llama`` the shape of :func:`~pufferfish.models.llama.llama_dims`
    (GaLore's LLaMA-60M at 1.0) with a RoPE table of ``max_len`` positions. Training, ``pufferfish factorize``, the baselines and the bench all
    build their models here, so one width means one model everywhere.
    """
    if name == "lstm":
        dim = max(8, round(1500 * width))
        return build_model("lstm", vocab_size=vocab_size, embed_dim=dim, hidden_size=dim,
                           dropout=dropout)
    if name == "transformer":
        heads = 4
        d_model = max(heads * 8, round(256 * width) // heads * heads)
        return build_model("transformer", vocab_size=vocab_size, d_model=d_model, nhead=heads,
                           dim_feedforward=4 * d_model, dropout=min(dropout, 0.2),
                           max_len=max_len)
    if name == "llama":
        return build_model("llama", vocab_size=vocab_size, max_len=max_len, **llama_dims(width))
    return build_model(name, num_classes=num_classes, in_channels=in_channels, width=width,
                       image_size=image_size)


__all__ = [
    "MODELS",
    "VGG19BN",
    "LSTMLanguageModel",
    "Llama",
    "ResNet18",
    "TransformerLM",
    "build_at_width",
    "build_model",
    "llama",
    "lstm_lm",
    "resnet18",
    "transformer_lm",
    "vgg19_bn",
]
