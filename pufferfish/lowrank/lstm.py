"""Low-rank replacement of ``nn.LSTM``.

Per layer, the stacked input-to-hidden weight ``W_ih`` (``4h x in``) and hidden-to-hidden weight
``W_hh`` (``4h x h``) of the four gates (order i, f, g, o, as in ``nn.LSTM``) each become a
product ``u @ v`` with ``u = U√Σ`` and ``v = √ΣVᵀ`` (:func:`svd_split`); the biases stay dense.

Rank choice: one ``rank`` is asked for and every matrix gets ``min(rank, rows, cols)``. So
``full_rank`` is the largest ``min(rows, cols)`` over the matrices,
``max(h, min(4h, input_size))``: the smallest rank at which every matrix is kept exactly, hence
the rank at which the layer reproduces the dense LSTM. When ``input_size == hidden_size`` (the
usual language-model case) that is simply ``h``.

Two kernels compute the same function (``fused``, default False):

- **fused**: merge each pair ``u @ v`` (one small matmul per matrix and forward pass), then run
  the fused LSTM kernel that ``nn.LSTM`` runs (ATen's on CPU, cuDNN's on GPU). The recurrence
  costs what the dense layer's does; what factorizing saves is parameters, i.e. the gradient
  bytes DDP sends, which is Pufferfish's point. It wins where the recurrence's per-step overhead
  dominates: a Python loop over ``seq_len`` small steps launches several kernels per step (on a
  2-core CPU at h = 150, rank 38, the loop trains 1.7x slower than the dense layer, the fused
  kernel about at its speed).
- **loop** (default): the input projections of the whole sequence at once, then a Python loop
  over time steps with the two thin matmuls ``h @ v_hhᵀ @ u_hhᵀ``: ``r·(in + 4h)`` instead of
  ``4h·in`` MACs per step and matrix, the arithmetic the paper counts. It wins where those MACs
  dominate (same CPU, h = 650 and 1500: 0.63x and 0.37x the dense time; the fused kernel 1.18x
  and 1.30x, as the merges cost ``4h·in·r`` per forward pass; docs/benchmarks.md).

``benchmarks/lstm_kernels.py`` measures both; the training recipe times both on the run's real
shapes at the switch and keeps the faster (:func:`pufferfish.auto.time_kernels`).
:func:`~pufferfish.count_macs` counts the factorized arithmetic (the loop's) whichever is set.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import _VF, nn
from torch.nn.utils.rnn import PackedSequence

from .base import LowRankModule, register_low_rank
from .svd import svd_split

__all__ = ["LowRankLSTM"]


def _unsupported(bidirectional: bool, proj_size: int) -> str | None:
    if bidirectional:
        return "a bidirectional LSTM (bidirectional=True)"
    if proj_size > 0:
        return f"an LSTM with projections (proj_size={proj_size})"
    return None


def _matrices(input_size: int, hidden_size: int, num_layers: int) -> list[tuple[str, int, int]]:
    """``(suffix, rows, cols)`` of every weight matrix in ``nn.LSTM``'s order ``ih_l0, hh_l0, ...``."""
    return [(f"{kind}_l{k}", 4 * hidden_size, cols)
            for k in range(num_layers)
            for kind, cols in (("ih", input_size if k == 0 else hidden_size), ("hh", hidden_size))]


class LowRankLSTM(LowRankModule):
    """Drop-in ``nn.LSTM`` (unidirectional, no projections) with rank-``rank`` gate weights.

    ``fused`` picks the kernel (see the module docs): True runs ``nn.LSTM``'s fused kernel on the
    merged weights ``u @ v``; False a Python loop over time steps on the factors. Factors are
    ``u_{ih,hh}_l{k}`` (``4h x r``) and ``v_{ih,hh}_l{k}`` (``r x cols``); biases
    ``bias_{ih,hh}_l{k}`` as in ``nn.LSTM``. ``PackedSequence`` input is not supported.
    """

    dense_type = nn.LSTM

    def __init__(self, input_size: int, hidden_size: int, rank: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, fused: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        reason = _unsupported(bidirectional, proj_size)
        if reason is not None:
            raise ValueError(f"LowRankLSTM does not support {reason}")
        if rank < 1:
            raise ValueError(f"rank {rank} is out of range: it must be at least 1")
        self.input_size, self.hidden_size, self.rank = input_size, hidden_size, rank
        self.num_layers, self.bias = num_layers, bias
        self.batch_first, self.dropout, self.fused = batch_first, dropout, fused
        self.bidirectional, self.proj_size, self.mode = False, 0, "LSTM"  # as nn.LSTM's
        factory = {"device": device, "dtype": dtype}
        for suffix, rows, cols in _matrices(input_size, hidden_size, num_layers):
            r = min(rank, rows, cols)
            self.register_parameter(f"u_{suffix}", nn.Parameter(torch.empty(rows, r, **factory)))
            self.register_parameter(f"v_{suffix}", nn.Parameter(torch.empty(r, cols, **factory)))
            if bias:
                self.register_parameter(f"bias_{suffix}", nn.Parameter(torch.empty(rows, **factory)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.LSTM``'s init, U(-k, k) with k = 1/√h, in distribution of the merged weights.

        Factor entries U(-a, a) with ``a = (3/r)^¼ √k`` give every entry of ``u @ v`` the variance
        k²/3 of a dense U(-k, k) entry, so a freshly built low-rank LSTM starts at the usual scale.
        """
        k = 1.0 / math.sqrt(self.hidden_size)
        for name, p in self.named_parameters():
            if name.startswith("bias_"):
                nn.init.uniform_(p, -k, k)
            else:
                r = p.shape[1] if name.startswith("u_") else p.shape[0]
                a = (3.0 / r) ** 0.25 * math.sqrt(k)
                nn.init.uniform_(p, -a, a)

    def forward(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``nn.LSTM.forward``: ``(output, (h_n, c_n))`` for batched or unbatched ``input``."""
        if isinstance(input, PackedSequence):
            raise TypeError("LowRankLSTM does not accept PackedSequence input: allowed a padded "
                            "tensor, or the layer kept full rank (keep=[its name])")
        batched = input.dim() == 3
        if not batched:
            input = input.unsqueeze(1)
            hx = None if hx is None else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        elif self.batch_first:
            input = input.transpose(0, 1)
        batch = input.shape[1]
        expected = (self.num_layers, batch, self.hidden_size)
        if hx is None:
            zeros = input.new_zeros(expected)
            hx = (zeros, zeros)
        for name, state in zip(("h_0", "c_0"), hx):
            if tuple(state.shape) != expected:
                raise RuntimeError(f"Expected {name} of shape {expected}, got {tuple(state.shape)}")

        if self.fused:
            output, h_n, c_n = self._fused(input, hx)
        else:
            output, h_n, c_n = self._loop(input, hx)
        if not batched:
            return output.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, (h_n, c_n)

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        """``weight_{ih,hh}_l{k}`` as ``nn.LSTM`` names them: the merged ``u @ v`` (read-only).

        Code that reads an LSTM's gate weights (shape checks, norms, export) sees what the dense
        layer would have; they are not parameters, so optimizers, DDP and ``state_dict`` see only
        the factors.
        """
        if name.startswith("weight_") and name[7:] in self._suffixes():
            return super().__getattr__(f"u_{name[7:]}") @ super().__getattr__(f"v_{name[7:]}")
        return super().__getattr__(name)

    def flatten_parameters(self) -> None:
        """``nn.LSTM.flatten_parameters``, which models call in ``forward`` for cuDNN: nothing to
        do, the factors are parameters of their own with no flat cuDNN buffer."""

    def _suffixes(self) -> list[str]:
        return [suffix for suffix, _, _ in _matrices(self.input_size, self.hidden_size,
                                                     self.num_layers)]

    @property
    def all_weights(self) -> list[list[torch.Tensor]]:
        """``nn.LSTM.all_weights``: per layer ``[w_ih, w_hh, b_ih, b_hh]`` (merged weights)."""
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh") if self.bias else ("weight_ih", "weight_hh")
        return [[getattr(self, f"{n}_l{k}") for n in names] for k in range(self.num_layers)]

    def _fused(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The kernel nn.LSTM.forward calls, with nn.LSTM's weight order (w_ih, w_hh, b_ih, b_hh
        # per layer); input is (seq, batch, features) here. Gradients reach the factors through
        # the merge. The merge runs outside autocast, so the kernel gets weights and biases of one
        # dtype, as from nn.LSTM (cuDNN refuses fp16 merged weights beside fp32 biases).
        weights: list[torch.Tensor] = []
        for k in range(self.num_layers):
            with torch.autocast(input.device.type, enabled=False):
                for kind in ("ih", "hh"):
                    weights.append(getattr(self, f"u_{kind}_l{k}") @ getattr(self, f"v_{kind}_l{k}"))
            if self.bias:
                weights += [getattr(self, f"bias_ih_l{k}"), getattr(self, f"bias_hh_l{k}")]
        output, h_n, c_n = _VF.lstm(input, hx, weights, self.bias, self.num_layers,
                                    float(self.dropout), self.training, False, False)
        return output, h_n, c_n

    def _loop(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer_input, h_n, c_n = input, [], []
        for k in range(self.num_layers):
            u_ih, v_ih = getattr(self, f"u_ih_l{k}"), getattr(self, f"v_ih_l{k}")
            u_hh, v_hh = getattr(self, f"u_hh_l{k}"), getattr(self, f"v_hh_l{k}")
            bias = getattr(self, f"bias_ih_l{k}") + getattr(self, f"bias_hh_l{k}") if self.bias else None
            # All time steps' input projections at once; only the recurrence stays in the loop.
            gates_x = F.linear(F.linear(layer_input, v_ih), u_ih, bias)
            h, c = hx[0][k], hx[1][k]
            steps = []
            for gx in gates_x:
                i, f, g, o = (gx + F.linear(F.linear(h, v_hh), u_hh)).chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                steps.append(h)
            layer_input = torch.stack(steps)
            if self.training and self.dropout > 0 and k < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout)
            h_n.append(h)
            c_n.append(c)

        return layer_input, torch.stack(h_n), torch.stack(c_n)

    def __prepare_scriptable__(self) -> nn.Module:
        """Called by ``torch.jit.script``: say clearly why this layer cannot be scripted."""
        raise TypeError("LowRankLSTM cannot be compiled by torch.jit.script (its forward walks the layers' factors by name and picks a kernel in Python); "
                        "use torch.compile or torch.export, or script the merged model "
                        "(pufferfish.merge)")

    @classmethod
    def unsupported_reason(cls, dense: nn.LSTM) -> str | None:
        return _unsupported(dense.bidirectional, dense.proj_size)

    @classmethod
    def full_rank(cls, dense: nn.LSTM) -> int:
        return max(min(rows, cols)
                   for _, rows, cols in _matrices(dense.input_size, dense.hidden_size,
                                                  dense.num_layers))

    @classmethod
    def params_at_rank(cls, dense: nn.LSTM, rank: int, **options: object) -> int:
        matrices = _matrices(dense.input_size, dense.hidden_size, dense.num_layers)
        biases = sum(rows for _, rows, _ in matrices) if dense.bias else 0
        return sum(min(rank, rows, cols) * (rows + cols) for _, rows, cols in matrices) + biases

    @classmethod
    def from_dense(cls, dense: nn.LSTM, rank: int, **options: object) -> Self:
        w = dense.weight_ih_l0
        layer = cls(dense.input_size, dense.hidden_size, rank, num_layers=dense.num_layers,
                    bias=dense.bias, batch_first=dense.batch_first, dropout=dense.dropout,
                    bidirectional=dense.bidirectional, proj_size=dense.proj_size,
                    fused=bool(options.get("fused", False)), device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for suffix, rows, cols in _matrices(dense.input_size, dense.hidden_size,
                                                dense.num_layers):
                left, right = svd_split(getattr(dense, f"weight_{suffix}"), min(rank, rows, cols))
                getattr(layer, f"u_{suffix}").copy_(left)
                getattr(layer, f"v_{suffix}").copy_(right)
                if dense.bias:
                    getattr(layer, f"bias_{suffix}").copy_(getattr(dense, f"bias_{suffix}"))
        return layer

    @classmethod
    def rank_from_state_dict(cls, state: Mapping[str, torch.Tensor]
                             ) -> tuple[int, dict[str, object]]:
        ranks = [t.shape[0] for name, t in state.items() if name.startswith("v_")]
        if not ranks:
            raise KeyError("v_ih_l0")
        return max(ranks), {}

    def to_dense(self) -> nn.LSTM:
        w = self.u_ih_l0
        dense = nn.LSTM(self.input_size, self.hidden_size, num_layers=self.num_layers,
                        bias=self.bias, batch_first=self.batch_first, dropout=self.dropout,
                        device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for suffix, _, _ in _matrices(self.input_size, self.hidden_size, self.num_layers):
                merged = getattr(self, f"u_{suffix}") @ getattr(self, f"v_{suffix}")
                getattr(dense, f"weight_{suffix}").copy_(merged)
                if self.bias:
                    getattr(dense, f"bias_{suffix}").copy_(getattr(self, f"bias_{suffix}"))
        return dense

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"u_{suffix}"), getattr(self, f"v_{suffix}"))
                for suffix, _, _ in _matrices(self.input_size, self.hidden_size, self.num_layers)]

    # --- what code that reads a model asks (see pufferfish.lowrank.base)

    @classmethod
    def dense_matrices(cls, dense: nn.LSTM) -> list[torch.Tensor]:
        """``[W_ih_l0, W_hh_l0, W_ih_l1, ...]``: every gate matrix, each truncated at the rank."""
        return [p for name, p in dense.named_parameters(recurse=False)
                if name.startswith("weight_")]

    @classmethod
    def shape_summary(cls, dense: nn.LSTM) -> str:
        return f"{dense.input_size}->{dense.hidden_size} x{dense.num_layers}"

    @classmethod
    def uncounted_macs(cls, dense: nn.LSTM, args: tuple[Any, ...], output: Any) -> int:
        """``nn.LSTM``'s fused kernel is invisible to the flop counter: per time step and layer
        ``4h·(in + h)`` MACs."""
        x = args[0]
        steps = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
        macs, width = 0, dense.input_size
        for _ in range(dense.num_layers):
            macs += steps * 4 * dense.hidden_size * (width + dense.hidden_size)
            width = dense.hidden_size
        return macs

    @classmethod
    @contextmanager
    def counting(cls, module: nn.Module) -> Iterator[None]:
        """A :class:`LowRankLSTM` is counted as its factorized arithmetic (the loop kernel, run
        while counting) whichever kernel it trains with: the fused kernel is an execution choice
        made by timing, not a different model."""
        if not isinstance(module, LowRankLSTM):
            yield
            return
        fused, module.fused = module.fused, False
        try:
            yield
        finally:
            module.fused = fused

    def kernel_options(self) -> tuple[str, ...]:
        return ("fused", "loop")

    def current_kernel(self) -> str:
        return "fused" if self.fused else "loop"

    def use_kernel(self, name: str) -> None:
        if name not in self.kernel_options():
            super().use_kernel(name)  # raises, naming the allowed kernels
        self.fused = name == "fused"

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, rank={self.rank}, "
                f"num_layers={self.num_layers}, bias={self.bias}, "
                f"batch_first={self.batch_first}, dropout={self.dropout}, fused={self.fused}")


register_low_rank(nn.LSTM, LowRankLSTM)
