"""Low-rank layers as drop-ins for the stacks users bring: Hugging Face BERT, GPT-2 and ViT built
from small configs (no downloads), torch's TransformerEncoder fast path, and code that reads layers.
"""

import copy
import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import pufferfish as pf
from pufferfish.auto import profile_keep
from pufferfish.lowrank import LowRankConv2d, LowRankLinear, LowRankModule, register_low_rank
from pufferfish.lowrank.base import _REGISTRY

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def bert() -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(vocab_size=100, **TINY)).eval()


def vit() -> nn.Module:
    config = transformers.ViTConfig(image_size=16, patch_size=4, **TINY)
    return transformers.ViTModel(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8))


def merged_copy(model: nn.Module) -> nn.Module:
    return pf.merge(copy.deepcopy(model))


# ------------------------------------------------------------------------ tied / shared weights


def test_gpt2_tied_lm_head_is_kept_and_the_model_shrinks() -> None:
    model = gpt2().train()
    dense_params = sum(p.numel() for p in model.parameters())
    report = pf.factorize(model, rank_ratio=0.25, example_input={"input_ids": tokens()})
    by_name = {d.name: d for d in report.layers}
    assert by_name["lm_head"].reason == "kept: weight tied to transformer.wte.weight"
    assert isinstance(model.lm_head, nn.Linear)
    assert report.params_before == dense_params  # the tied matrix counted once
    assert report.params_after == sum(p.numel() for p in model.parameters()) < dense_params
    assert {d.kind for d in report.factorized} == {"Conv1D"}
    # The tie survives training: one optimizer step moves one tensor seen under both names.
    ids = tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_two_linears_sharing_one_weight_are_kept() -> None:
    a, b = nn.Linear(32, 32), nn.Linear(32, 32)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b, nn.Linear(32, 32))
    report = pf.factorize(model, rank=4)
    reasons = {d.name: d.reason for d in report.layers}
    assert reasons["0"] == "kept: weight tied to 2.weight"
    assert reasons["2"] == "kept: weight tied to 0.weight"
    assert model[2].weight is model[0].weight and isinstance(model[3], LowRankLinear)
    assert report.params_after < report.params_before


def test_weight_norm_layer_is_kept() -> None:
    model = nn.Sequential(nn.utils.weight_norm(nn.Linear(32, 32)), nn.Linear(32, 32))
    report = pf.factorize(model, rank=4)
    assert report.layers[0].reason == "kept: weight recomputed by WeightNorm (torch.nn.utils)"
    assert isinstance(model[1], LowRankLinear) and model(torch.randn(2, 32)).shape == (2, 32)


def test_extra_bn_never_makes_a_layer_larger() -> None:
    # Rank 1 of a 3x2 1x1 conv saves a parameter (5 < 6) but not with the BN's 2 (7 >= 6).
    model = nn.Sequential(nn.Conv2d(2, 3, 1, bias=False), nn.Conv2d(16, 16, 3))
    report = pf.factorize(model, rank=1, extra_bn=True)
    assert "no parameter saving at rank 1 (7 >= 6)" in report.layers[0].reason
    assert isinstance(model[1], LowRankConv2d) and model[1].bn is not None
    assert report.params_after == sum(p.numel() for p in model.parameters())
    assert report.params_after < report.params_before


@pytest.mark.parametrize("ratio", [0.1, 0.5, 1.0])
def test_factorizing_never_enlarges_real_models(ratio: float) -> None:
    for build in (gpt2, bert):
        model = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # at ratio 1.0 nothing saves parameters
            report = pf.factorize(model, rank_ratio=ratio, extra_bn=True)
        assert report.params_after <= report.params_before
        assert report.params_after == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ what code that reads sees


def test_weight_and_attributes_look_dense() -> None:
    linear = nn.Linear(12, 7)
    conv = nn.Conv2d(4, 6, (3, 2), stride=2, padding=1, dilation=(1, 2), padding_mode="reflect")
    conv1d = Conv1D(9, 5)  # nf=9 outputs, nx=5 inputs, weight stored (5, 9)
    for dense in (linear, conv, conv1d):
        cls = pf.lowrank.low_rank_class_for(dense)
        low, full = cls.from_dense(dense, 3), cls.from_dense(dense, cls.full_rank(dense))
        assert low.weight.shape == dense.weight.shape and low.bias.shape == dense.bias.shape
        assert low.weight.dtype == dense.weight.dtype and low.weight.device == dense.weight.device
        torch.testing.assert_close(low.weight, low.to_dense().weight)
        torch.testing.assert_close(full.weight, dense.weight, rtol=1e-4, atol=1e-5)
        assert "weight" not in dict(low.named_parameters())
        assert not any(k == "weight" or k == "bias" for k in low.state_dict())
        with pytest.raises(AttributeError):  # derived, read-only
            low.weight = dense.weight.detach().clone()
        with pytest.raises(KeyError, match="attribute 'weight' already exists"):
            low.weight = nn.Parameter(dense.weight.detach().clone())
    low = LowRankLinear.from_dense(linear, 3)
    assert (low.in_features, low.out_features) == (12, 7)
    low = LowRankConv2d.from_dense(conv, 3)
    assert (low.in_channels, low.out_channels, low.kernel_size) == (4, 6, (3, 2))
    assert (low.stride, low.padding, low.dilation, low.groups, low.padding_mode) == (
        (2, 2), (1, 1), (1, 2), 1, "reflect")
    low = pf.lowrank.low_rank_class_for(conv1d).from_dense(conv1d, 3)
    assert (low.nf, low.nx) == (9, 5)


def test_lstm_gate_weights_look_dense() -> None:
    dense = nn.LSTM(6, 5, num_layers=2)
    low = pf.LowRankLSTM.from_dense(dense, pf.LowRankLSTM.full_rank(dense))  # exact at full rank
    for k in range(2):
        for kind in ("ih", "hh"):
            name = f"weight_{kind}_l{k}"
            torch.testing.assert_close(getattr(low, name), getattr(dense, name), rtol=1e-4, atol=1e-5)
    assert [[t.shape for t in layer] for layer in low.all_weights] == [
        [t.shape for t in layer] for layer in dense.all_weights]
    assert not any(k.startswith("weight_") for k in low.state_dict())
    with pytest.raises(AttributeError):
        low.weight_ih_l2  # noqa: B018 - no third layer


def test_extra_bn_weight_is_the_folded_one() -> None:
    low = LowRankConv2d.from_dense(nn.Conv2d(4, 8, 3, bias=False), 3, extra_bn=True)
    low.train()
    for _ in range(3):  # non-trivial running statistics
        low(torch.randn(4, 4, 6, 6) + 1)
    low.eval()
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(nn.functional.conv2d(x, low.weight, low.bias), low(x),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_device_mode_and_requires_grad_are_kept(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Conv2d(8, 8, 3),
                          nn.Linear(32, 32)).to(dtype)
    model[0].requires_grad_(False)  # frozen layer
    model[2].weight.requires_grad_(False)  # frozen weight, trainable bias (BitFit)
    model[3].eval()
    pf.factorize(model, rank=4)
    for p in model[0].parameters():
        assert not p.requires_grad
    assert not model[2].u.weight.requires_grad and not model[2].v.weight.requires_grad
    assert model[2].u.bias.requires_grad
    assert all(p.requires_grad for p in model[4].parameters())
    assert not model[3].training and model[4].training
    assert all(p.dtype == dtype for p in model.parameters())
    pf.merge(model)
    assert not model[0].weight.requires_grad and not model[2].weight.requires_grad
    assert model[2].bias.requires_grad and not model[3].training


def test_channels_last_is_kept_both_ways() -> None:
    """A channels-last conv gives channels-last factors (and back): training converts the model
    once, and the switch must not hand it NCHW layers that run the slower kernels."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3))
    plain = copy.deepcopy(model)
    model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 12, 12)
    pf.factorize(model, rank=4)
    pf.factorize(plain, rank=4)
    factors = [p for p in model.parameters() if p.dim() == 4 and p.size(-1) > 1]  # not 1x1
    assert factors and all(p.is_contiguous(memory_format=torch.channels_last)
                           and not p.is_contiguous() for p in factors)
    assert all(p.is_contiguous() for p in plain.parameters())
    torch.testing.assert_close(model(x), plain(x), rtol=1e-4, atol=1e-5)
    pf.merge(model)
    assert not model[2].weight.is_contiguous()
    assert model[2].weight.is_contiguous(memory_format=torch.channels_last)


def test_forward_hooks_are_carried_over_and_still_removable() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    seen: list[str] = []
    pre = model[0].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    post = model[0].register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    pf.factorize(model, rank=2)
    assert isinstance(model[0], LowRankLinear)
    model(torch.randn(3, 16))
    assert seen == ["pre", (3, 16)]
    pre.remove()
    post.remove()
    model(torch.randn(3, 16))
    assert seen == ["pre", (3, 16)]


def test_jit_script_runs_the_low_rank_layers() -> None:
    x_lin, x_conv = torch.randn(3, 12), torch.randn(2, 4, 7, 7)
    for low, x in [(LowRankLinear.from_dense(nn.Linear(12, 7), 3), x_lin),
                   (LowRankConv2d.from_dense(nn.Conv2d(4, 6, 3, padding=1), 3), x_conv),
                   (LowRankConv2d.from_dense(nn.Conv2d(4, 6, 3), 3, extra_bn=True).eval(), x_conv)]:
        scripted = torch.jit.script(low)
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        torch.testing.assert_close(torch.jit.load(buffer)(x), low(x))
    lstm = pf.LowRankLSTM.from_dense(nn.LSTM(4, 8), 2)
    with pytest.raises(TypeError, match=r"LowRankLSTM cannot be compiled by torch\.jit\.script"):
        torch.jit.script(nn.Sequential(lstm))


def test_export_reads_weight_in_forward() -> None:
    class ReadsDtype(nn.Module):  # the HF ViT pattern: x.to(self.proj.weight.dtype)
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x.to(self.proj.weight.dtype))

    model = ReadsDtype()
    pf.factorize(model, rank=4)
    x = torch.randn(2, 16)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), model(x))


# ------------------------------------------------------------------- all-or-nothing, no-ops


class _Failing(LowRankLinear):
    """Fails to build for the layer with 24 outputs."""

    @classmethod
    def from_dense(cls, dense: nn.Linear, rank: int, **options: object) -> LowRankLinear:
        if dense.out_features == 24:
            raise RuntimeError("boom")
        return super().from_dense(dense, rank, **options)


def test_a_failure_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 24))
    before = list(model)
    register_low_rank(nn.Linear, _Failing)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            pf.factorize(model, rank=2)
    finally:
        register_low_rank(nn.Linear, LowRankLinear)
    assert list(model) == before

    class NeedsDense(nn.Module):  # its forward breaks once the layer is replaced
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.fc(x) + self.fc.shift)

    model = NeedsDense()
    model.fc.shift = torch.zeros(16)  # an attribute the low-rank layer does not carry
    modules = dict(model.named_children())
    with pytest.raises(AttributeError, match="shift"):
        pf.factorize(model, rank=2, example_input=torch.randn(2, 16))
    assert dict(model.named_children()) == modules


def test_silent_no_ops_are_now_loud() -> None:
    with pytest.raises(ValueError, match=r"the model itself is a Linear: .* wrap it"):
        pf.factorize(nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(32, 32), nn.Embedding(10, 32))
    pf.factorize(model, rank=4)
    with pytest.warns(UserWarning, match=r"already factorized: 1 low-rank module\(s\) \(0\)"):
        pf.factorize(model, rank=4)
    with pytest.warns(UserWarning, match=r"changed nothing in Sequential: 1 x unsupported type.*"
                                         r"register_low_rank"):
        pf.factorize(nn.Sequential(nn.Embedding(10, 32)), rank=4)
    with pytest.warns(UserWarning, match="changed nothing in Sequential: 1 x matches keep"):
        pf.factorize(nn.Sequential(nn.Linear(32, 32)), keep=["0"])


# ----------------------------------------------------------------------------- example_input


def test_example_input_tuple_and_dict() -> None:
    model = bert()
    ids, mask = tokens(), torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    as_dict = {"input_ids": ids, "attention_mask": mask}
    assert pf.count_macs(model, as_dict) == pf.count_macs(model, (ids, mask))
    _, measured = profile_keep(model, as_dict, {"encoder.layer.0.output.dense": 0.25},
                               repeats=1, warmup=0)
    assert measured["encoder.layer.0.output.dense"]["input_shape"] == [[2, 8, 64]]
    report = pf.factorize(model, rank_ratio=0.25, keep_first=1, example_input=as_dict)
    assert report.macs_after < report.macs_before
    assert report.layers[0].reason.startswith("kept: hybrid")
    expected = merged_copy(model)(**as_dict).last_hidden_state
    torch.testing.assert_close(model(**as_dict).last_hidden_state, expected, rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------- HF models and Conv1D


def test_vit_factorizes_and_matches_its_merge() -> None:
    model = vit()
    images = torch.randn(2, 3, 16, 16)
    report = pf.factorize(model, rank_ratio=0.25, example_input=images)
    assert "embeddings.patch_embeddings.projection" in {d.name for d in report.factorized}
    expected = merged_copy(model)(images).last_hidden_state
    torch.testing.assert_close(model(images).last_hidden_state, expected, rtol=1e-4, atol=1e-5)


def test_gpt2_conv1d_is_supported_lazily_and_exact_at_full_rank() -> None:
    code = "import sys, pufferfish; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "False"  # import pufferfish does not import transformers
    model = gpt2()
    ids = tokens()
    report = pf.factorize(model, rank_ratio=0.25, keep=["*.c_attn"], overrides={"*.c_fc": 4})
    assert report.ranks["transformer.h.1.mlp.c_fc"] == 4 and len(report.ranks) == 6
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "LowRankConv1D"
    expected = model(ids).logits
    pf.merge(model)
    assert type(model.transformer.h[0].mlp.c_fc) is Conv1D
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-5)
    # At full rank the replacement computes what the dense Conv1D did.
    dense = model.transformer.h[0].mlp.c_fc
    full = pf.lowrank.low_rank_class_for(dense).from_dense(dense, 32)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(full(x), dense(x), rtol=1e-4, atol=1e-5)


def test_custom_type_via_register_low_rank() -> None:
    class Scale(nn.Module):  # a dense type of the user's: y = x @ W
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    class LowRankScale(LowRankModule):
        dense_type = Scale

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank
            self.left, self.right = nn.Parameter(torch.empty(32, rank)), nn.Parameter(
                torch.empty(rank, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.left @ self.right

        @classmethod
        def full_rank(cls, dense: Scale) -> int:
            return 32

        @classmethod
        def params_at_rank(cls, dense: Scale, rank: int, **options: object) -> int:
            return 64 * rank

        @classmethod
        def from_dense(cls, dense: Scale, rank: int, **options: object) -> "LowRankScale":
            layer = cls(rank)
            left, right = pf.svd_split(dense.weight, rank)
            with torch.no_grad():
                layer.left.copy_(left)
                layer.right.copy_(right)
            return layer

    model = nn.Sequential(Scale())
    with pytest.warns(UserWarning, match="register_low_rank"):
        pf.factorize(model, rank=4)
    register_low_rank(Scale, LowRankScale)
    try:
        x = torch.randn(3, 32)
        expected = model(x)
        assert pf.factorize(model, rank=32 // 2 - 1).factorized[0].name == "0"
        assert isinstance(model[0], LowRankScale) and model(x).shape == expected.shape
    finally:
        del _REGISTRY[Scale]


# ------------------------------------------------------------- torch's TransformerEncoder


@pytest.mark.parametrize("plan", [
    {},  # every layer low-rank: the first layer declines the fast path
    {"keep": ["layers.0.*"]},  # dense first layer: nested tensors reach the low-rank layer
    {"include": ["*.linear1", "*.linear2"]},  # dense attention: the fused kernel reads .weight
])
def test_transformer_encoder_fast_path_with_padding_mask(plan: dict) -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    pf.factorize(model, rank=4, **plan)
    x = torch.randn(3, 6, 32)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2, 2:] = True
    model.eval()
    expected = merged_copy(model)(x, src_key_padding_mask=mask)
    with torch.no_grad():  # the fast path's conditions: eval, no grad, padding mask
        out = model(x, src_key_padding_mask=mask)
    torch.testing.assert_close(out[~mask], expected[~mask], rtol=1e-4, atol=1e-5)
    model.train()
    model(x, src_key_padding_mask=mask)[~mask].sum().backward()


# --------------------------------------------------------------------------- save and reload


def test_load_factorized_round_trip_gpt2(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    pf.factorize(model, rank_ratio=0.25, overrides={"*.h.1.mlp.c_fc": 4})
    ids = tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = gpt2()
    loaded = pf.load_factorized(fresh, torch.load(tmp_path / "model.pt", weights_only=True))
    assert loaded is fresh and fresh.transformer.h[1].mlp.c_fc.rank == 4
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)
    # Saved factorized by save_pretrained (which drops the tied lm_head.weight): the same.
    model.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file

    fresh = pf.load_factorized(gpt2(), load_file(tmp_path / "hf" / "model.safetensors"))
    torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_load_factorized_bert_safetensors_and_errors(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    model = bert()
    pf.factorize(model, rank_ratio=0.25, keep=["pooler.*"])
    safetensors.save_file(model.state_dict(), tmp_path / "model.safetensors")
    state = safetensors.load_file(tmp_path / "model.safetensors")
    fresh = pf.load_factorized(bert(), state)
    ids = tokens()
    torch.testing.assert_close(fresh(ids).last_hidden_state, model(ids).last_hidden_state,
                               rtol=0, atol=0)
    # A state_dict that does not fit: clear error, model untouched.
    for bad, match in [
        ({**state, "extra.weight": torch.zeros(1)}, "unexpected: extra.weight"),
        ({k: v for k, v in state.items() if k != "pooler.dense.bias"}, "missing: pooler.dense.bias"),
        ({**state, "pooler.dense.weight": torch.zeros(3, 3)}, "wrong shape: pooler.dense.weight"),
        ({**state, "pooler.dense.x.weight": torch.zeros(3, 3)}, "fit neither a dense Linear"),
    ]:
        target = bert()
        modules = dict(target.named_modules())
        weights = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(ValueError, match=match):
            pf.load_factorized(target, bad)
        assert dict(target.named_modules()) == modules
        for k, v in target.state_dict().items():
            assert torch.equal(v, weights[k]), k


def test_merged_model_survives_save_pretrained(tmp_path: Path) -> None:
    model = bert()
    pf.factorize(model, rank_ratio=0.25)
    ids = tokens()
    expected = model(ids).last_hidden_state
    pf.merge(model).save_pretrained(tmp_path)
    reloaded = transformers.BertModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded(ids).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
