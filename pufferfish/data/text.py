"""Word-level language-modelling corpora (KJV Bible, any UTF-8 text file) and BPTT batching.

Tokenization follows PyTorch's ``word_language_model`` example on purpose, so perplexities are
comparable with it: each line is ``line.split() + ["<eos>"]`` (case and punctuation are kept
as-is, blank lines contribute a lone ``<eos>``), and the vocabulary covers all splits, so
there is no ``<unk>``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..formatting import one_line
from .errors import DataError

__all__ = [
    "EOS",
    "BPTTLoader",
    "Corpus",
    "Vocab",
    "batchify",
    "get_bptt_batch",
    "load_kjv",
    "load_text_file",
    "split_lines",
    "tokenize",
]

EOS = "<eos>"
KJV_RANGE = "gen1:1-rev22:21"
# "Ge1:1 In the beginning...", "1Chr1:1 Adam, Sheth, Enosh." -- book abbreviation, chapter:verse.
_VERSE_REF = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+\s+")

SplitMode = Literal["interleaved", "contiguous"]


def load_kjv(command: str = "bible", *, timeout: float = 120.0) -> list[str]:
    """Return the 31,102 KJV verses (one string each) with the ``Book1:1`` references stripped.

    Uses the ``bible`` program (Debian/Ubuntu package ``bible-kjv``), which ships the text
    offline, so no download is needed.
    """
    exe = shutil.which(command)
    if exe is None:
        raise DataError(
            f"'{command}' command not found on PATH; expected the KJV Bible program "
            "(install it with `apt-get install bible-kjv`)"
        )
    try:
        proc = subprocess.run(
            [exe, "-f", KJV_RANGE], capture_output=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(
            f"'{exe} -f {KJV_RANGE}' failed ({one_line(e)}); expected it to print the KJV"
        ) from e
    if proc.returncode != 0:
        err = one_line(proc.stderr.decode("utf-8", "replace"))[:200]
        raise DataError(
            f"'{exe} -f {KJV_RANGE}' exited with status {proc.returncode} ({err}); expected status 0"
        )
    try:
        text = proc.stdout.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"'{exe}' output is not UTF-8 ({e.reason} at byte {e.start}); expected text"
        ) from e
    verses = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _VERSE_REF.match(line)
        if m is None:
            raise DataError(
                f"'{exe}' output line {lineno} {line[:40]!r} has no verse reference; expected 'Book1:1 text'"
            )
        verses.append(line[m.end() :])
    if not verses:
        raise DataError(
            f"'{exe} -f {KJV_RANGE}' printed no verses (empty text corpus); expected the full KJV text"
        )
    return verses


def load_text_file(path: str | os.PathLike[str], encoding: str = "utf-8") -> list[str]:
    """Read a text file as a list of lines (``\\n``, ``\\r\\n`` and ``\\r`` all end a line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{p}: text file does not exist; expected a readable {encoding} text file")
    try:
        text = p.read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}: not valid {encoding} ({e.reason} at byte {e.start}); expected {encoding} text"
        ) from e
    except OSError as e:
        raise DataError(
            f"{p}: cannot read ({one_line(e)}); expected a readable text file"
        ) from e
    if not text.strip():
        raise DataError(f"{p}: empty text corpus; expected at least one word")
    lines = text.split("\n")  # read_text already turned \r\n and \r into \n
    if lines[-1] == "":
        lines.pop()
    return lines


def tokenize(lines: Iterable[str]) -> list[str]:
    """``line.split() + ["<eos>"]`` for every line, concatenated."""
    out: list[str] = []
    for line in lines:
        out.extend(line.split())
        out.append(EOS)
    return out


class Vocab:
    """Bidirectional word <-> id mapping; ids are assigned in first-appearance order."""

    def __init__(self, words: Iterable[str] = ()) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []
        for w in words:
            self.add(w)

    def add(self, word: str) -> int:
        idx = self.word2idx.get(word)
        if idx is None:
            idx = self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return idx

    def __len__(self) -> int:
        return len(self.idx2word)

    def __contains__(self, word: object) -> bool:
        return word in self.word2idx

    def encode(self, words: Sequence[str]) -> torch.Tensor:
        """Map words to an int64 tensor; unknown words are a DataError (there is no <unk>)."""
        try:
            return torch.tensor([self.word2idx[w] for w in words], dtype=torch.int64)
        except KeyError as e:
            raise DataError(
                f"word {e.args[0]!r} is not in the vocabulary; expected only known words"
            ) from e

    def decode(self, ids: Iterable[int] | torch.Tensor) -> list[str]:
        seq = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return [self.idx2word[i] for i in seq]


def split_lines(
    lines: Sequence[str],
    valid_frac: float = 0.05,
    test_frac: float = 0.05,
    mode: SplitMode = "interleaved",
) -> tuple[list[str], list[str], list[str]]:
    """Deterministically split lines into (train, valid, test).

    ``contiguous``: the last lines are test, the ones before are valid (PTB/WikiText style).
    ``interleaved`` (default): within every block of ``min(100, len(lines))`` lines the first
    ones go to train, then valid, then test -- e.g. 90/5/5 verses per 100 -- so all splits
    sample the whole text (for the Bible, contiguous would make the test set Revelation).
    A non-zero fraction always yields at least one line.
    """
    if not (0 <= valid_frac < 1 and 0 <= test_frac < 1 and valid_frac + test_frac < 1):
        raise DataError(
            f"valid_frac={valid_frac}, test_frac={test_frac}; expected non-negative with sum < 1"
        )
    if mode not in ("interleaved", "contiguous"):
        raise DataError(f"split mode {mode!r}; expected 'interleaved' or 'contiguous'")
    n = len(lines)
    period = n if mode == "contiguous" else min(100, n)

    def count(frac: float) -> int:
        return max(1, round(period * frac)) if frac > 0 else 0

    n_valid, n_test = count(valid_frac), count(test_frac)
    n_train = period - n_valid - n_test
    if n_train <= 0:
        raise DataError(
            f"{n} lines are too few for valid_frac={valid_frac}, test_frac={test_frac}; expected more lines"
        )
    train, valid, test = [], [], []
    for i, line in enumerate(lines):
        pos = i % period
        (train if pos < n_train else valid if pos < n_train + n_valid else test).append(line)
    return train, valid, test


@dataclass
class Corpus:
    """Token-id streams (1-D int64) for train/valid/test sharing one vocabulary."""

    vocab: Vocab
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    source: str = "<lines>"

    @property
    def ntokens(self) -> int:
        """Vocabulary size (the LM's output dimension)."""
        return len(self.vocab)

    @classmethod
    def from_lines(
        cls,
        lines: Sequence[str],
        *,
        valid_frac: float = 0.05,
        test_frac: float = 0.05,
        split_mode: SplitMode = "interleaved",
        source: str = "<lines>",
    ) -> Corpus:
        """Tokenize, build the vocabulary over all lines (document order) and split by lines."""
        if not any(line.strip() for line in lines):
            raise DataError(f"{source}: empty text corpus; expected at least one word")
        vocab = Vocab(tokenize(lines))
        parts = split_lines(lines, valid_frac, test_frac, split_mode)
        train, valid, test = (vocab.encode(tokenize(p)) for p in parts)
        return cls(vocab, train, valid, test, source)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        valid_frac: float = 0.05,
        test_frac: float = 0.05,
        split_mode: SplitMode = "interleaved",
    ) -> Corpus:
        """:func:`load_text_file` then :meth:`from_lines`."""
        return cls.from_lines(
            load_text_file(path),
            valid_frac=valid_frac,
            test_frac=test_frac,
            split_mode=split_mode,
            source=str(path),
        )


def batchify(ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Cut a 1-D stream into ``batch_size`` equal contiguous columns: shape (seq_len, batch).

    Column ``j`` continues itself from row to row, so hidden state can be carried over between
    BPTT chunks; the remainder that does not fill a full row is dropped.
    """
    if ids.dim() != 1:
        raise DataError(f"token ids have shape {tuple(ids.shape)}; expected a 1-D stream")
    if batch_size <= 0:
        raise DataError(f"batch_size={batch_size}; expected a positive integer")
    nbatch = ids.numel() // batch_size
    if nbatch < 2:
        raise DataError(
            f"stream of {ids.numel()} tokens is too short for {batch_size} columns; "
            f"expected at least {2 * batch_size} tokens"
        )
    return ids[: nbatch * batch_size].view(batch_size, nbatch).t().contiguous()


def get_bptt_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``i : i+bptt`` as input and the rows shifted by one as target, both (seq, batch).

    Unlike the PyTorch example the target is not flattened; use ``target.reshape(-1)``.
    """
    seq_len = min(bptt, len(source) - 1 - i)
    if bptt <= 0 or seq_len <= 0:
        raise DataError(
            f"BPTT offset i={i}, bptt={bptt} is past the end of {len(source)} rows; expected i < {len(source) - 1}"
        )
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len]


class BPTTLoader:
    """Iterates ``(data, target)`` BPTT chunks over a token stream; shardable across DDP ranks.

    Sharding: the stream is batchified into ``batch_size * world_size`` columns and rank ``r``
    keeps columns ``[r*batch_size, (r+1)*batch_size)`` -- a contiguous slice of the text. All
    ranks thus have the same number of rows and steps, and concatenating the ranks' batches
    gives exactly the single-process batch of size ``batch_size * world_size``.
    ``batch_size`` is per rank. The last chunk may be shorter than ``bptt``.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        batch_size: int,
        bptt: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise DataError(
                f"rank={rank}, world_size={world_size}; expected 0 <= rank < world_size"
            )
        if bptt <= 0:
            raise DataError(f"bptt={bptt}; expected a positive integer")
        full = batchify(ids, batch_size * world_size)
        self.source = full[:, rank * batch_size : (rank + 1) * batch_size].contiguous()
        if device is not None:
            self.source = self.source.to(device)
        self.batch_size, self.bptt, self.rank, self.world_size = batch_size, bptt, rank, world_size
        self.epoch = 0

    def __len__(self) -> int:
        return -(-(len(self.source) - 1) // self.bptt)

    @property
    def tokens_per_epoch(self) -> int:
        """Target tokens this rank predicts per epoch."""
        return (len(self.source) - 1) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch; the order is fixed (LM streams are not shuffled) -- kept for API parity."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.source) - 1, self.bptt):
            yield get_bptt_batch(self.source, i, self.bptt)
