"""Loading one checkpoint: verify it against its manifest, then ``torch.load(weights_only=True)``.

Never falls back to full unpickling: a file whose pickle references arbitrary globals (e.g. an
object whose ``__reduce__`` calls ``os.system``) is refused before anything in it runs.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ...formatting import one_line
from .errors import CheckpointError, UnsafeCheckpointError, describe_failure
from .manifest import verify_manifest
from .sharded import verify_sharded


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> dict[str, Any]:
    """Verify ``path`` against its manifest, then load it with ``weights_only=True``.

    Never falls back to full unpickling: a file whose pickle references anything but
    tensors and plain containers raises :class:`UnsafeCheckpointError` and nothing in
    it is executed. Size/checksum/manifest problems raise :class:`CheckpointError`.
    ``map_location`` defaults to ``"cpu"`` so a GPU-saved checkpoint loads anywhere;
    move the model/optimizer to the device after ``load_state_dict``.
    """
    pt_path = Path(path)
    try:
        verify_manifest(pt_path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {pt_path}: {describe_failure(exc)}") from exc
    try:
        state = torch.load(pt_path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{pt_path} is not a plain-weights checkpoint (refused by weights_only loading; "
            f"not executed): {_first_line(exc)}"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{pt_path} is unreadable: {describe_failure(exc)}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{pt_path} holds a {type(state).__name__}, expected a dict")
    if "sharded" in state:  # FSDP2: the shards beside it must match what the payload recorded
        verify_sharded(pt_path, state["sharded"])
    return state


def _first_line(exc: BaseException) -> str:
    # torch's weights_only error is a long essay; the useful part is the "Unsupported
    # global" line naming what the file tried to reference.
    text = str(exc)
    for line in text.splitlines():
        if "Unsupported" in line or "GLOBAL" in line:
            return one_line(line, limit=200)
    return one_line(text, limit=200)
