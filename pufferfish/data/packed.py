"""Packed sequences of a token stream: fixed-length windows, shuffled per epoch, sharded by rank.

The stream is cut into ``len(ids) // seq_len`` windows of ``seq_len`` inputs whose targets are the
next tokens (window ``i`` reads ``ids[i*seq_len : (i+1)*seq_len + 1]``; the windows share their
edge token, as nanoGPT's). Lines run across window edges: nothing is padded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .errors import DataError

__all__ = ["PackedLoader", "windows"]


def windows(ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, each ``(n, seq_len)``, of every whole window of ``ids``."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}; expected a positive integer")
    n = (ids.numel() - 1) // seq_len
    if n < 1:
        raise DataError(f"a stream of {ids.numel()} tokens is too short for one sequence of "
                        f"seq_len {seq_len}: allowed seq_len <= {ids.numel() - 1}")
    body = ids[:n * seq_len + 1]
    return body[:-1].view(n, seq_len), body[1:].view(n, seq_len)


class PackedLoader:
    """``(inputs, targets)`` batches of ``batch_size`` windows per rank, each ``(batch, seq_len)``.

    Each epoch's order is ``randperm`` from a generator seeded with ``seed + epoch``; rank ``r``
    takes positions ``r, r + world, ...`` of it, and the windows that do not fill a batch on every
    rank are dropped, so all ranks take the same number of steps.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1, device: torch.device | str | None = None
                 ) -> None:
        self.inputs, self.targets = windows(ids, seq_len)
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.device, self.epoch = device, 0
        if len(self) < 1:
            raise DataError(f"{len(self.inputs)} sequences of {seq_len} tokens are too few for "
                            f"a batch of {batch_size} on each of {world_size} process(es): "
                            "allowed a smaller --batch-size or --seq-len, or more data")

    def __len__(self) -> int:
        return len(self.inputs) // (self.batch_size * self.world_size)

    @property
    def tokens_per_step(self) -> int:
        """Target tokens one rank predicts per step."""
        return self.batch_size * self.inputs.size(1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.inputs), generator=generator)
        mine = order[self.rank:len(self) * self.batch_size * self.world_size:self.world_size]
        for start in range(0, len(mine), self.batch_size):
            index = mine[start:start + self.batch_size]
            yield self.inputs[index], self.targets[index]
