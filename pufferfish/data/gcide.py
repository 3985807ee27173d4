"""GCIDE, the Collaborative International Dictionary of English, as plain-text documents.

Debian's ``dict-gcide`` ships it as a dictd database: ``gcide.index`` (headword, offset, length in
dictd's base64) and ``gcide.dict.dz`` (the entries' text, gzip-compatible). Every distinct
(offset, length) of the index is one entry, i.e. one document: its lines joined by spaces, the
markup stripped and the text kept:

- pronunciations (``\\Al"ley*way`\\``) and source tags (``[1913 Webster]``, ``[WordNet 1.5]``,
  ``[PJC]``) removed; cross-references (``{Halloween}``) kept as their words;
- letter codes (``[=e]``, ``[i^]``, ``["o]``) become the plain letter, ligatures (``[ae]``) their
  letters; usage labels (``[Obs.]``, ``[Poet.]``) stay, they are text;
- the database's own ``00-database-*`` entries (licence, URLs) are left out.

About 203,000 entries, 5.4M words. The KJV + GCIDE corpus (``--data kjv+gcide``) is built from
these documents by :mod:`pufferfish.data.bpe`.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from .errors import DataError

__all__ = ["GCIDE_DIR", "clean_entry", "load_gcide"]

GCIDE_DIR = Path("/usr/share/dictd")
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_PRONUNCIATION = re.compile(r"\s*\\[^\\\n]*\\")
_SOURCE_TAG = re.compile(r"\[[^\]\n]*(?:Webster|WordNet|PJC)[^\]\n]*\]")
_LETTER_CODE = re.compile(r"\[([=^'.~\-\"`,]?)([a-z]{1,5})([=^'.~\-\"`,]?)\]")
_NAMED = {"imac": "i", "aum": "a", "eth": "th", "thorn": "th", "deg": "°", "root": "√"}
_KEEP_LETTERS = {"ae", "oe", "ng", "oo", "a", "e", "i", "o", "u", "y", "n", "c", "s"}
_SPACE = re.compile(r"\s+")


def _decode_b64(text: str) -> int:
    value = 0
    for ch in text:
        index = _B64.find(ch)
        if index < 0:
            raise ValueError(ch)
        value = value * 64 + index
    return value


def _letter(match: re.Match[str]) -> str:
    before, letters, after = match.groups()
    if letters in _NAMED:
        return _NAMED[letters]
    if before or after or letters in _KEEP_LETTERS:
        return letters
    return match.group(0)  # a short bracketed word that is not a letter code: kept as text


def clean_entry(text: str) -> str:
    """One entry's text with the markup stripped, on one line."""
    text = _PRONUNCIATION.sub("", text)
    text = _SOURCE_TAG.sub("", text)
    text = _LETTER_CODE.sub(_letter, text)
    text = text.replace("{", "").replace("}", "")
    return _SPACE.sub(" ", text).strip()


def load_gcide(directory: str | Path = GCIDE_DIR) -> list[str]:
    """The dictionary's entries in index order of their text, one cleaned string each."""
    directory = Path(directory)
    index_path, dict_path = directory / "gcide.index", directory / "gcide.dict.dz"
    if not index_path.is_file() or not dict_path.is_file():
        raise DataError(f"{directory}: no gcide.index and gcide.dict.dz; expected GCIDE's dictd "
                        "files (install them with `apt-get install dict-gcide`, or `make data`)")
    spans = set()
    for lineno, line in enumerate(index_path.read_text("utf-8").splitlines(), 1):
        fields = line.split("\t")
        if len(fields) != 3:
            raise DataError(f"{index_path} line {lineno}: {line[:40]!r}; expected "
                            "'headword<TAB>offset<TAB>length'")
        if fields[0].startswith("00-"):
            continue  # the database's own entries: licence, URLs, version
        try:
            spans.add((_decode_b64(fields[1]), _decode_b64(fields[2])))
        except ValueError:
            raise DataError(f"{index_path} line {lineno}: offset/length {fields[1]!r}/"
                            f"{fields[2]!r} are not dictd base64") from None
    try:
        data = gzip.decompress(dict_path.read_bytes())
    except (OSError, EOFError) as e:
        raise DataError(f"{dict_path}: not a readable dictzip file ({e})") from None
    entries = []
    for offset, length in sorted(spans):
        if offset + length > len(data):
            raise DataError(f"{index_path}: an entry at {offset}+{length} ends past the "
                            f"{len(data)} bytes of {dict_path.name}; expected matching files")
        text = clean_entry(data[offset:offset + length].decode("utf-8", "replace"))
        if text:
            entries.append(text)
    if not entries:
        raise DataError(f"{index_path}: no entries; expected GCIDE's dictionary")
    return entries
