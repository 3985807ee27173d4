"""A LLaMA-style decoder LM in one file (the layout of torchtitan's llama and GaLore's LLaMA-60M).

Pre-norm blocks of RMSNorm -> causal self-attention with rotary position embeddings (RoPE) and
RMSNorm -> SwiGLU MLP, a final RMSNorm and an untied output head. Module names follow Hugging
Face's ``LlamaForCausalLM`` (``embed_tokens``, ``layers.<i>.self_attn.q_proj`` ..., ``mlp.gate_proj``
..., ``norm``, ``lm_head``), so one preset serves both (:mod:`pufferfish.lowrank.presets` gives
``Llama.PRESETS`` to HF's class). Every projection is a plain ``nn.Linear`` without bias: the layer protocol factorizes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LLAMA_DEFAULTS", "LLAMA_LR_AT_EDGE", "LLAMA_LR_MEASURED", "LLAMA_METHODS", "LLAMA_METHOD_MEASURED",
           "MAX_SEQ_LEN", "Llama", "check_llama", "llama_advice", "llama_dims", "llama_lr",
           "llama_method"]

MAX_SEQ_LEN = 4096  # the longest RoPE table a model is built with (LLaMA-2's context is 4096)


# What the budget study measured per width (20 tokens per parameter, 16,384 tokens a step;
# docs/benchmarks.md "Language models at a budget"), every choice on validation: llama's AdamW LR
# (on seed 0) and the method its rule chose (on the mean over seeds; "lowrank": low rank from the
# start; "pufferfish": the switch after 10% of the steps, Adam's moments per --switch-momentum
# auto). The widths the advice comes from; a test holds both to the study's cache.
LLAMA_LR_MEASURED: dict[float, float] = {0.125: 1e-2, 0.25: 3e-3}
LLAMA_METHOD_MEASURED: dict[float, str] = {0.125: "lowrank", 0.25: "lowrank"}
# Widths whose chosen LR is at an edge of the LRs tried there ("lowest" or "highest"): a bound,
# the best may lie beyond it (said in --help).
LLAMA_LR_AT_EDGE: dict[float, str] = {0.25: "lowest"}
LLAMA_METHODS = {"lowrank": "low rank from the start",
                 "pufferfish": "the switch after 10% of the steps"}


def llama_lr(width: float) -> float:
    """The default llama LR at ``width``: the measured LR at a measured width, log-linear between
    two measured widths, and scaled as 1/width from the nearest measured one beyond them (an
    extrapolation: ``--help`` and the README say which widths were measured)."""
    widths = sorted(LLAMA_LR_MEASURED)
    if width <= widths[0] or width >= widths[-1]:
        ref = widths[0] if width <= widths[0] else widths[-1]
        return LLAMA_LR_MEASURED[ref] * ref / width
    hi = next(w for w in widths if w >= width)
    lo = widths[widths.index(hi) - 1]
    f = math.log(width / lo) / math.log(hi / lo)
    return math.exp((1 - f) * math.log(LLAMA_LR_MEASURED[lo]) + f * math.log(LLAMA_LR_MEASURED[hi]))


def llama_method(width: float) -> str:
    """The default llama method at ``width``: the one chosen at the nearest measured width (on a
    log scale; the narrower at an equal distance), a key of :data:`LLAMA_METHODS`."""
    nearest = min(sorted(LLAMA_METHOD_MEASURED), key=lambda w: abs(math.log(width / w)))
    return LLAMA_METHOD_MEASURED[nearest]


def llama_advice() -> str:
    """Where llama's defaults come from, one line for ``train --help``."""
    measured = "; ".join(f"width {w:g}: lr {LLAMA_LR_MEASURED[w]:g}"
                         + (f" (the {LLAMA_LR_AT_EDGE[w]} tried: the best may lie beyond)"
                            if w in LLAMA_LR_AT_EDGE else "")
                         + f", {LLAMA_METHODS[LLAMA_METHOD_MEASURED[w]]}"
                         for w in sorted(LLAMA_LR_MEASURED))
    return (f"llama: lr and method chosen on validation by the budget study ({measured}); "
            "between measured widths the LR is interpolated on a log scale, beyond them scaled "
            "as 1/width and the method taken from the nearest measured width: not measured "
            "there")


def _width(values: Mapping[str, Any]) -> float:
    return float(values.get("width", 1.0))


# llama's training defaults (its ModelSpec's; applied, in this order, to the keys no file or flag
# sets). The LM recipe: AdamW with decay / no-decay groups, linear LR warm-up then cosine decay,
# clipping at 1; the LR and the method of the width (above). Low rank from the start is the switch
# before step 0 (warm-up "0"); Pufferfish's default switch is 10% of the steps, unless the user
# set --warmup-epochs (read before warmup_epochs gets its default, hence its place first). A
# --warmup-epochs or --warmup-steps of the user's always wins.
LLAMA_DEFAULTS: dict[str, Any] = {
    "optimizer": "adamw", "lr": lambda values: llama_lr(_width(values)),
    "weight_decay": 0.1, "schedule": "cosine", "lr_warmup_epochs": 0.1, "grad_clip": 1.0,
    "warmup_steps": lambda values: 0.1 if llama_method(_width(values)) == "pufferfish"
    and "warmup_epochs" not in values else 0.0,
    "warmup_epochs": "0",
}


def check_llama(cfg: Any) -> None:
    """A configuration's width and context for llama (``ValueError`` in one line)."""
    llama_dims(cfg.width)
    if not 1 <= cfg.seq_len <= MAX_SEQ_LEN:
        raise ValueError(f"seq_len {cfg.seq_len} is out of range for llama: allowed 1 to "
                         f"{MAX_SEQ_LEN} (its longest RoPE table)")


def llama_dims(width: float) -> dict[str, int]:
    """The shape at ``width``: GaLore's LLaMA-60M at 1.0, the dimension scaled otherwise.

    ``dim = 64 * round(8 * width)`` (head dimension 64, as at 1.0: ``heads = dim / 64``), 8 layers
    at every width, SwiGLU hidden ``8/3 * dim`` rounded up to a multiple of 32 (1376 at dim 512,
    as GaLore's). The smallest width is 1/16 (dim 64, one head); below it is a ``ValueError``.
    """
    units = math.floor(8 * width + 0.5)
    if not math.isfinite(width) or units < 1:
        raise ValueError(f"width {width!r} is too small for llama: allowed >= 0.0625 "
                         "(dim 64 * round(8 * width), heads of 64 dims)")
    dim = 64 * units
    return {"dim": dim, "n_layers": 8, "n_heads": units, "hidden_dim": 32 * math.ceil(8 * dim / 96)}


def rope_table(head_dim: int, max_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of RoPE's angles, each ``(max_len, head_dim)`` (halves repeated)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, heads, seq, head_dim)`` by position (HF's rotate-half layout)."""
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, n_heads: int, hidden_dim: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.self_attn = Attention(dim, n_heads)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.mlp = SwiGLU(dim, hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Tokens ``(batch, seq)`` -> logits ``(batch, seq, vocab)``; ``seq <= max_len``.

    The RoPE table of ``max_len`` positions is a non-persistent buffer (not in ``state_dict``).
    Weights are initialized as in LLaMA / GaLore: normal with std 0.02.
    """

    PRESETS: dict[str, dict] = {
        # Factorize q, k, v, o and gate, up, down of every block; keep the token embedding, the
        # output head and the whole first block full-rank (the paper's "first layers"). Norms are
        # no low-rank layer type. ``*`` crosses dots: ``layers.0.*`` here, ``model.layers.0.*`` in HF.
        # No full-rank warm-up by default (the trainer callbacks', which know no width; the
        # CLI's is a function of width, LLAMA_DEFAULTS): the budget study's choice at widths 0.125
        # (a tie with full rank within its resolution) and 0.25 (14% behind full rank, ahead of
        # the 10% switch; docs/benchmarks.md, "Language models at a budget").
        "paper": {"keep": ["*embed_tokens", "*lm_head", "*layers.0.*"], "warmup_epochs": 0},
    }

    def __init__(self, vocab_size: int, dim: int = 512, n_layers: int = 8, n_heads: int = 8,
                 hidden_dim: int = 1376, max_len: int = 256, eps: float = 1e-6) -> None:
        super().__init__()
        if dim % n_heads or (dim // n_heads) % 2:
            raise ValueError(f"dim {dim} with n_heads {n_heads} is invalid: allowed an even "
                             "head dimension dim / n_heads")
        if not 1 <= max_len <= MAX_SEQ_LEN:
            raise ValueError(f"max_len {max_len} is out of range: allowed 1 to {MAX_SEQ_LEN}")
        self.vocab_size, self.dim, self.max_len = vocab_size, dim, max_len
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden_dim, eps) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rope_table(dim // n_heads, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.size(1)
        if seq > self.max_len:
            raise ValueError(f"sequence length {seq} exceeds max_len {self.max_len} (the RoPE "
                             "table): allowed at most max_len")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
