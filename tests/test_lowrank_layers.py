"""LowRankLinear / LowRankConv2d: exactness at full rank, Eckart–Young at rank r, merge symmetry."""

import pytest
import torch
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pufferfish.lowrank import LowRankConv2d, LowRankLinear, svd_split
from pufferfish.lowrank.svd import rank_from_ratio


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 24), n=st.integers(1, 24), bias=st.booleans())
def test_linear_full_rank_is_exact(m: int, n: int, bias: bool) -> None:
    dense = nn.Linear(n, m, bias=bias)
    x = torch.randn(7, n)
    low = LowRankLinear.from_dense(dense, min(m, n))
    assert rel_err(low(x), dense(x)) <= 1e-5
    assert rel_err(low.to_dense().weight, dense.weight) <= 1e-5


@pytest.mark.parametrize("stride,padding,dilation,bias,padding_mode", [
    (1, 0, 1, True, "zeros"),
    (2, 1, 1, False, "zeros"),
    (1, 2, 2, True, "reflect"),
    ((2, 1), (1, 0), 1, True, "circular"),
    (1, "same", 1, True, "replicate"),
])
def test_conv_full_rank_is_exact(stride, padding, dilation, bias, padding_mode) -> None:
    dense = nn.Conv2d(5, 12, (3, 3), stride=stride, padding=padding, dilation=dilation, bias=bias,
                      padding_mode=padding_mode)
    x = torch.randn(2, 5, 11, 9)
    low = LowRankConv2d.from_dense(dense, LowRankConv2d.full_rank(dense))
    assert low(x).shape == dense(x).shape
    assert rel_err(low(x), dense(x)) <= 1e-5
    merged = low.to_dense()
    assert rel_err(merged(x), dense(x)) <= 1e-5
    assert (merged.bias is None) == (dense.bias is None)


def _eckart_young(w: torch.Tensor, rank: int) -> tuple[float, float]:
    s = torch.linalg.svdvals(w.double())
    return s[rank:].square().sum().sqrt().item(), s[rank].item() if rank < len(s) else 0.0


@pytest.mark.parametrize("rank", [1, 3, 8])
def test_rank_r_error_is_eckart_young_bound(rank: int) -> None:
    linear = nn.Linear(20, 16)
    conv = nn.Conv2d(6, 16, 3)
    for dense, merged in [
        (linear.weight, LowRankLinear.from_dense(linear, rank).to_dense().weight),
        (conv.weight.flatten(1), LowRankConv2d.from_dense(conv, rank).to_dense().weight.flatten(1)),
    ]:
        fro, spectral = _eckart_young(dense, rank)
        err = (dense - merged).double()
        assert torch.linalg.matrix_norm(err).item() == pytest.approx(fro, rel=1e-4)
        assert torch.linalg.matrix_norm(err, ord=2).item() == pytest.approx(spectral, rel=1e-4)


def test_svd_split_balances_singular_values() -> None:
    w = torch.randn(10, 6)
    left, right = svd_split(w, 4)
    assert left.shape == (10, 4) and right.shape == (4, 6)
    # √Σ on each side: both factors have the same singular values.
    torch.testing.assert_close(torch.linalg.svdvals(left), torch.linalg.svdvals(right))
    with pytest.raises(ValueError, match="rank 7 is out of range"):
        svd_split(w, 7)


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5, float("nan")])
def test_bad_ratio_names_the_value(ratio: float) -> None:
    with pytest.raises(ValueError, match="rank ratio"):
        rank_from_ratio(64, ratio)


def test_rank_from_ratio() -> None:
    assert rank_from_ratio(64, 0.25) == 16
    assert rank_from_ratio(3, 0.01) == 1
    assert rank_from_ratio(10, 1.0) == 10


def test_extra_bn_merges_into_dense() -> None:
    dense = nn.Conv2d(4, 8, 3, padding=1)
    low = LowRankConv2d.from_dense(dense, 3, extra_bn=True)
    x = torch.randn(4, 4, 6, 6)
    low.train()
    for _ in range(3):  # give the BN non-trivial running statistics
        low(x + torch.randn_like(x))
    low.eval()
    torch.testing.assert_close(low.to_dense()(x), low(x), rtol=1e-4, atol=1e-5)


def test_gradients_reach_both_factors() -> None:
    for low in [LowRankLinear.from_dense(nn.Linear(8, 6), 2),
                LowRankConv2d.from_dense(nn.Conv2d(3, 6, 3), 2)]:
        x = torch.randn(2, 8) if isinstance(low, LowRankLinear) else torch.randn(2, 3, 5, 5)
        low(x).square().sum().backward()
        for name, p in low.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_params_at_rank_matches_built_module() -> None:
    for dense, cls in [(nn.Linear(30, 20), LowRankLinear), (nn.Linear(30, 20, bias=False), LowRankLinear),
                       (nn.Conv2d(8, 16, 3), LowRankConv2d), (nn.Conv2d(8, 16, 3, bias=False), LowRankConv2d)]:
        low = cls.from_dense(dense, 5)
        assert cls.params_at_rank(dense, 5) == sum(p.numel() for p in low.parameters())


def test_extra_repr_is_readable() -> None:
    text = repr(LowRankConv2d.from_dense(nn.Conv2d(8, 16, 3, stride=2), 4))
    assert "rank=4" in text and "stride=(2, 2)" in text
