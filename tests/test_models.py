"""Tests of the paper's models: shapes, parameter counts, presets, tying and causality."""

from __future__ import annotations

from fnmatch import fnmatch

import pytest
import torch
from torch import nn

from pufferfish.models import (
    MODELS,
    VGG19BN,
    LSTMLanguageModel,
    ResNet18,
    TransformerLM,
    build_model,
)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tiny_models() -> dict[str, nn.Module]:
    return {
        "resnet18": ResNet18(width=0.125),
        "vgg19_bn": VGG19BN(width=0.125),
        "lstm": LSTMLanguageModel(50, embed_dim=16, hidden_size=16, dropout=0.0),
        "transformer": TransformerLM(50, d_model=16, nhead=2, num_layers=3, dim_feedforward=32,
                                     dropout=0.0, max_len=16),
    }


@pytest.mark.parametrize("cls", [ResNet18, VGG19BN])
@pytest.mark.parametrize(("in_channels", "size"), [(1, 28), (3, 32)])
def test_vision_forward_shapes(cls: type[nn.Module], in_channels: int, size: int) -> None:
    torch.manual_seed(0)
    model = cls(num_classes=7, in_channels=in_channels, width=0.125, image_size=size)
    out = model(torch.randn(2, in_channels, size, size))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


def test_param_counts_width_one() -> None:
    assert n_params(ResNet18(num_classes=10)) == 11_173_962
    assert n_params(VGG19BN(num_classes=10)) == 20_565_834


def test_vgg_names_and_pools() -> None:
    model = VGG19BN(width=0.125, image_size=28)
    names = dict(model.named_modules())
    convs = [n for n, m in names.items() if isinstance(m, nn.Conv2d)]
    assert convs == [f"features.conv{i}" for i in range(1, 17)]
    linears = [n for n, m in names.items() if isinstance(m, nn.Linear)]
    assert linears == ["classifier.fc1", "classifier.fc2", "classifier.fc3"]
    assert isinstance(names["features.pool5"], nn.Identity)  # 28 -> 14 -> 7 -> 3 -> 1
    assert isinstance(VGG19BN(width=0.125).features.pool5, nn.MaxPool2d)


def test_presets_match_modules() -> None:
    for name, model in tiny_models().items():
        names = [n for n, _ in model.named_modules() if n]
        keep = type(model).PRESETS["paper"]["keep"]
        assert keep, name
        for pattern in keep:
            assert any(fnmatch(n, pattern) for n in names), (name, pattern)


def kept(model: nn.Module, name: str) -> bool:
    return any(fnmatch(name, p) for p in type(model).PRESETS["paper"]["keep"])


def test_presets_choose_the_papers_layers() -> None:
    r = ResNet18(width=0.125)
    assert kept(r, "conv1") and kept(r, "fc") and kept(r, "layer1.0.conv2")
    assert kept(r, "layer3.0.shortcut.0")
    assert not kept(r, "layer1.1.conv1") and not kept(r, "layer1.1.conv2")
    assert not kept(r, "layer2.0.conv1") and not kept(r, "layer4.1.conv2")
    v = VGG19BN(width=0.125)
    assert kept(v, "features.conv9") and kept(v, "classifier.fc3")
    assert not kept(v, "features.conv10") and not kept(v, "features.conv16")
    assert not kept(v, "classifier.fc1") and not kept(v, "classifier.fc2")
    t = tiny_models()["transformer"]
    assert kept(t, "encoder.layers.0.self_attn") and kept(t, "embed") and kept(t, "head")
    assert not kept(t, "encoder.layers.1.self_attn") and not kept(t, "encoder.layers.2.linear1")
    lstm = tiny_models()["lstm"]
    assert not kept(lstm, "rnn") and kept(lstm, "encoder") and kept(lstm, "decoder")


def test_lstm_tied_and_shapes() -> None:
    torch.manual_seed(0)
    model = LSTMLanguageModel(50, embed_dim=16, hidden_size=16, num_layers=2, dropout=0.1)
    assert model.decoder.weight.data_ptr() == model.encoder.weight.data_ptr()
    assert model.decoder.weight is model.encoder.weight
    tokens = torch.randint(0, 50, (5, 3))
    hidden = model.init_hidden(3)
    assert hidden[0].shape == (2, 3, 16)
    logits, (h, c) = model(tokens, hidden)
    assert logits.shape == (5, 3, 50) and h.shape == c.shape == (2, 3, 16)
    logits2, _ = model(tokens)
    assert logits2.shape == (5, 3, 50)
    with pytest.raises(ValueError, match="embed_dim == hidden_size"):
        LSTMLanguageModel(50, embed_dim=8, hidden_size=16)
    assert LSTMLanguageModel(50, embed_dim=8, hidden_size=16, tie_weights=False)


def test_lstm_param_count_paper_size() -> None:
    # 33278 * 1500 embedding (tied) + 2 LSTM layers + decoder bias.
    with torch.device("meta"):
        model = LSTMLanguageModel(33278)
    assert n_params(model) == 85_974_278


def test_transformer_causal_and_tied() -> None:
    torch.manual_seed(0)
    model = tiny_models()["transformer"].eval()
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(0, 50, (2, 8))
    logits, hidden = model(tokens)
    assert logits.shape == (2, 8, 50) and hidden is None
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 50
    logits2, _ = model(changed)
    torch.testing.assert_close(logits[:, :5], logits2[:, :5])
    assert not torch.allclose(logits[:, 5:], logits2[:, 5:])
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_build_model() -> None:
    assert set(MODELS) == {"resnet18", "vgg19_bn", "lstm", "transformer", "llama"}
    assert isinstance(build_model("resnet18", width=0.125), ResNet18)
    assert isinstance(build_model("lstm", vocab_size=10, embed_dim=4, hidden_size=4),
                      LSTMLanguageModel)
    with pytest.raises(ValueError, match=r"unknown model 'resnet50': allowed resnet18"):
        build_model("resnet50")


def test_paper_presets_match_the_authors_counts() -> None:
    """ResNet-18: the authors' HybridResNet has 3,336,138 parameters (+128: our stem BatchNorm);
    VGG-19-BN: their LowRankVGG19 has 8,370,634 (+5,504: our conv biases)."""
    from pufferfish import factorize

    resnet = ResNet18(num_classes=10)
    factorize(resnet, preset="paper", rank_ratio=0.25)
    assert n_params(resnet) == 3_336_138 + 128
    vgg = VGG19BN(num_classes=10)
    factorize(vgg, preset="paper", rank_ratio=0.25)
    assert n_params(vgg) == 8_370_634 + 5_504
