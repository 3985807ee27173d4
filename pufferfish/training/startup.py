"""Where a run starts: the checks that every rank runs the same thing, and the resume point.

Before the first step the ranks agree on the configuration and the data (a mismatch is named on
every rank instead of deadlocking in mismatched collectives or training silently wrong), and
decide which checkpoint, if any, the run continues from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, TrainConfig
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from . import checkpoint as ckpt
from .tasks import Task

# Fields that may legitimately differ between ranks: node-local paths, per-process CPU threads,
# and rank 0's progress bar. Everything else must be identical or the replicas train different
# things (or deadlock in mismatched collectives).
PER_RANK_FIELDS = ("data_dir", "threads", "progress")
# Fields that do not change what is computed, so an automatic resume (torchelastic restart or
# ``--resume auto``) may find them changed; any other difference means the run directory holds a
# different run, which is refused rather than silently continued.
RUN_LOCAL_FIELDS = (*PER_RANK_FIELDS, "resume", "download", "timeout_s", "keep_checkpoints")


# -- agreement across ranks ------------------------------------------------------

def check_config_agrees(cfg: TrainConfig, env: DistEnv) -> None:
    """Every rank must run the same configuration; a difference is named on every rank.

    Ranks first compare a hash (one small all-gather); only on a mismatch do they gather the
    configurations themselves to name the differing keys. Runs before any other collective, so a
    mismatch cannot turn into mismatched collectives (a deadlock or silently wrong training).
    """
    if not env.distributed:
        return
    record = {k: v for k, v in cfg.to_dict().items() if k not in PER_RANK_FIELDS}
    # Different library versions on different nodes compute different things from the same
    # configuration (kernels, defaults): part of what must agree.
    record["torch_version"] = torch.__version__
    record["python"] = ".".join(map(str, sys.version_info[:3]))
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()
    if len(set(dist_env.gather_object(digest, env))) > 1:
        check_agree(env, "the configuration", record, ConfigError)
    dist_env.say(env, f"configuration {digest[:12]}: the same on all {env.world_size} ranks")


def check_agree(env: DistEnv, what: str, record: dict[str, Any],
                 error: Callable[[str], Exception]) -> None:
    """Gather ``record`` from every rank; raise ``error`` naming the keys that differ."""
    if not env.distributed:
        return
    records = dist_env.gather_object(record, env)
    keys = list(dict.fromkeys(k for r in records for k in r))
    diffs = []
    for key in keys:
        values = [r.get(key) for r in records]
        other = next((rank for rank, v in enumerate(values) if v != values[0]), None)
        if other is not None:
            diffs.append(f"{key} (rank 0: {_short(values[0])}, rank {other}: "
                         f"{_short(values[other])})")
    if diffs:
        more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        raise error(f"ranks disagree on {what}: {'; '.join(diffs[:3])}{more}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def data_fingerprint(task: Task) -> dict[str, Any]:
    """A cheap digest of the data each rank loaded: shapes, dtypes and sampled bytes.

    Hashes the first and last examples and 64 evenly spaced ones of every split (and the
    vocabulary of a corpus), so different files, subsets or tokenizations are caught in
    milliseconds; a difference confined to unsampled examples is not (see docs/reliability.md).
    """
    source = getattr(task, "ds", None) or getattr(task, "corpus", None)
    out: dict[str, Any] = {}
    for name in ("train_images", "train_labels", "test_images", "test_labels",
                 "train", "valid", "test"):
        t = getattr(source, name, None)
        if isinstance(t, torch.Tensor):
            out[name] = _sample_digest(t)
    vocab = getattr(source, "vocab", None)
    if vocab is not None:
        words = list(getattr(vocab, "idx2word", []))
        out["vocab"] = hashlib.sha256(
            "\n".join([str(len(words)), *words[:256], *words[-256:]]).encode()).hexdigest()[:16]
    out["train_batches"] = len(task.train_loader)
    return out


def _sample_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{tuple(t.shape)} {t.dtype}".encode())
    if t.numel():
        rows = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
        n = rows.shape[0]
        idx = torch.unique(torch.cat([torch.arange(min(n, 1024)), torch.arange(max(0, n - 1024), n),
                                      torch.linspace(0, n - 1, min(n, 64)).long()]))
        h.update(rows[idx].cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _restart_count() -> int:
    """How often torchelastic has restarted this worker group (0: first attempt, or no torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def find_resume_point(cfg: TrainConfig, env: DistEnv,
                       run_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint to continue from, or None for a fresh start.

    * ``--resume DIR``: the newest complete checkpoint of DIR; flags may change what does not
      change the run (see :func:`_check_resumable`). With ``--out`` elsewhere the run continues
      there (a fork); checkpoints already there are removed first.
    * ``--resume auto``, or a torchelastic restart (``TORCHELASTIC_RESTART_COUNT`` > 0) without
      ``--resume``: the newest complete checkpoint of ``--out`` if there is one, and it must be
      of this very configuration (:data:`RUN_LOCAL_FIELDS` aside); otherwise a fresh start.
    * Otherwise a fresh start, which removes the checkpoints of an earlier run in ``--out``: a
      later resume must never pick up a checkpoint of another run (the metrics and config of
      that run are replaced as well).
    """
    explicit = bool(cfg.resume) and cfg.resume != "auto"
    auto = cfg.resume == "auto" or (not cfg.resume and _restart_count() > 0)
    source = Path(cfg.resume) if explicit else run_dir
    found = _latest_checkpoint(source, env) if explicit or auto else None
    if found is None and (explicit or auto):
        dist_env.say(env, f"no complete checkpoint in {source}: starting from the beginning")
    if env.is_main and (found is None or source.resolve() != run_dir.resolve()):
        _remove_checkpoints(run_dir)
    if found is None:
        return None
    saved, path = found
    if explicit:
        _check_resumable(saved, cfg)
    else:
        # Keys the checkpoint does not know (written before a field was added) are not compared.
        current = {k: v for k, v in cfg.to_dict().items()
                   if k not in RUN_LOCAL_FIELDS and k in saved["config"]}
        try:
            ckpt.verify_compatible({k: saved["config"][k] for k in current}, current,
                                   what="configuration")
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(
                f"{e} (automatic resume from {run_dir}: to continue that run with changed flags "
                f"use --resume {run_dir}, to start a new one use another --out)") from None
    hook_states = saved.get("hook_states") or []
    if any(hook_states) and len(hook_states) != env.world_size:
        raise ckpt.CheckpointError(
            f"{path} was written by {len(hook_states)} processes, this run has "
            f"{env.world_size}: the per-rank memory of comm hook {cfg.comm!r} cannot be "
            "redistributed; resume with the same number of processes")
    return found


def _latest_checkpoint(run_dir: Path, env: DistEnv) -> tuple[dict[str, Any], Path] | None:
    """:func:`ckpt.latest_checkpoint`, its skip warnings as one line each on rank 0."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ckpt.CheckpointWarning)
        found = ckpt.latest_checkpoint(run_dir)
    for w in caught:
        if issubclass(w.category, ckpt.CheckpointWarning):
            if env.is_main:
                print(f"pufferfish: warning: {w.message}", flush=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return found


def _remove_checkpoints(run_dir: Path) -> None:
    directory = run_dir / ckpt.CHECKPOINT_SUBDIR
    if not directory.is_dir():
        return
    names = re.compile(r"^(ckpt-\d{9,}\.(pt|json)|\.ckpt-\d{9,}\.(pt|json)\..*\.tmp)$")
    removed = 0
    for entry in directory.iterdir():
        if names.match(entry.name):
            entry.unlink(missing_ok=True)
            removed += entry.suffix == ".pt"
    if removed:
        print(f"starting a new run in {run_dir}: removed {removed} checkpoint(s) of an earlier "
              "run there", flush=True)


def _check_resumable(saved: dict[str, Any], cfg: TrainConfig) -> None:
    """The run being resumed must be the run that was saved (flags may change the rest)."""
    keys = ("model", "width", "data", "mode", "warmup_epochs", "rank_ratio", "preset", "keep",
            "keep_first", "extra_bn", "seed", "train_subset", "batch_size")
    ckpt.verify_compatible({k: saved["config"].get(k) for k in keys},
                           {k: getattr(cfg, k) for k in keys}, what="configuration")


def load_model(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Load a checkpoint's weights; a checkpoint of another architecture is a named error."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [k for k in own if k in weights and own[k].shape != weights[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected),
                                    ("different shape", shapes)) if keys]
        raise ckpt.CheckpointError(f"checkpoint {path} does not fit this model ({'; '.join(parts)})")
    model.load_state_dict(weights)
