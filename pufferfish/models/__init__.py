"""The paper's models (CIFAR ResNet-18, VGG-19-BN, the LSTM LM), a small Transformer LM and a
LLaMA-style decoder LM, each registered as a :class:`~pufferfish.models.spec.ModelSpec`.

Every model class has ``PRESETS["paper"]["keep"]``: fnmatch patterns (``*`` also matches dots)
on qualified module names from ``named_modules()`` naming the layers the paper keeps full-rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .llama import LLAMA_DEFAULTS, Llama, check_llama, llama_advice, llama_dims
from .lstm_lm import LSTMLanguageModel
from .resnet import ResNet18
from .spec import ModelSpec, get_spec, model_names, register_model
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


def _image(factory: Any) -> Any:
    """``factory`` built at a width for the data's shapes (the image models' channel multiplier)."""
    def build(width: float, *, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
              **_: Any) -> nn.Module:
        return factory(num_classes=num_classes, in_channels=in_channels, width=width,
                       image_size=image_size)
    return build


def _lstm(width: float, *, vocab_size: int | None = None, dropout: float = 0.0,
          **_: Any) -> nn.Module:
    dim = max(8, round(1500 * width))  # 1500: the paper's
    return lstm_lm(vocab_size=vocab_size, embed_dim=dim, hidden_size=dim, dropout=dropout)


def _transformer(width: float, *, vocab_size: int | None = None, dropout: float = 0.0,
                 max_len: int = 512, **_: Any) -> nn.Module:
    heads = 4
    d_model = max(heads * 8, round(256 * width) // heads * heads)
    return transformer_lm(vocab_size=vocab_size, d_model=d_model, nhead=heads,
                          dim_feedforward=4 * d_model, dropout=min(dropout, 0.2), max_len=max_len)


def _llama(width: float, *, vocab_size: int | None = None, max_len: int = 512,
           **_: Any) -> nn.Module:
    return llama(vocab_size=vocab_size, max_len=max_len, **llama_dims(width))


# The built-in models' specs (the paper's recipe: SGD for the CNNs, the LSTM and the small
# Transformer when trained; the bench steps its LMs with AdamW, the LM recipe).
for _spec in (
    ModelSpec("resnet18", _image(resnet18), factory=resnet18),
    ModelSpec("vgg19_bn", _image(vgg19_bn), factory=vgg19_bn),
    ModelSpec("lstm", _lstm, task="lm-bptt", batch_first=False, bench_optimizer="adamw",
              factory=lstm_lm),
    ModelSpec("transformer", _transformer, task="lm-bptt", bench_optimizer="adamw",
              factory=transformer_lm),
    ModelSpec("llama", _llama, task="lm-packed", defaults=LLAMA_DEFAULTS, check=check_llama,
              defaults_note=llama_advice(),
              bench_optimizer="adamw", factory=llama),
):
    register_model(_spec)

# the built-in classes' own constructors by name (from their specs)
MODELS = {name: get_spec(name).factory for name in model_names()}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a registered model by its name from its class's own arguments (its spec's
    ``factory``)."""
    factory = get_spec(name).factory if name in model_names() else None
    if factory is None:
        allowed = [n for n in model_names() if get_spec(n).factory is not None]
        raise ValueError(f"unknown model {name!r}: allowed {', '.join(allowed)}")
    return factory(**kwargs)


def build_at_width(name: str, width: float = 1.0, *, num_classes: int = 10,
                   in_channels: int = 3, image_size: int = 32, vocab_size: int | None = None,
                   dropout: float = 0.0, max_len: int = 512) -> nn.Module:
    """Model ``name`` (registered, or ``PATH.py:NAME``) scaled by ``width`` for the data's shapes,
    by its spec's ``build``: the one home of the width rule.

    Image models take ``width`` as their channel multiplier. The LSTM LM gets embedding and hidden
    size ``round(1500 * width)`` (at least 8; 1500 is the paper's); the Transformer LM 4 heads and
    ``d_model = round(256 * width)`` rounded down to a multiple of 4 (at least 32), feed-forward
    4x, dropout at most 0.2; ``llama`` the shape of :func:`~pufferfish.models.llama.llama_dims`
    (GaLore's LLaMA-60M at 1.0) with a RoPE table of ``max_len`` positions. Training, ``pufferfish
    factorize``, the baselines and the bench all build their models here, so one width means one
    model everywhere.
    """
    return get_spec(name).build_at(width, num_classes=num_classes, in_channels=in_channels,
                                   image_size=image_size, vocab_size=vocab_size,
                                   dropout=dropout, max_len=max_len)


__all__ = [
    "MODELS",
    "VGG19BN",
    "LSTMLanguageModel",
    "Llama",
    "ModelSpec",
    "ResNet18",
    "TransformerLM",
    "build_at_width",
    "build_model",
    "get_spec",
    "llama",
    "lstm_lm",
    "model_names",
    "register_model",
    "resnet18",
    "transformer_lm",
    "vgg19_bn",
]
