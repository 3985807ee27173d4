"""Two-layer LSTM language model with tied embeddings (the paper's WikiText-2 model)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LSTMLanguageModel"]

Hidden = tuple[torch.Tensor, torch.Tensor]


class LSTMLanguageModel(nn.Module):
    """Embedding ``encoder`` -> dropout -> ``nn.LSTM`` ``rnn`` -> dropout -> Linear ``decoder``.

    Inputs are ``(seq, batch)`` token ids (``batch_first=False``). With ``tie_weights`` the
    decoder weight is the embedding weight, which needs ``embed_dim == hidden_size``. Smaller
    dimensions can be passed for CPU demos.
    """

    PRESETS: dict[str, dict] = {
        # The paper factorizes the LSTM (every gate) and keeps the tied embedding/decoder.
        "paper": {"keep": ["encoder", "decoder"]},
    }

    def __init__(self, vocab_size: int, embed_dim: int = 1500, hidden_size: int = 1500,
                 num_layers: int = 2, dropout: float = 0.65, tie_weights: bool = True) -> None:
        super().__init__()
        if tie_weights and embed_dim != hidden_size:
            raise ValueError(
                f"tie_weights needs embed_dim == hidden_size, got {embed_dim} and {hidden_size}")
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.tie_weights = tie_weights
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, embed_dim)
        self.rnn = nn.LSTM(embed_dim, hidden_size, num_layers,
                           dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        self._init_weights()
        if tie_weights:
            self.decoder.weight = self.encoder.weight

    def _init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def init_hidden(self, batch_size: int) -> Hidden:
        """Zero ``(h, c)``, each ``(num_layers, batch_size, hidden_size)``."""
        weight = self.encoder.weight
        shape = (self.num_layers, batch_size, self.hidden_size)
        return weight.new_zeros(shape), weight.new_zeros(shape)

    def forward(self, tokens: torch.Tensor, hidden: Hidden | None = None
                ) -> tuple[torch.Tensor, Hidden]:
        """Tokens ``(seq, batch)`` -> logits ``(seq, batch, vocab)`` and the new hidden state."""
        emb = self.drop(self.encoder(tokens))
        out, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(out)), hidden
