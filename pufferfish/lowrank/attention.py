"""Low-rank replacement of ``nn.MultiheadAttention``.

The query, key, value and output projections (each ``E x E``) become four ``v``-then-``u``
factor pairs at the same rank (the ``LowRankLinear`` layout), built by :func:`svd_split` from the
thirds of the dense ``in_proj_weight`` and from ``out_proj.weight``. Attention itself (masks,
causal hint, dropout, returned weights) follows ``nn.MultiheadAttention`` exactly, so the layer
can stand in as ``self_attn`` / ``multihead_attn`` of torch's transformer layers.

Those transformer modules probe ``self_attn`` for an inference fast path that needs a packed dense
``in_proj_weight``. This layer declines it: ``_qkv_same_embed_dim`` is ``False``, ``in_proj_bias``
is ``None``, and ``in_proj_weight`` is a placeholder (see :class:`_NoPackedWeight`). When an
``nn.TransformerEncoder`` whose *first* layer is still dense packs a padded batch into a nested
tensor (eval, ``enable_nested_tensor=True``, padding mask), the later layers receive that nested
tensor: this layer then attends over the padded batch with the padding masked, and packs the
result back (:meth:`LowRankMultiheadAttention._forward_nested`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from .base import LowRankModule, register_low_rank
from .svd import svd_split

__all__ = ["LowRankMultiheadAttention"]


class _NoPackedWeight:
    """``in_proj_weight`` of a layer whose projections are separate low-rank factors.

    ``nn.TransformerEncoder``'s nested-tensor fast path (eval mode, padding mask given) collects
    ``self_attn.in_proj_weight`` with other tensors and backs off only if one of them overrides
    ``__torch_function__``; ``None`` there would crash on ``.requires_grad`` or, under
    ``no_grad``, send nested tensors into a layer that cannot take them.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return NotImplemented


class _Projection(nn.Module):
    """One ``E x E`` projection as ``v`` (``E -> r``, no bias) then ``u`` (``r -> E``), the
    :class:`LowRankLinear` layout.

    Deliberately not a :class:`LowRankModule`: the attention layer is the unit that is factorized,
    merged and asked for ``factor_pairs``, so code that walks a model for low-rank modules must
    not find its projections a second time. ``weight`` (``u @ v``) and ``bias`` are the dense view
    that torch's transformer layers read from ``self_attn.out_proj`` before declining their fast
    path.
    """

    def __init__(self, features: int, rank: int, bias: bool, device: torch.device | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.v = nn.Linear(features, rank, bias=False, device=device, dtype=dtype)
        self.u = nn.Linear(rank, features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))

    @property
    def weight(self) -> torch.Tensor:
        return self.u.weight @ self.v.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.u.bias


def _unsupported(embed_dim: int, kdim: int | None, vdim: int | None, add_bias_kv: bool,
                 add_zero_attn: bool) -> str | None:
    for name, dim in (("kdim", kdim), ("vdim", vdim)):
        if dim is not None and dim != embed_dim:
            return f"{name}={dim} different from embed_dim={embed_dim}"
    if add_bias_kv:
        return "add_bias_kv=True"
    if add_zero_attn:
        return "add_zero_attn=True"
    return None


def _additive(mask: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (``True`` = masked) as the additive float mask torch turns it into."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
    return mask


class LowRankMultiheadAttention(LowRankModule):
    """Drop-in ``nn.MultiheadAttention`` (``kdim == vdim == embed_dim``) with rank-``rank``
    projections ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``.
    """

    dense_type = nn.MultiheadAttention
    _qkv_same_embed_dim: ClassVar[bool] = False
    in_proj_weight: ClassVar[_NoPackedWeight] = _NoPackedWeight()
    in_proj_bias: ClassVar[None] = None

    def __init__(self, embed_dim: int, num_heads: int, rank: int, dropout: float = 0.0,
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        reason = _unsupported(embed_dim, kdim, vdim, add_bias_kv, add_zero_attn)
        if reason is not None:
            raise ValueError(f"LowRankMultiheadAttention does not support {reason}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.embed_dim, self.kdim, self.vdim = embed_dim, embed_dim, embed_dim
        self.num_heads, self.head_dim, self.rank = num_heads, embed_dim // num_heads, rank
        self.dropout, self.batch_first = dropout, batch_first
        self.q_proj = _Projection(embed_dim, rank, bias, device, dtype)
        self.k_proj = _Projection(embed_dim, rank, bias, device, dtype)
        self.v_proj = _Projection(embed_dim, rank, bias, device, dtype)
        self.out_proj = _Projection(embed_dim, rank, bias, device, dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward``: ``(attn_output, attn_weights or None)``.

        Uses ``F.scaled_dot_product_attention`` unless the weights are asked for.
        """
        if query.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights,
                                        attn_mask, average_attn_weights, is_causal)
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]

        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as in "
                               "nn.MultiheadAttention); nn.Transformer."
                               "generate_square_subsequent_mask makes one")
        # As torch: the hint replaces the mask only when nothing must be merged into it.
        causal_hint = is_causal and key_padding_mask is None and not need_weights
        mask = None if causal_hint else self._merged_mask(
            attn_mask, key_padding_mask, batch, tgt_len, src_len, query.dtype)

        q, k, v = (proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                   for proj, x in ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value)))
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * self.head_dim ** -0.5) @ k.transpose(-2, -1)
            weights = (scores if mask is None else scores + mask).softmax(dim=-1)
            if dropout_p > 0:
                weights = F.dropout(weights, dropout_p)
            out = weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=causal_hint)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim))

        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _forward_nested(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        key_padding_mask: torch.Tensor | None, need_weights: bool,
                        attn_mask: torch.Tensor | None, average_attn_weights: bool,
                        is_causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention over a nested batch ``(batch, *seq*, embed)``: pad, mask, pack back.

        What ``nn.TransformerEncoder``'s fast path sends to every layer after the first once it
        has packed the batch (nested tensors are batch-first whatever ``batch_first`` says).
        """
        if key is not query or value is not query:
            raise NotImplementedError("LowRankMultiheadAttention takes a nested tensor only for "
                                      "self-attention (query is key is value)")
        if key_padding_mask is not None:
            raise NotImplementedError("key_padding_mask cannot be combined with a nested input: "
                                      "the nested tensor's lengths are the padding")
        lengths = [t.shape[0] for t in query.unbind()]
        padded = query.to_padded_tensor(0.0)
        positions = torch.arange(padded.shape[1], device=padded.device)
        padding = positions[None, :] >= torch.tensor(lengths, device=padded.device)[:, None]
        x = padded if self.batch_first else padded.transpose(0, 1)
        out, weights = self.forward(x, x, x, padding, need_weights, attn_mask,
                                    average_attn_weights, is_causal)
        out = out if self.batch_first else out.transpose(0, 1)
        packed = torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, lengths)])
        return packed, weights

    def _merged_mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
                     batch: int, tgt_len: int, src_len: int,
                     dtype: torch.dtype) -> torch.Tensor | None:
        """Both masks as one additive mask broadcastable to ``(N, heads, L, S)``, as torch sums them."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, "attn_mask", dtype)
            shapes = {2: (tgt_len, src_len), 3: (batch * self.num_heads, tgt_len, src_len)}
            if mask.dim() not in shapes:
                raise RuntimeError(f"attn_mask's dimension {mask.dim()} is not supported")
            if tuple(mask.shape) != shapes[mask.dim()]:
                raise RuntimeError(f"The shape of the {mask.dim()}D attn_mask is "
                                   f"{tuple(mask.shape)}, but should be {shapes[mask.dim()]}.")
            mask = mask.view(-1, self.num_heads if mask.dim() == 3 else 1, tgt_len, src_len)
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask, "key_padding_mask", dtype)
            if tuple(padding.shape) != (batch, src_len):
                raise RuntimeError(f"key_padding_mask has shape {tuple(padding.shape)}, "
                                   f"expected {(batch, src_len)}")
            padding = padding.view(batch, 1, 1, src_len)
            mask = padding if mask is None else mask + padding
        return mask

    def __prepare_scriptable__(self) -> nn.Module:
        """Called by ``torch.jit.script``: say clearly why this layer cannot be scripted."""
        raise TypeError("LowRankMultiheadAttention cannot be compiled by torch.jit.script (its forward handles nested and masked inputs in Python); "
                        "use torch.compile or torch.export, or script the merged model "
                        "(pufferfish.merge)")

    @classmethod
    def unsupported_reason(cls, dense: nn.MultiheadAttention) -> str | None:
        reason = _unsupported(dense.embed_dim, dense.kdim, dense.vdim, dense.bias_k is not None,
                              dense.add_zero_attn)
        if reason is None and (dense.in_proj_bias is None) != (dense.out_proj.bias is None):
            return "in_proj_bias and out_proj.bias not both present or both None"
        return reason

    @classmethod
    def full_rank(cls, dense: nn.MultiheadAttention) -> int:
        return dense.embed_dim

    @classmethod
    def params_at_rank(cls, dense: nn.MultiheadAttention, rank: int, **options: object) -> int:
        bias = 4 * dense.embed_dim if dense.in_proj_bias is not None else 0
        return 4 * rank * 2 * dense.embed_dim + bias

    @classmethod
    def from_dense(cls, dense: nn.MultiheadAttention, rank: int, **options: object) -> Self:
        reason = cls.unsupported_reason(dense)
        if reason is not None:
            raise ValueError(f"LowRankMultiheadAttention does not support {reason}")
        w = dense.out_proj.weight
        layer = cls(dense.embed_dim, dense.num_heads, rank, dropout=dense.dropout,
                    bias=dense.in_proj_bias is not None, batch_first=dense.batch_first,
                    device=w.device, dtype=w.dtype)
        weights = [*dense.in_proj_weight.chunk(3), w]
        biases = ([*dense.in_proj_bias.chunk(3), dense.out_proj.bias]
                  if dense.in_proj_bias is not None else [None] * 4)
        with torch.no_grad():
            for proj, weight, bias in zip(layer._projections(), weights, biases):
                left, right = svd_split(weight, rank)
                proj.u.weight.copy_(left)
                proj.v.weight.copy_(right)
                if bias is not None:
                    proj.u.bias.copy_(bias)
        return layer

    @classmethod
    def rank_from_state_dict(cls, state: Mapping[str, torch.Tensor]
                             ) -> tuple[int, dict[str, object]]:
        return state["q_proj.v.weight"].shape[0], {}

    def to_dense(self) -> nn.MultiheadAttention:
        bias = self.out_proj.bias is not None
        w = self.out_proj.u.weight
        dense = nn.MultiheadAttention(self.embed_dim, self.num_heads, dropout=self.dropout,
                                      bias=bias, batch_first=self.batch_first,
                                      device=w.device, dtype=w.dtype)
        q, k, v, out = self._projections()
        with torch.no_grad():
            dense.in_proj_weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            dense.out_proj.weight.copy_(out.weight)
            if bias:
                dense.in_proj_bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
                dense.out_proj.bias.copy_(out.bias)
        return dense

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(proj.u.weight, proj.v.weight) for proj in self._projections()]

    def project_dense_state(self, dense_state: Mapping[str, torch.Tensor]
                            ) -> dict[str, torch.Tensor]:
        """As every layer's, and the q, k, v biases from the thirds of ``in_proj_bias``."""
        projected = super().project_dense_state(dense_state)
        bias = dense_state.get("in_proj_bias")
        if bias is not None and self.q_proj.u.bias is not None:
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), bias.chunk(3)):
                projected.setdefault(f"{proj}.u.bias", part.detach().clone())
        return projected

    # --- what code that reads a model asks (see pufferfish.lowrank.base)

    @classmethod
    def dense_matrices(cls, dense: nn.MultiheadAttention) -> list[torch.Tensor]:
        """``[W_q, W_k, W_v, W_out]``: the four ``E x E`` projections, each truncated at the rank."""
        if dense.in_proj_weight is not None:
            q, k, v = dense.in_proj_weight.chunk(3, dim=0)
        else:
            q, k, v = dense.q_proj_weight, dense.k_proj_weight, dense.v_proj_weight
        return [q, k, v, dense.out_proj.weight]

    @classmethod
    def shape_summary(cls, dense: nn.MultiheadAttention) -> str:
        return f"embed {dense.embed_dim}, {dense.num_heads} heads"

    @classmethod
    @contextmanager
    def counting(cls, module: nn.Module) -> Iterator[None]:
        """torch's fused attention fast path (``nn.MultiheadAttention``,
        ``TransformerEncoderLayer``, in eval mode under ``no_grad``) hides its matmuls from the
        flop counter: it is off while counting, so attention counts as the matmuls training runs."""
        enabled = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)

    def _projections(self) -> tuple[_Projection, _Projection, _Projection, _Projection]:
        return self.q_proj, self.k_proj, self.v_proj, self.out_proj

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, rank={self.rank}, "
                f"dropout={self.dropout}, bias={self.out_proj.bias is not None}, "
                f"batch_first={self.batch_first}")


register_low_rank(nn.MultiheadAttention, LowRankMultiheadAttention)
