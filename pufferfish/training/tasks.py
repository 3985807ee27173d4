"""The kinds of task the loop trains: image classification and language modelling (word-level
here; the decoder LM on packed BPE sequences in :mod:`.packed_lm`).

A task owns its data, its model and how to compute a loss and evaluate; the loop owns everything
else. Evaluation is sharded over ranks without dropping examples and its sums are reduced, so the
reported accuracy or perplexity is exactly that of the whole split.

Image runs hold ``--val-subset`` training images out as a validation split (``val_acc``,
``val_loss`` every epoch): what choices (the switch point, the learning rate, a variant) are made
on. The test split is evaluated every epoch too (``test_acc``, ``test_loss``), for the accuracy
curves and the reported figures, not for choosing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .. import data as datasets
from .. import models
from ..config import TrainConfig
from ..data.validate import check_subset
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from .progressbar import evaluating

__all__ = ["LEGACY_RUN_VALUES", "RUN_FIELDS", "ImageTask", "LanguageTask", "Task", "build_task",
           "resolve_short_try", "run_fields", "steps_per_epoch", "tokens_per_sample"]

# Configuration fields that define what a task computes (its data, model and batches, and the
# micro-batches of each optimizer step): a resume with any of them changed is refused (with the
# method's own, see Method.run_fields).
RUN_FIELDS = ("model", "width", "data", "seed", "train_subset", "batch_size", "grad_accum")
# llama's packed sequences and its BPE vocabulary: a resume with another would feed the saved
# model other tokens (or fail on the embedding's shape deep in load_state_dict).
PACKED_LM_FIELDS = ("seq_len", "vocab_size")
# The image runs' validation split (held out of the training images): another one trains on
# other images.
IMAGE_FIELDS = ("val_subset",)
# What a run field was in runs written before it existed (their config.toml and checkpoints lack
# it): no validation split, every training image trained on.
LEGACY_RUN_VALUES = {"val_subset": 0}


def run_fields(cfg: TrainConfig) -> tuple[str, ...]:
    """The fields a resume of ``cfg``'s task may not change: :data:`RUN_FIELDS`, for the packed
    LMs :data:`PACKED_LM_FIELDS` and for images :data:`IMAGE_FIELDS` (the other tasks ignore them,
    so their older runs' configs need not have them), and the model spec's own ``run_fields``."""
    spec = models.get_spec(cfg.model)
    kind = {"lm-packed": PACKED_LM_FIELDS, "image": IMAGE_FIELDS}.get(spec.task, ())
    return RUN_FIELDS + kind + spec.run_fields


def tokens_per_sample(cfg: TrainConfig) -> int:
    """Tokens in one training example: ``seq_len`` for a packed LM, ``bptt`` for a BPTT LM, 1 for
    an image (an example is the unit of the metrics' per-sample figures)."""
    return {"lm-packed": cfg.seq_len, "lm-bptt": cfg.bptt}.get(models.get_spec(cfg.model).task, 1)


def steps_per_epoch(cfg: TrainConfig, task: Task) -> int:
    """Optimizer steps per epoch: the loader's micro-batches in groups of ``grad_accum`` (an
    incomplete last group dropped, :func:`~pufferfish.training.step.micro_batch_groups`)."""
    micro = len(task.train_loader)
    if micro == 0:
        raise datasets.DataError(
            f"batch_size {cfg.batch_size} leaves no step in an epoch: the training data of each "
            "process is smaller than one batch; allowed a smaller --batch-size, or more data")
    if micro < cfg.grad_accum:
        raise datasets.DataError(
            f"grad_accum {cfg.grad_accum} is invalid with {micro} micro-batch(es) of "
            f"{cfg.batch_size} per epoch and process: allowed --grad-accum <= {micro}, or a "
            "smaller --batch-size, or more data")
    return micro // cfg.grad_accum


class Task(Protocol):
    """Data, model, loss and evaluation; a per-rank stateful component of a run (its
    ``state_dict`` is what it carries from step to step within an epoch)."""

    model: nn.Module
    train_loader: Any  # iterable of batches with len() and set_epoch()

    def start_epoch(self, epoch: int) -> None: ...
    def to_device(self, batch: Any, device: torch.device) -> Any: ...
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...
    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]: ...
    def final_metrics(self, model: nn.Module, env: DistEnv) -> dict[str, float]: ...
    def example_input(self, device: torch.device) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def build_task(cfg: TrainConfig, env: DistEnv) -> Task:
    """The task of ``cfg.model``'s spec kind: ``image`` -> :class:`ImageTask`, ``lm-bptt`` ->
    :class:`LanguageTask`, ``lm-packed`` -> :class:`~.packed_lm.PackedLMTask`."""
    if cfg.download and not cfg.is_lm:
        # The images are then read where they were fetched (./data without --data-dir), not
        # from the dataset's system default, which a machine without the package lacks.
        # Rank 0 fetches first; then the first process of every other machine checks its copy
        # (a shared disk's verifies, a machine's own disk is fetched to), all before any reads.
        where = cfg.data_dir or "data"
        got = str(datasets.download(cfg.data, where)) if env.is_main else None
        got = dist_env.broadcast_object(got, env)
        failed = None
        if env.local_rank == 0 and not env.is_main:
            try:
                datasets.download(cfg.data, where)
            except datasets.DataError as e:  # said on every rank, not a hang of the others
                failed = f"rank {env.rank}: {e}"
        failures = [f for f in dist_env.gather_object(failed, env) if f]  # also the barrier
        if failures:
            raise datasets.DataError(failures[0])
        cfg = dataclasses.replace(cfg, data_dir=got)
    kind = models.get_spec(cfg.model).task
    if kind == "lm-packed":
        from .packed_lm import PackedLMTask

        return PackedLMTask(cfg, env)
    return LanguageTask(cfg, env) if kind == "lm-bptt" else ImageTask(cfg, env)


def check_subsets(cfg: TrainConfig, n_train: int, n_test: int, unit: str, held: int = 0) -> None:
    """``train_subset``/``test_subset`` within the data (``DataError`` naming the key); ``held``:
    training examples held out for validation, which ``train_subset`` cannot take."""
    for key, n, split in (("train_subset", n_train, "training"), ("test_subset", n_test, "test")):
        less = f" less the {held} of val_subset" if held and key == "train_subset" else ""
        check_subset(key, getattr(cfg, key), n, f"the {split} {unit} of {cfg.data}{less}")


SHORT_TRY_MIN_EVAL = 1000  # a short try still evaluates this many images per split (±1.5 points)
EVAL_IMAGES = 10_000  # Fashion-MNIST's and CIFAR-10's test split (validation: 5,000 held out)


def resolve_short_try(cfg: TrainConfig, given: set[str]) -> tuple[TrainConfig, str | None]:
    """``train_subset`` given on the command line without ``test_subset`` (``given``: the keys
    the user set), on images: a short try, so the validation and test splits shrink with it, to
    a fifth of it (the test split's share of the training images) but at least
    :data:`SHORT_TRY_MIN_EVAL`. Returns the configuration and the line that says so (None:
    unchanged). Without this a 512-image try trains for seconds and then evaluates 15,000 images
    every epoch. A ``test_subset`` given (10000: every image) is kept, so scripts that pass
    both are unaffected; LMs evaluate their splits as configured."""
    if cfg.is_lm or "train_subset" not in given or "test_subset" in given \
            or not cfg.train_subset or cfg.test_subset:
        return cfg, None
    n = max(SHORT_TRY_MIN_EVAL, -(-cfg.train_subset // 5))
    if n >= EVAL_IMAGES:
        return cfg, None
    return dataclasses.replace(cfg, test_subset=n), (
        f"a short try: --train-subset {cfg.train_subset} also evaluates only the first {n} "
        f"validation and test images (--test-subset {n}; --test-subset {EVAL_IMAGES} for all)")


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
        ds = ds.hold_out(cfg.val_subset)  # the same images on every rank, for every seed
        self.ds, self.cfg = ds, cfg
        check_subsets(cfg, len(ds.train_labels), len(ds.test_labels), "images", cfg.val_subset)
        self.train_loader = ds.loader("train", cfg.batch_size, seed=cfg.seed, rank=env.rank,
                                      world_size=env.world_size, subset=cfg.train_subset or None,
                                      drop_last=True, device=env.device)
        assert ds.val_images is not None and ds.val_labels is not None
        # --test-subset caps every evaluation split (a quick run evaluates N of each), as the LMs'
        self.val = _shard(ds.val_images, ds.val_labels,
                          min(cfg.test_subset or len(ds.val_labels), len(ds.val_labels)), env)
        self.test = _shard(ds.test_images, ds.test_labels,
                           cfg.test_subset or len(ds.test_labels), env)
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

    def final_metrics(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        """Nothing beyond :meth:`evaluate`: it evaluates the test split every epoch already."""
        return {}

    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        """``val_acc``/``val_loss`` (what choices are made on; absent with ``--val-subset 0``) and
        ``test_acc``/``test_loss`` (the curves and the reported figures)."""
        val = self._evaluate_on(model, env, self.val, "validation") if self.cfg.val_subset \
            else None
        test = self._evaluate_on(model, env, self.test, "test")
        figures = {} if val is None else {"val_acc": val[0], "val_loss": val[1]}
        return {**figures, "test_acc": test[0], "test_loss": test[1]}

    @torch.no_grad()
    def _evaluate_on(self, model: nn.Module, env: DistEnv, split: _Shard, name: str
                     ) -> tuple[float, float]:
        """Accuracy and mean loss over every rank's shard of ``split``."""
        model.eval()
        device = next(model.parameters()).device
        mean = torch.tensor(self.ds.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(self.ds.std, device=device).view(1, -1, 1, 1)
        correct = loss = 0.0
        images, labels, total = split
        # As many batches on every rank (the last possibly empty): FSDP2 gathers in each forward.
        rows = -(-total // env.world_size)
        for i in evaluating(self.cfg, env, range(0, rows, self.cfg.eval_batch_size), name):
            x = images[i:i + self.cfg.eval_batch_size].to(device).float() / 255
            y = labels[i:i + self.cfg.eval_batch_size].to(device)
            logits = model((x - mean) / std)
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
        model.train()
        correct, loss, n = dist_env.all_reduce_sum([correct, loss, len(labels)], env)
        return correct / max(1, n), loss / max(1, n)

    def example_input(self, device: torch.device) -> torch.Tensor:
        h, w = self.ds.image_size
        return torch.zeros(1, self.ds.in_channels, h, w, device=device)


# An evaluation split's examples on this rank (images, labels) and its size over all ranks.
_Shard = tuple[torch.Tensor, torch.Tensor, int]


def _shard(images: torch.Tensor, labels: torch.Tensor, n: int, env: DistEnv) -> _Shard:
    """The first ``n`` examples, rank ``r`` taking ``r, r + world, ...``: none dropped or
    repeated."""
    return images[:n][env.rank::env.world_size], labels[:n][env.rank::env.world_size], n


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
        self.batch_first = models.get_spec(cfg.model).batch_first
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

    def final_metrics(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        """Nothing beyond :meth:`evaluate`: its figures are already the test split's."""
        return {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, env: DistEnv) -> dict[str, float]:
        model.eval()
        total, tokens, hidden = 0.0, 0, None
        for i in evaluating(self.cfg, env, range(0, len(self.test_source) - 1, self.cfg.bptt),
                            "test"):
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
