"""Which command wrote which file of an output directory (``report``, ``compare``, ``bench``).

Nothing the user made is overwritten unasked: before a command writes into ``--out`` it claims
the names it may write. A name that exists there and was not written by the same command (another
command's ``report.md``, the user's own file) stops it with one line, unless ``overwrite``. The
record is ``.pufferfish-outputs.json`` in the directory: ``{name: command}``. Running the same
command again into its own directory replaces its own outputs, as a report refreshes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["OutputsError", "claim_outputs", "owners"]

RECORD = ".pufferfish-outputs.json"


class OutputsError(ValueError):
    """An output would replace a file this command did not write; the message is one line."""


def owners(out_dir: str | Path) -> dict[str, str]:
    """``{name: command}`` of the directory's record (empty when it has none)."""
    try:
        record = json.loads((Path(out_dir) / RECORD).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return {str(k): str(v) for k, v in record.items()} if isinstance(record, dict) else {}


def claim_outputs(out_dir: str | Path, command: str, names: Iterable[str],
                  overwrite: bool = False) -> None:
    """Claim ``names`` (files or folders, relative to ``out_dir``) for ``command``.

    Refuses (``OutputsError``) when one exists and the record does not say ``command`` wrote it,
    unless ``overwrite``; else creates ``out_dir`` and records the names as ``command``'s.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputsError(f"--out {str(out)!r} is a file: allowed a directory")
    names = list(names)
    record = owners(out)
    taken = [n for n in names if (out / n).exists() and record.get(n) != command]
    if taken and not overwrite:
        by = {record.get(n, "unknown") for n in taken}
        raise OutputsError(
            f"{str(out)!r} already holds {', '.join(taken)} (written by {', '.join(sorted(by))}),"
            f" which `pufferfish {command}` would replace: allowed another --out, or --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    record.update(dict.fromkeys(names, command))
    tmp = out / f"{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / RECORD)
