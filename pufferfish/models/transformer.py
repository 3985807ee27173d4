"""Small decoder-only Transformer language model built from ``nn.TransformerEncoderLayer``."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TransformerLM"]


class TransformerLM(nn.Module):
    """Causal Transformer LM: token ``embed`` + learned ``pos_embed`` -> ``encoder`` -> ``head``.

    Inputs are ``(batch, seq)`` token ids (batch first, unlike :class:`LSTMLanguageModel`) and
    the output is logits ``(batch, seq, vocab)``. The layers are pre-norm
    ``nn.TransformerEncoderLayer`` modules under ``encoder.layers.<i>`` with a final LayerNorm
    ``encoder.norm``; the output ``head`` is tied to the token embedding. ``forward`` takes an
    ignored ``hidden`` argument and returns ``(logits, None)`` so training code can treat both
    language models alike.
    """

    PRESETS: dict[str, dict] = {
        # Keep the embeddings, the tied head and the whole first layer; factorize the attention
        # (``self_attn`` as a unit) and the FFN linears of every other layer.
        "paper": {"keep": ["embed", "pos_embed", "head", "encoder.layers.0.*"]},
    }

    def __init__(self, vocab_size: int, d_model: int = 256, nhead: int = 4, num_layers: int = 4,
                 dim_feedforward: int = 1024, dropout: float = 0.1, max_len: int = 512) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, 0.0, 0.02)
        nn.init.normal_(self.pos_embed.weight, 0.0, 0.02)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, hidden: object = None) -> tuple[torch.Tensor, None]:
        """Tokens ``(batch, seq)`` -> ``(logits (batch, seq, vocab), None)``; ``hidden`` ignored."""
        seq = tokens.size(1)
        if seq > self.max_len:
            raise ValueError(f"sequence length {seq} exceeds max_len {self.max_len}")
        pos = torch.arange(seq, device=tokens.device)
        x = self.drop(self.embed(tokens) + self.pos_embed(pos))
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device,
                                                              dtype=x.dtype)
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(x), None
