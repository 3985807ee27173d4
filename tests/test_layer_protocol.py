"""A third-party layer type goes through every reader of a model by the layer protocol alone.

``TwoMatrix`` is unknown to pufferfish (no ``weight``, two matrices, a forward the flop counter
cannot see); once registered, MAC counting, the report, stable ranks, the automatic rank rule
and kernel timing work on it through the methods of its low-rank class, with no branch on its
type anywhere in pufferfish.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

import pufferfish as pf
from pufferfish.auto import (
    StableRankTracker,
    choose_ranks,
    layer_matrix,
    layer_stable_rank,
    profile_keep,
    stable_rank,
    time_kernels,
)
from pufferfish.lowrank import base


class TwoMatrix(nn.Module):
    """``y = x·(A + B)``, written with broadcasting so that the flop counter sees no matmul."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)
        self.b = nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-1) * (self.a + self.b)).sum(-2)


class LowRankTwoMatrix(pf.LowRankModule):
    """Each matrix as ``left @ right``; two kernels: on the factors, or on the merged sum."""

    dense_type = TwoMatrix

    def __init__(self, n_in: int, n_out: int, rank: int) -> None:
        super().__init__()
        self.n_in, self.n_out, self.rank, self.merged = n_in, n_out, rank, False
        self.la, self.lb = (nn.Parameter(torch.empty(n_in, rank)) for _ in range(2))
        self.ra, self.rb = (nn.Parameter(torch.empty(rank, n_out)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return x @ (self.la @ self.ra + self.lb @ self.rb)
        return (x @ self.la) @ self.ra + (x @ self.lb) @ self.rb

    @classmethod
    def full_rank(cls, dense: TwoMatrix) -> int:
        return min(dense.a.shape)

    @classmethod
    def params_at_rank(cls, dense: TwoMatrix, rank: int, **options: object) -> int:
        return 2 * rank * sum(dense.a.shape)

    @classmethod
    def from_dense(cls, dense: TwoMatrix, rank: int, **options: object) -> LowRankTwoMatrix:
        layer = cls(*dense.a.shape, rank)
        with torch.no_grad():
            for name in ("a", "b"):
                left, right = pf.svd_split(getattr(dense, name), rank)
                getattr(layer, f"l{name}").copy_(left)
                getattr(layer, f"r{name}").copy_(right)
        return layer

    @classmethod
    def rank_from_state_dict(cls, state: Mapping[str, torch.Tensor]
                             ) -> tuple[int, dict[str, object]]:
        return state["la"].shape[1], {}

    def to_dense(self) -> TwoMatrix:
        dense = TwoMatrix(self.n_in, self.n_out)
        with torch.no_grad():
            dense.a.copy_(self.la @ self.ra)
            dense.b.copy_(self.lb @ self.rb)
        return dense

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.la, self.ra), (self.lb, self.rb)]

    # --- what readers of a model ask
    @classmethod
    def dense_matrices(cls, dense: TwoMatrix) -> list[torch.Tensor]:
        return [dense.a, dense.b]

    @classmethod
    def shape_summary(cls, dense: TwoMatrix) -> str:
        return f"2 x {dense.a.shape[0]}x{dense.a.shape[1]}"

    @classmethod
    def uncounted_macs(cls, dense: TwoMatrix, args: tuple[Any, ...], output: Any) -> int:
        rows = args[0].numel() // dense.a.shape[0]
        return rows * dense.a.numel()

    def kernel_options(self) -> tuple[str, ...]:
        return ("factors", "merged")

    def current_kernel(self) -> str:
        return "merged" if self.merged else "factors"

    def use_kernel(self, name: str) -> None:
        if name not in self.kernel_options():
            super().use_kernel(name)
        self.merged = name == "merged"


@pytest.fixture
def registered() -> Iterator[None]:
    pf.register_low_rank(TwoMatrix, LowRankTwoMatrix)
    yield
    base._REGISTRY.pop(TwoMatrix)


@pytest.mark.usefixtures("registered")
def test_third_party_type_is_counted_reported_and_ranked_through_the_protocol() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TwoMatrix(32, 24), nn.ReLU(), nn.Linear(24, 4))
    x = torch.randn(5, 32)

    # Stable ranks: the mean over the class's dense matrices, init values for the rank rule.
    a, b = model[0].a, model[0].b
    expected = (stable_rank(a) + stable_rank(b)) / 2
    assert layer_stable_rank(model[0]) == pytest.approx(expected, rel=1e-6)
    tracker = StableRankTracker(model)
    assert tracker.initial["0"] == pytest.approx(expected, rel=1e-6)
    assert tracker.full_ranks["0"] == 24
    assert choose_ranks(tracker, max_ratio=0.25)["0"] == 6  # unchanged spectrum: the budget cap

    # MACs: the flop counter sees none of TwoMatrix's arithmetic; uncounted_macs adds it.
    assert pf.count_macs(model, x) == 5 * 32 * 24 + 5 * 24 * 4
    report = pf.factorize(model, rank=3, keep=["2"], example_input=x)
    (decision,) = report.factorized
    assert (decision.name, decision.shape, decision.rank) == ("0", "2 x 32x24", 3)
    assert report.macs_before == 5 * 32 * 24 + 5 * 24 * 4
    assert report.macs_after == 5 * 2 * 3 * (32 + 24) + 5 * 24 * 4  # its matmuls, counted
    low = model[0]
    assert isinstance(low, LowRankTwoMatrix)
    assert [tuple(m.shape) for m in layer_matrix(low)] == [(32, 24), (32, 24)]

    # Kernels: each option timed (structure only: timings on a loaded machine decide nothing).
    chosen = time_kernels(model, x, repeats=1, warmup=0)["0"]
    assert set(chosen) == {"kernel", "factors_ms", "merged_ms"}
    assert chosen["kernel"] in ("factors", "merged")
    with torch.no_grad():
        out = model(x)
        low.use_kernel("merged")
        torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-5)
    assert low.current_kernel() == "merged"
    with pytest.raises(ValueError, match="no kernel 'fast': allowed factors, merged"):
        low.use_kernel("fast")


@pytest.mark.usefixtures("registered")
def test_profile_keep_times_every_kernel_of_a_third_party_type() -> None:
    model = nn.Sequential(TwoMatrix(32, 32), nn.ReLU())
    _, measured = profile_keep(model, torch.randn(4, 32), {"0": 4}, repeats=1, warmup=0)
    assert set(measured["0"]["kernel_ms"]) == {"factors", "merged"}
    assert measured["0"]["lowrank_ms"] == min(measured["0"]["kernel_ms"].values())


def test_one_kernel_layers_refuse_a_kernel_by_name() -> None:
    low = pf.LowRankLinear(4, 4, 2)
    assert low.kernel_options() == () and low.current_kernel() is None
    with pytest.raises(ValueError, match="LowRankLinear has no kernel 'fused': allowed none"):
        low.use_kernel("fused")


@pytest.mark.parametrize("dense, example", [
    (nn.Linear(12, 10), (torch.randn(5, 12),)),
    (nn.Conv2d(6, 8, 3, padding=1), (torch.randn(2, 6, 7, 7),)),
    (nn.LSTM(7, 9, num_layers=2), (torch.randn(4, 3, 7),)),
    (nn.MultiheadAttention(8, 2), (torch.randn(4, 3, 8),) * 3),
])
def test_projected_dense_gradient_is_the_factors_gradient(dense: nn.Module,
                                                          example: tuple[torch.Tensor, ...]) -> None:
    """The chain rule, checked: the gradient of a loss with respect to the dense weights
    ``W = L @ R``, projected, equals the gradient the low-rank layer's own factors get."""
    torch.manual_seed(0)
    low = base.low_rank_class_for(dense).from_dense(dense, 3)

    def loss(module: nn.Module) -> torch.Tensor:
        out = module(*example)
        return (out[0] if isinstance(out, tuple) else out).square().sum()

    merged = low.to_dense()  # W = L @ R exactly: the point where both gradients are taken
    dense_grads = dict(zip([n for n, _ in merged.named_parameters()],
                           torch.autograd.grad(loss(merged), list(merged.parameters()))))
    factor_grads = dict(zip([n for n, _ in low.named_parameters()],
                            torch.autograd.grad(loss(low), list(low.parameters()))))
    projected = low.project_dense_state(dense_grads)
    matrices = [n for n, p in low.named_parameters() if p.dim() > 1]
    assert set(matrices) <= set(projected)
    for name, value in projected.items():
        torch.testing.assert_close(value, factor_grads[name], rtol=1e-4, atol=1e-5)
    if isinstance(dense, nn.MultiheadAttention):  # q/k/v biases: the thirds of in_proj_bias
        assert {"q_proj.u.bias", "k_proj.u.bias", "v_proj.u.bias"} <= set(projected)
