"""The kinds of task the loop trains: image classification and language modelling (word-level
here; the decoder LM on packed BPE sequences in :mod:`.packed_lm`).

A task owns its data, its model and how to compute a loss and evaluate; the loop owns everything
else. Evaluation is sharded over ranks without dropping examples and its sums are reduced, so the
reported accuracy or perplexity is exactly that of the whole test set.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import data as datasets
from .. import models
from ..config import TrainConfig
from ..data.validate import check_subset
from ..distributed import env as dist_env
from ..distributed.env import DistEnv

__all__ = ["RUN_FIELDS", "ImageTask", "LanguageTask", "Task", "build_task", "run_fields"]

# Configuration fields that define what a task computes (its data, model and batches): a resume
# with any of them changed is refused (with the method's own, see Method.run_fields).
RUN_FIELDS = ("model", "width", "data", "seed", "train_subset", "batch_size")
# llama's packed sequences and its BPE vocabulary: a resume with another would feed the saved
# model other tokens (or fail on the embedding's shape deep in load_state_dict).
PACKED_LM_FIELDS = ("seq_len", "vocab_size")


def run_fields(cfg: TrainConfig) -> tuple[str, ...]:
    """The fields a resume of ``cfg``'s task may not change: :data:`RUN_FIELDS`, and for llama
    :data:`PACKED_LM_FIELDS` (other models ignore them, so older runs' configs need not have them)."""
    return RUN_FIELDS + (PACKED_LM_FIELDS if cfg.model == "llama" else ())


class Task(Protocol):
    """Data, model, loss and evaluation; a per-rank stateful component of a run (its
    ``state_dict`` is what it carries from step to step within an epoch)."""

    model: nn.Module
    train_loader: Any  # iterable of batches with len() and set_epoch()

    def start_epoch(self, epoch: int) -> None: ...
    def to_device(self, batch: Any, device: torch.device) -> Any: ...
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...
    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]: ...
    def example_input(self, device: torch.device) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def build_task(cfg: TrainConfig, env: DistEnv) -> Task:
    if cfg.download and not cfg.is_lm:
        if env.is_main:
            datasets.download(cfg.data, cfg.data_dir or "data")
        if env.distributed:
            dist.barrier()
    if cfg.model == "llama":
        from .packed_lm import PackedLMTask

        return PackedLMTask(cfg, env)
    return LanguageTask(cfg, env) if cfg.is_lm else ImageTask(cfg, env)


def check_subsets(cfg: TrainConfig, n_train: int, n_test: int, unit: str) -> None:
    """``train_subset``/``test_subset`` within the data (``DataError`` naming the key)."""
    for key, n, split in (("train_subset", n_train, "training"), ("test_subset", n_test, "test")):
        check_subset(key, getattr(cfg, key), n, f"the {split} {unit} of {cfg.data}")


class ImageTask:
    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        missing = datasets.missing_file(
            cfg.data, f"fashion-mnist or cifar10 (model {cfg.model!r} reads images)")
        if missing:
            raise missing
        if cfg.data in ("kjv",) or cfg.data.endswith(".txt"):
            raise datasets.DataError(f"data {cfg.data!r} is text: model {cfg.model!r} needs "
                                     "fashion-mnist or cifar10")
        ds = datasets.load_dataset(cfg.data, cfg.data_dir or None)
        assert isinstance(ds, datasets.ImageDataset)
        self.ds, self.cfg = ds, cfg
        check_subsets(cfg, len(ds.train_labels), len(ds.test_labels), "images")
        self.train_loader = ds.loader("train", cfg.batch_size, seed=cfg.seed, rank=env.rank,
                                      world_size=env.world_size, subset=cfg.train_subset or None,
                                      drop_last=True, device=env.device)
        n_test = cfg.test_subset or len(ds.test_labels)
        # Every rank takes test examples rank, rank + world, ...: no example dropped or repeated.
        self.n_test = n_test
        self.test_images = ds.test_images[:n_test][env.rank::env.world_size]
        self.test_labels = ds.test_labels[:n_test][env.rank::env.world_size]
        self.model = models.build_at_width(cfg.model, cfg.width, num_classes=ds.num_classes,
                                           in_channels=ds.in_channels,
                                           image_size=ds.image_size[0])

    def start_epoch(self, epoch: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing carried from step to step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return tuple(t.to(device, non_blocking=True) for t in batch)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        model.eval()
        device = next(model.parameters()).device
        mean = torch.tensor(self.ds.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(self.ds.std, device=device).view(1, -1, 1, 1)
        correct = loss = 0.0
        # As many batches on every rank (the last possibly empty): FSDP2 gathers in each forward.
        rows = -(-self.n_test // env.world_size)
        for i in range(0, rows, self.cfg.eval_batch_size):
            x = self.test_images[i:i + self.cfg.eval_batch_size].to(device).float() / 255
            y = self.test_labels[i:i + self.cfg.eval_batch_size].to(device)
            logits = model((x - mean) / std)
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
        model.train()
        correct, loss, n = dist_env.all_reduce_sum([correct, loss, len(self.test_labels)], env)
        return {"test_acc": correct / max(1, n), "test_loss": loss / max(1, n)}

    def example_input(self, device: torch.device) -> torch.Tensor:
        h, w = self.ds.image_size
        return torch.zeros(1, self.ds.in_channels, h, w, device=device)


class LanguageTask:
    """Word-level LM: the stream is cut into ``batch_size`` columns per rank and BPTT chunks.

    The LSTM's hidden state is carried from chunk to chunk (detached) within an epoch and reset at
    each epoch start; it is this task's state (:meth:`state_dict`), so a mid-epoch checkpoint
    saves it and a resume continues it.
    """

    eval_columns = 10  # the classic word-language-model evaluation batch (over all ranks)

    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        corpus = datasets.load_dataset(cfg.data, cfg.data_dir or None)
        if not isinstance(corpus, datasets.Corpus):
            raise datasets.DataError(f"data {cfg.data!r} is an image dataset: model "
                                     f"{cfg.model!r} needs kjv or a text file")
        self.cfg, self.corpus, self.env = cfg, corpus, env
        check_subsets(cfg, len(corpus.train), len(corpus.test), "tokens")
        train = corpus.train[:cfg.train_subset] if cfg.train_subset else corpus.train
        test = corpus.test[:cfg.test_subset] if cfg.test_subset else corpus.test
        self.vocab_size = corpus.ntokens
        if 0 < cfg.max_vocab < corpus.ntokens:
            train, test = _cap_vocabulary(train, test, corpus.ntokens, cfg.max_vocab)
            self.vocab_size = cfg.max_vocab
        self.train_loader = datasets.BPTTLoader(train, cfg.batch_size, cfg.bptt, rank=env.rank,
                                                world_size=env.world_size, device=env.device)
        # The test stream is cut into the same eval_columns columns whatever the world size, and
        # the ranks split the columns: the perplexity is that of one process, only faster.
        # A rank beyond the 10th gets no column: an empty source, so it evaluates nothing.
        columns = datasets.batchify(test, self.eval_columns)[:, env.rank::env.world_size]
        self.test_source = (columns if columns.size(1) else columns[:0]).contiguous().to(env.device)
        self.batch_first = cfg.model == "transformer"
        self.model = models.build_at_width(cfg.model, cfg.width, vocab_size=self.vocab_size,
                                           dropout=cfg.dropout, max_len=max(512, cfg.bptt))
        self.hidden: Any = None

    def start_epoch(self, epoch: int) -> None:
        self.hidden = None

    def state_dict(self) -> dict[str, Any]:
        """The hidden state carried to the next chunk (on CPU), None at an epoch's start."""
        return {"hidden": None if self.hidden is None else [h.cpu() for h in self.hidden]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hidden = state.get("hidden")
        self.hidden = None if hidden is None else tuple(h.to(self.env.device) for h in hidden)

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return tuple(t.to(device, non_blocking=True) for t in batch)

    def _forward(self, model: nn.Module, tokens: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        if self.batch_first:
            logits, hidden = model(tokens.t().contiguous())
            return logits.transpose(0, 1), hidden
        return model(tokens, hidden)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        data, target = batch
        logits, hidden = self._forward(model, data, self.hidden)
        self.hidden = None if hidden is None else tuple(h.detach() for h in hidden)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        model.eval()
        total, tokens, hidden = 0.0, 0, None
        for i in range(0, len(self.test_source) - 1, self.cfg.bptt):
            data, target = datasets.get_bptt_batch(self.test_source, i, self.cfg.bptt)
            logits, hidden = self._forward(model, data, hidden)
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                     reduction="sum").item()
            tokens += target.numel()
        model.train()
        total, tokens = dist_env.all_reduce_sum([total, tokens], env)
        loss = total / max(1, tokens)
        return {"test_loss": loss, "test_ppl": math.exp(min(loss, 50.0))}

    def example_input(self, device: torch.device) -> torch.Tensor:
        shape = (1, self.cfg.bptt) if self.batch_first else (self.cfg.bptt, 1)
        return torch.zeros(shape, dtype=torch.long, device=device)


def _cap_vocabulary(train: torch.Tensor, test: torch.Tensor, ntokens: int, size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Renumber words by training frequency; words beyond the ``size - 1`` most frequent become
    one ``<unk>`` id (``size - 1``). Shrinks the softmax, which dominates small LMs' cost."""
    counts = torch.bincount(train, minlength=ntokens)
    order = torch.argsort(counts, descending=True, stable=True)
    remap = torch.full((ntokens,), size - 1, dtype=torch.long)
    remap[order[:size - 1]] = torch.arange(size - 1)
    return remap[train], remap[test]
