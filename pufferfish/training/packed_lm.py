"""The decoder-LM task (``--model llama``): packed BPE sequences, validation loss and throughput.

Data: :func:`pufferfish.data.load_bpe_corpus` (a byte-level BPE of ``--vocab-size`` tokens trained
on the training verses, cached in ``--data-dir`` or its default), cut into windows of
``--seq-len`` tokens (:class:`pufferfish.data.PackedLoader`); ``--train-subset N`` keeps the first
N training tokens, ``--test-subset N`` the first N validation (and test) tokens. Rank 0 builds
the cache, then the others read it, so every rank has the same tokenizer.

Evaluation is on the validation split (no document of it is in training) after every epoch and
``--eval-every-steps``: what choices are made on; the test split once, after the last epoch
(``test_loss``, ``test_ppl``): what is reported. Both are cut into the same windows on any number
of processes, the ranks taking every ``world``-th: the loss is that of one process.
``tokens_per_s`` is the training throughput of all ranks since the epoch started, evaluation time
excluded.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import data as datasets
from .. import models
from ..config import TrainConfig
from ..data.packed import windows
from ..data.validate import check_subset
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from ..formatting import one_line
from .progressbar import evaluating

__all__ = ["PackedLMTask", "load_corpus"]


class PackedLMTask:
    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.corpus = load_corpus(cfg, env)
        for key, n, split in (("train_subset", len(self.corpus.train), "training"),
                              ("test_subset", len(self.corpus.valid), "validation")):
            check_subset(key, getattr(cfg, key), n, f"the {split} tokens of {cfg.data}")
        train = self.corpus.train[:cfg.train_subset] if cfg.train_subset else self.corpus.train
        self.train_loader = datasets.PackedLoader(train, cfg.seq_len, cfg.batch_size,
                                                  seed=cfg.seed, rank=env.rank,
                                                  world_size=env.world_size)
        self.valid, self.test = (self._shard(split) for split in (self.corpus.valid,
                                                                  self.corpus.test))
        self.model = models.build_at_width(cfg.model, cfg.width, vocab_size=self.corpus.vocab_size,
                                           max_len=cfg.seq_len)
        self.start_epoch(0)

    def _shard(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's windows of an evaluation split (``--test-subset``: its first N tokens)."""
        stream = stream[:self.cfg.test_subset] if self.cfg.test_subset else stream
        inputs, targets = windows(stream, self.cfg.seq_len)
        return inputs[self.env.rank::self.env.world_size], targets[self.env.rank::self.env.world_size]

    def start_epoch(self, epoch: int) -> None:
        self.tokens, self.seconds, self._since = 0, 0.0, None

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing carried from step to step (the throughput counters are not results)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return tuple(t.to(device, non_blocking=True) for t in batch)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        if self._since is None:
            self._since = time.perf_counter()
        self.tokens += targets.numel()
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        """Validation loss and perplexity, and the training throughput since the last one."""
        started = time.perf_counter()
        if self._since is not None:
            self.seconds += started - self._since
        loss = self._loss_on(model, env, self.valid, "validation")
        trained, seconds = dist_env.all_reduce_sum([self.tokens, self.seconds], env)
        if self._since is not None:
            self._since = time.perf_counter()
        mean_seconds = seconds / env.world_size
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                "tokens_per_s": trained / mean_seconds if mean_seconds > 0 else 0.0}

    def final_metrics(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        """After the last epoch: the test split's loss and perplexity (the reported figures)."""
        loss = self._loss_on(model, env, self.test, "test")
        return {"test_loss": loss, "test_ppl": math.exp(min(loss, 50.0))}

    @torch.no_grad()
    def _loss_on(self, model: nn.Module, env: DistEnv,
                 split: tuple[torch.Tensor, torch.Tensor], name: str) -> float:
        """Mean cross-entropy per token over all ranks' windows of ``split``."""
        model.eval()
        device = next(model.parameters()).device
        total, tokens = 0.0, 0
        inputs, targets = split
        for i in evaluating(self.cfg, env, range(0, len(inputs), self.cfg.batch_size), name):
            x = inputs[i:i + self.cfg.batch_size].to(device)
            y = targets[i:i + self.cfg.batch_size].to(device)
            logits = model(x)
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                     reduction="sum").item()
            tokens += y.numel()
        model.train()
        total, tokens = dist_env.all_reduce_sum([total, tokens], env)
        return total / max(1, tokens)

    def example_input(self, device: torch.device) -> torch.Tensor:
        return torch.zeros((1, self.cfg.seq_len), dtype=torch.long, device=device)


def load_corpus(cfg: TrainConfig, env: DistEnv) -> datasets.BPECorpus:
    """Rank 0 trains (or finds) the tokenizer and writes the cache; then the others read it.
    An error on rank 0 (a vocabulary the corpus cannot fill) is raised on every rank."""
    corpus, error = None, None
    if env.is_main:
        try:
            corpus = datasets.load_bpe_corpus(cfg.data, cfg.vocab_size, cfg.cache_dir or None)
        except datasets.DataError as e:
            error = one_line(e)
    error = dist_env.broadcast_object(error, env)
    if error is not None:
        raise datasets.DataError(error if env.is_main else f"rank 0: {error}")
    if corpus is None:
        corpus = datasets.load_bpe_corpus(cfg.data, cfg.vocab_size, cfg.cache_dir or None)
    return corpus
