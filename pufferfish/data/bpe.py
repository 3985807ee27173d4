"""Byte-level BPE token streams for decoder LMs, the tokenizer trained on the corpus and cached.

Corpora: ``kjv`` (the verses), ``kjv+gcide`` (the verses and the GCIDE dictionary's entries,
:mod:`pufferfish.data.gcide`: about 10x the KJV) or a UTF-8 text file (its lines). Each line is a
document, and each source is split by document as the word-level LM splits lines
(:func:`~pufferfish.data.text.split_lines`, interleaved: documents 1-90 of every 100 train, 91-95
validation, 96-100 test), so no document is in two splits. For ``kjv+gcide`` a validation or test
document whose exact text is also a training document (a dictionary's repeated "Syn:" line, a
verse said twice) is left out of its split, so repeated passages are never scored as unseen. A
byte-level BPE (``tokenizers``) is trained on the training documents only; every document is
encoded followed by one ``<|endoftext|>`` and the documents are concatenated into one stream per
split.

Cache: ``<cache_dir>/<name>.bpe<vocab>-<digest>.tokenizer.json`` and ``.tokens.pt`` (the three
streams), where the digest is SHA-256 over the corpus's lines and every setting (vocabulary,
minimum pair frequency, split, tokenizers version). ``cache_dir`` is ``--cache-dir``, by default
the user's cache (``$XDG_CACHE_HOME/pufferfish``, else ``~/.cache/pufferfish``): never beside the
user's corpus, whose folder may be read-only and is the user's. Files an older version wrote
beside a text corpus are still read (same names, same digests), never written there again. A
changed corpus or setting is a new file, never an overwrite; files are written through a temp file
and a rename; an unreadable ``.tokens.pt`` is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formatting import one_line
from .errors import DataError
from .gcide import load_gcide
from .text import load_kjv, load_text_file, split_lines
from .validate import missing_file

__all__ = ["BPE_CORPORA", "EOT", "MIN_VOCAB", "BPECorpus", "corpus_lines", "corpus_splits",
           "default_cache_dir", "load_bpe_corpus", "split_documents"]

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 byte tokens of a byte-level BPE and <|endoftext|>
MIN_FREQUENCY = 2  # a merge needs a pair seen at least twice
SPLIT = {"valid_frac": 0.05, "test_frac": 0.05, "mode": "interleaved"}
# Named corpora: their sources, each split by document on its own, and whether validation and
# test drop documents repeated in training (kjv keeps its split of earlier results).
BPE_CORPORA: dict[str, tuple[tuple[str, ...], bool]] = {
    "kjv": (("kjv",), False), "bible": (("kjv",), False), "kjv+gcide": (("kjv", "gcide"), True)}
_SOURCES: dict[str, Callable[[], list[str]]] = {"kjv": load_kjv, "gcide": load_gcide}


@dataclass
class BPECorpus:
    """Token-id streams (1-D int64) of the three splits, and where the tokenizer is."""

    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    vocab_size: int
    tokenizer_path: Path
    source: str


def corpus_lines(name: str) -> tuple[list[str], str]:
    """The lines of a named corpus (``kjv``, ``kjv+gcide``) or of a UTF-8 text file, and a short
    name for files."""
    key = name.strip().lower()
    if key in BPE_CORPORA:
        return [line for source in BPE_CORPORA[key][0] for line in _SOURCES[source]()], \
            _stem(key)
    path = Path(name).expanduser()
    if path.is_file():
        return load_text_file(path), path.stem
    allowed = f"{', '.join(BPE_CORPORA)} or a path to a UTF-8 text file"
    raise missing_file(name, allowed) or DataError(f"data {name!r} is no text corpus: allowed "
                                                   f"{allowed}")


def corpus_splits(name: str) -> tuple[tuple[list[str], list[str], list[str]], str, list[str]]:
    """(train, valid, test) documents of corpus ``name``, its short name and all its lines (the
    digest's input)."""
    key = name.strip().lower()
    sources, dedupe = BPE_CORPORA.get(key, ((), False))
    if not sources:
        lines, stem = corpus_lines(name)
        return _split(lines), stem, lines
    parts = [_SOURCES[source]() for source in sources]
    return split_documents(parts, dedupe), _stem(key), [line for lines in parts for line in lines]


def _stem(key: str) -> str:
    """A named corpus's name in cache files: ``kjv``, ``kjv-gcide``."""
    return key.replace("+", "-").replace("bible", "kjv")


def split_documents(parts: Sequence[Sequence[str]], dedupe: bool
                    ) -> tuple[list[str], list[str], list[str]]:
    """Each source's documents split on their own (:data:`SPLIT`), then joined; with ``dedupe``
    a validation or test document whose exact text is also in training (or, for test, in
    validation) is dropped."""
    train: list[str] = []
    valid: list[str] = []
    test: list[str] = []
    for lines in parts:
        a, b, c = _split(list(lines))
        train, valid, test = train + a, valid + b, test + c
    if dedupe:
        seen = set(train)
        valid = [d for d in valid if d not in seen]
        seen.update(valid)
        test = [d for d in test if d not in seen]
    return train, valid, test


def _split(lines: list[str]) -> tuple[list[str], list[str], list[str]]:
    return split_lines(lines, SPLIT["valid_frac"], SPLIT["test_frac"],
                       SPLIT["mode"])  # type: ignore[arg-type]


def default_cache_dir() -> Path:
    """The user's cache for derived files: ``$XDG_CACHE_HOME/pufferfish`` or
    ``~/.cache/pufferfish`` (the XDG base directory rule, as pip and torch.hub follow it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pufferfish"


def _legacy_dir(name: str) -> Path | None:
    """Where versions before ``--cache-dir`` wrote a text corpus's cache: beside it (read only)."""
    path = Path(name).expanduser()
    return path.resolve().parent if path.is_file() else None


def load_bpe_corpus(name: str, vocab_size: int, cache_dir: str | os.PathLike[str] | None = None
                    ) -> BPECorpus:
    """The corpus ``name`` as BPE token streams, from the cache or trained and cached now."""
    tokenizers = _tokenizers()
    if vocab_size < MIN_VOCAB:
        raise DataError(f"vocab_size {vocab_size} is too small for a byte-level BPE: allowed >= "
                        f"{MIN_VOCAB} (256 bytes and {EOT})")
    (train, valid, test), stem, lines = corpus_splits(name)
    settings = {"vocab_size": vocab_size, "min_frequency": MIN_FREQUENCY, "split": SPLIT,
                "tokenizers": tokenizers.__version__, "format": 1}
    if BPE_CORPORA.get(name.strip().lower(), ((), False))[1]:  # kjv's digest stays as it was
        settings["dedupe"] = BPE_CORPORA[name.strip().lower()]
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for line in lines:
        digest.update(line.encode("utf-8") + b"\n")
    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = f"{stem}.bpe{vocab_size}-{digest.hexdigest()[:16]}"
    tok_path, ids_path = _cached_paths(directory, entry, _legacy_dir(name))
    if tok_path.is_file():
        tokenizer = tokenizers.Tokenizer.from_file(str(tok_path))
    else:
        tokenizer = _train(tokenizers, train, vocab_size)
        _atomic_write(tok_path, lambda f: f.write(tokenizer.to_str().encode()))
    streams = _load_streams(ids_path, digest.hexdigest())
    if streams is None:
        streams = [_encode(tokenizer, part) for part in (train, valid, test)]
        _atomic_write(directory / ids_path.name, lambda f: torch.save(
            {"digest": digest.hexdigest(), "streams": streams}, f))
    return BPECorpus(*streams, vocab_size=tokenizer.get_vocab_size(), tokenizer_path=tok_path,
                     source=name)


def _cached_paths(directory: Path, entry: str, legacy: Path | None) -> tuple[Path, Path]:
    """The tokenizer and token-stream files of ``entry``: in ``directory``, or in ``legacy``
    when an older version left both there and ``directory`` has neither (read, never written)."""
    paths = (directory / f"{entry}.tokenizer.json", directory / f"{entry}.tokens.pt")
    if legacy is not None and legacy != directory and not any(p.exists() for p in paths):
        old = (legacy / paths[0].name, legacy / paths[1].name)
        if all(p.is_file() for p in old):
            return old
    return paths


def _tokenizers() -> Any:
    """The optional ``tokenizers`` module, or a one-line DataError naming it."""
    try:
        import tokenizers
    except ImportError:
        raise DataError("a BPE corpus needs the tokenizers package: pip install tokenizers") \
            from None
    return tokenizers


def _train(tokenizers: Any, lines: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens on ``lines``; fewer possible is a DataError."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY,
                                  special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        raise DataError(f"vocab_size {vocab_size} is larger than the corpus allows: its training "
                        f"split has merges for {tokenizer.get_vocab_size()} tokens (pairs seen "
                        f"at least {MIN_FREQUENCY} times); allowed <= {tokenizer.get_vocab_size()}")
    return tokenizer


def _encode(tokenizer: Any, lines: Sequence[str]) -> torch.Tensor:
    """Every line's ids followed by ``<|endoftext|>``, concatenated."""
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(lines)):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


def _load_streams(path: Path, digest: str) -> list[torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a corrupt cache is a miss; the corpus is authoritative
        return None
    if not isinstance(saved, dict) or saved.get("digest") != digest:
        return None
    streams = saved.get("streams")
    ok = isinstance(streams, list) and len(streams) == 3 and all(
        isinstance(s, torch.Tensor) and s.dtype == torch.int64 and s.dim() == 1 for s in streams)
    return streams if ok else None


def _atomic_write(path: Path, write: Callable) -> None:
    """Write ``path`` through a temp file in its directory and a rename: never half-written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as e:
        raise DataError(f"{path.parent}: cannot write the BPE cache ({one_line(e, with_type=True)}); "
                        "expected a writable directory (set --cache-dir)") from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
