"""LowRankLSTM / LowRankMultiheadAttention: exact at full rank, Eckart–Young at rank r, drop-in."""

import copy

import pytest
import torch
from helpers import rel_err
from torch import nn

from pufferfish.lowrank import LowRankLSTM, LowRankMultiheadAttention, low_rank_class_for, merge

TOL = 1e-5


def _eckart_young(w: torch.Tensor, rank: int) -> float:
    return torch.linalg.svdvals(w.double())[rank:].square().sum().sqrt().item()


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------------------- LSTM


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("input_size,num_layers,batch_first,bias,with_hx", [
    (3, 1, False, True, False),
    (7, 2, True, True, True),
    (5, 2, False, False, True),
    (7, 1, True, False, False),
])
def test_lstm_full_rank_is_exact(input_size, num_layers, batch_first, bias, with_hx,
                                fused) -> None:
    dense = nn.LSTM(input_size, 5, num_layers=num_layers, batch_first=batch_first, bias=bias)
    low = LowRankLSTM.from_dense(dense, LowRankLSTM.full_rank(dense), fused=fused)
    x = torch.randn(2, 6, input_size) if batch_first else torch.randn(6, 2, input_size)
    hx = (torch.randn(num_layers, 2, 5), torch.randn(num_layers, 2, 5)) if with_hx else None
    out, (h, c) = low(x, hx)
    ref, (h_ref, c_ref) = dense(x, hx)
    for a, b in [(out, ref), (h, h_ref), (c, c_ref)]:
        assert a.shape == b.shape
        assert rel_err(a, b) <= TOL
    # Unbatched 2-D input, as nn.LSTM accepts it.
    xu, hu = x[0] if batch_first else x[:, 0], None if hx is None else (hx[0][:, 0], hx[1][:, 0])
    out, (h, _) = low(xu, hu)
    ref, (h_ref, _) = dense(xu, hu)
    assert out.shape == ref.shape and h.shape == h_ref.shape
    assert rel_err(out, ref) <= TOL and rel_err(h, h_ref) <= TOL


def test_lstm_full_rank_covers_every_matrix() -> None:
    # max(h, min(4h, in)): the smallest rank that keeps both W_ih (4h x in) and W_hh (4h x h).
    assert LowRankLSTM.full_rank(nn.LSTM(3, 5)) == 5
    assert LowRankLSTM.full_rank(nn.LSTM(7, 5, num_layers=2)) == 7
    assert LowRankLSTM.full_rank(nn.LSTM(50, 5)) == 20


def test_lstm_round_trip_and_registration() -> None:
    dense = nn.LSTM(4, 6, num_layers=2, dropout=0.25, batch_first=True)
    assert low_rank_class_for(dense) is LowRankLSTM
    merged = LowRankLSTM.from_dense(dense, 6).to_dense()
    assert (merged.num_layers, merged.batch_first, merged.dropout) == (2, True, 0.25)
    for name, p in dense.named_parameters():
        assert rel_err(getattr(merged, name), p) <= TOL, name


@pytest.mark.parametrize("rank", [1, 3])
def test_lstm_rank_r_error_is_eckart_young_bound(rank: int) -> None:
    dense = nn.LSTM(7, 5, num_layers=2)
    low = LowRankLSTM.from_dense(dense, rank)
    merged = low.to_dense()
    for name, w in dense.named_parameters():
        if name.startswith("weight"):
            err = torch.linalg.matrix_norm((w - getattr(merged, name)).double()).item()
            assert err == pytest.approx(_eckart_young(w, rank), rel=1e-4, abs=1e-6), name
    assert [u.shape[1] for u, _ in low.factor_pairs()] == [rank] * 4


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_params_at_rank_is_exact(bias: bool) -> None:
    dense = nn.LSTM(7, 5, num_layers=2, bias=bias)
    for rank in (1, 5, 6, 7):  # 6 and 7 are capped at 5 for every matrix but W_ih_l0
        built = LowRankLSTM.from_dense(dense, rank)
        assert LowRankLSTM.params_at_rank(dense, rank) == _numel(built)


def test_lstm_gradients_reach_every_factor() -> None:
    low = LowRankLSTM.from_dense(nn.LSTM(3, 4, num_layers=2), 2)
    out, (h, c) = low(torch.randn(5, 2, 3))
    (out.square().sum() + h.sum() + c.sum()).backward()
    for name, p in low.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_fused_and_loop_kernels_agree_at_low_rank(batch_first: bool) -> None:
    # The fused kernel on merged u @ v and the loop on the factors: same outputs, same gradients.
    low = LowRankLSTM.from_dense(nn.LSTM(6, 8, num_layers=2, batch_first=batch_first), 3)
    x = torch.randn(4, 7, 6, dtype=torch.float64)
    low = low.double()
    hx = (torch.randn(2, 4 if batch_first else 7, 8, dtype=torch.float64),) * 2
    results = []
    for fused in (True, False):
        low.fused = fused
        low.zero_grad()
        out, (h, c) = low(x, hx)
        (out.square().sum() + h.sum() + c.sum()).backward()
        results.append([out, h, c, *(p.grad.clone() for p in low.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_lstm_fused_kernel_gets_one_dtype_under_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN refuses a weight list that mixes dtypes ("Weight scalar types do not match"): seen on
    # an H200 under --amp when autocast ran the merge u @ v in fp16 beside fp32 biases. The
    # kernel must get what nn.LSTM gives it: every weight and bias in the parameters' dtype.
    # The spy then runs the kernel in fp32: a CPU without AVX-512 has no bf16 LSTM kernel (oneDNN
    # refuses it, as it does nn.LSTM's; --amp is refused there, training/precision.py).
    import pufferfish.lowrank.lstm as lstm_module
    seen: list[set[torch.dtype]] = []
    real = lstm_module._VF

    class Spy:
        def lstm(self, input, hx, weights, *args):  # _VF.lstm's signature
            seen.append({w.dtype for w in weights})
            with torch.autocast("cpu", enabled=False):
                return real.lstm(input.float(), tuple(h.float() for h in hx), weights, *args)

    monkeypatch.setattr(lstm_module, "_VF", Spy())
    dense = nn.LSTM(8, 16, num_layers=2)
    low = LowRankLSTM.from_dense(dense, 4, fused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = low(torch.randn(5, 3, 8))
    out.float().sum().backward()
    assert seen == [{torch.float32}]
    assert all(p.grad is not None for p in low.parameters())


def test_lstm_dropout_only_between_layers_in_training() -> None:
    dense = nn.LSTM(3, 4, num_layers=2, dropout=0.5)
    low = LowRankLSTM.from_dense(dense, 4)
    x = torch.randn(5, 2, 3)
    low.train()
    assert not torch.allclose(low(x)[0], low(x)[0])
    low.eval()
    assert rel_err(low(x)[0], dense.eval()(x)[0]) <= TOL


def test_lstm_unsupported_configurations() -> None:
    for dense, text in [(nn.LSTM(3, 4, bidirectional=True), "bidirectional=True"),
                        (nn.LSTM(3, 4, proj_size=2), "proj_size=2")]:
        assert text in LowRankLSTM.unsupported_reason(dense)
        with pytest.raises(ValueError, match=text):
            LowRankLSTM.from_dense(dense, 2)
    with pytest.raises(ValueError, match="bidirectional=True"):
        LowRankLSTM(3, 4, 2, bidirectional=True)
    with pytest.raises(ValueError, match="proj_size=3"):
        LowRankLSTM(3, 4, 2, proj_size=3)
    assert LowRankLSTM.unsupported_reason(nn.LSTM(3, 4)) is None


def test_lstm_constructor_init_matches_dense_scale() -> None:
    low = LowRankLSTM(16, 32, 8)
    merged = low.to_dense().weight_hh_l0
    assert merged.std().item() == pytest.approx((1 / 32**0.5) / 3**0.5, rel=0.15)


# ------------------------------------------------------------------------- MultiheadAttention

E, HEADS, L, S, N = 8, 2, 4, 5, 3


def _masks() -> dict[str, dict[str, object]]:
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, 3:] = True
    kpm[2, 4] = True
    causal = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1)
    return {
        "none": {},
        "kpm_bool": {"key_padding_mask": kpm},
        "kpm_float": {"key_padding_mask": torch.randn(N, S)},
        "attn_bool": {"attn_mask": causal},
        "attn_float": {"attn_mask": torch.randn(L, S)},
        "attn_3d": {"attn_mask": torch.randn(N * HEADS, L, S)},
        "causal": {"attn_mask": causal, "is_causal": True},
        "causal_kpm": {"attn_mask": causal, "is_causal": True, "key_padding_mask": kpm},
        "both_float": {"attn_mask": torch.randn(L, S), "key_padding_mask": torch.randn(N, S)},
    }


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_mha_full_rank_is_exact(batch_first: bool, need_weights: bool, average: bool) -> None:
    dense = nn.MultiheadAttention(E, HEADS, batch_first=batch_first).eval()
    low = LowRankMultiheadAttention.from_dense(dense, E).eval()
    shape = (lambda t: (N, t, E)) if batch_first else (lambda t: (t, N, E))
    q, kv = torch.randn(shape(L)), torch.randn(shape(S))  # L != S: cross-attention
    for name, kwargs in _masks().items():
        kwargs = {**kwargs, "need_weights": need_weights, "average_attn_weights": average}
        out, weights = low(q, kv, kv, **kwargs)
        ref, ref_weights = dense(q, kv, kv, **kwargs)
        assert out.shape == ref.shape and rel_err(out, ref) <= TOL, name
        if need_weights:
            assert weights.shape == ref_weights.shape and rel_err(weights, ref_weights) <= TOL
        else:
            assert weights is None and ref_weights is None


@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_unbatched_self_attention(need_weights: bool) -> None:
    dense = nn.MultiheadAttention(E, HEADS, bias=False).eval()
    low = LowRankMultiheadAttention.from_dense(dense, E).eval()
    x = torch.randn(S, E)
    kwargs = {"key_padding_mask": torch.tensor([0.0, 0.0, float("-inf"), 0.0, 0.0]),
              "attn_mask": torch.randn(HEADS, S, S), "need_weights": need_weights}
    out, weights = low(x, x, x, **kwargs)
    ref, ref_weights = dense(x, x, x, **kwargs)
    assert out.shape == ref.shape and rel_err(out, ref) <= TOL
    if need_weights:
        assert weights.shape == ref_weights.shape and rel_err(weights, ref_weights) <= TOL


def test_mha_causal_hint_needs_mask_like_torch() -> None:
    low = LowRankMultiheadAttention(E, HEADS, 2)
    x = torch.randn(L, N, E)
    with pytest.raises(RuntimeError, match="attn_mask"):
        low(x, x, x, is_causal=True)


def _swap_attention(module: nn.Module) -> nn.Module:
    low = copy.deepcopy(module)
    for parent in low.modules():
        for name in ("self_attn", "multihead_attn"):
            attn = getattr(parent, name, None)
            if isinstance(attn, nn.MultiheadAttention):
                setattr(parent, name, LowRankMultiheadAttention.from_dense(attn, attn.embed_dim))
    return low


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["eval", "eval_no_grad", "train"])
def test_mha_inside_transformer_layers(batch_first: bool, mode: str) -> None:
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, 3:] = True
    kpm[1, 4] = True
    causal = nn.Transformer.generate_square_subsequent_mask(S)
    src = torch.randn((N, S, E) if batch_first else (S, N, E))
    tgt = torch.randn((N, L, E) if batch_first else (L, N, E))
    layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=batch_first)
    # The nested-tensor path pads with zeros instead of computing padded positions: tested below.
    encoder = nn.TransformerEncoder(copy.deepcopy(layer), 2, enable_nested_tensor=False)
    cases = [
        (layer, lambda m: m(src, src_key_padding_mask=kpm)),
        (layer, lambda m: m(src, src_mask=causal, is_causal=True)),
        (encoder, lambda m: m(src, src_key_padding_mask=kpm)),
        (encoder, lambda m: m(src, mask=causal)),
        (nn.TransformerDecoderLayer(E, HEADS, 16, dropout=0.0, batch_first=batch_first),
         lambda m: m(tgt, src, tgt_mask=causal[:L, :L], tgt_is_causal=True,
                     memory_key_padding_mask=kpm)),
    ]
    for dense, call in cases:
        low = _swap_attention(dense)
        assert not any(isinstance(m, nn.MultiheadAttention) for m in low.modules())
        for m in (dense, low):
            m.train(mode == "train")
        with torch.set_grad_enabled(mode != "eval_no_grad"):
            ref, out = call(dense), call(low)
        assert out.shape == ref.shape and rel_err(out, ref) <= TOL


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_mha_replaced_in_built_encoder_declines_nested_fast_path() -> None:
    # Built around a dense layer, the encoder keeps use_nested_tensor=True after the swap; eval
    # with a padding mask then probes self_attn.in_proj_weight / out_proj.weight: no crash.
    layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    assert encoder.use_nested_tensor
    low = _swap_attention(encoder)
    kpm = torch.tensor([[False] * S, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    src = torch.randn(N, S, E)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out, ref = low(src, src_key_padding_mask=kpm), encoder(src, src_key_padding_mask=kpm)
        assert not out.is_nested
        assert rel_err(out[~kpm], ref[~kpm]) <= TOL


def test_mha_round_trip_and_registration() -> None:
    for bias in (True, False):
        dense = nn.MultiheadAttention(E, HEADS, dropout=0.1, bias=bias, batch_first=True)
        if bias:
            nn.init.normal_(dense.in_proj_bias)
            nn.init.normal_(dense.out_proj.bias)
        assert low_rank_class_for(dense) is LowRankMultiheadAttention
        merged = LowRankMultiheadAttention.from_dense(dense, E).to_dense()
        assert (merged.dropout, merged.batch_first, merged.num_heads) == (0.1, True, HEADS)
        for name, p in dense.named_parameters():
            assert rel_err(dict(merged.named_parameters())[name], p) <= TOL, name
        assert (merged.in_proj_bias is None) == (not bias)


@pytest.mark.parametrize("rank", [1, 5])
def test_mha_rank_r_error_is_eckart_young_bound(rank: int) -> None:
    dense = nn.MultiheadAttention(E, HEADS)
    low = LowRankMultiheadAttention.from_dense(dense, rank)
    merged = low.to_dense()
    originals = [*dense.in_proj_weight.chunk(3), dense.out_proj.weight]
    approximations = [*merged.in_proj_weight.chunk(3), merged.out_proj.weight]
    for w, approx, (u, v) in zip(originals, approximations, low.factor_pairs()):
        err = torch.linalg.matrix_norm((w - approx).double()).item()
        assert err == pytest.approx(_eckart_young(w, rank), rel=1e-4)
        assert u.shape == (E, rank) and v.shape == (rank, E)


@pytest.mark.parametrize("bias", [True, False])
def test_mha_params_at_rank_is_exact(bias: bool) -> None:
    dense = nn.MultiheadAttention(E, HEADS, bias=bias)
    assert LowRankMultiheadAttention.full_rank(dense) == E
    for rank in (1, 3, E):
        built = LowRankMultiheadAttention.from_dense(dense, rank)
        assert LowRankMultiheadAttention.params_at_rank(dense, rank) == _numel(built)


@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_gradients_reach_every_factor(need_weights: bool) -> None:
    low = LowRankMultiheadAttention(E, HEADS, 3, dropout=0.1)
    q, kv = torch.randn(L, N, E), torch.randn(S, N, E)
    out, _ = low(q, kv, kv, need_weights=need_weights)
    out.square().sum().backward()
    for name, p in low.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mha_unsupported_configurations() -> None:
    for kwargs, text in [({"kdim": 6}, "kdim=6"), ({"vdim": 4}, "vdim=4"),
                         ({"add_bias_kv": True}, "add_bias_kv=True"),
                         ({"add_zero_attn": True}, "add_zero_attn=True")]:
        dense = nn.MultiheadAttention(E, HEADS, **kwargs)
        assert text in LowRankMultiheadAttention.unsupported_reason(dense)
        with pytest.raises(ValueError, match=text):
            LowRankMultiheadAttention.from_dense(dense, 2)
        with pytest.raises(ValueError, match=text):
            LowRankMultiheadAttention(E, HEADS, 2, **kwargs)
    with pytest.raises(ValueError, match="num_heads=3"):
        LowRankMultiheadAttention(E, 3, 2)
    assert LowRankMultiheadAttention.unsupported_reason(nn.MultiheadAttention(E, HEADS)) is None


def test_merge_gives_back_plain_torch_modules() -> None:
    # The attention projections are not LowRankModules themselves, so merge() sees one unit.
    model = nn.ModuleDict({"lstm": nn.LSTM(E, E), "enc": nn.TransformerEncoderLayer(E, HEADS, 16)})
    low = _swap_attention(model)
    low["lstm"] = LowRankLSTM.from_dense(model["lstm"], 3)
    low.eval()
    x = torch.randn(S, N, E)
    expected = low["enc"](low["lstm"](x)[0])
    merged = merge(low)
    assert type(merged["lstm"]) is nn.LSTM and type(merged["enc"].self_attn) is nn.MultiheadAttention
    assert [name for name, _ in merged["enc"].self_attn.named_children()] == ["out_proj"]
    assert rel_err(merged["enc"](merged["lstm"](x)[0]), expected) <= TOL
