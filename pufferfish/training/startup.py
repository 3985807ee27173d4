"""Where a run starts: the checks that every rank runs the same thing, and the resume point.

Before the first step the ranks agree on the configuration and the data (a mismatch is named on
every rank instead of deadlocking in mismatched collectives or training silently wrong), and
decide which checkpoint, if any, the run continues from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, TrainConfig
from ..configfile import load_config
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from . import checkpoint as ckpt
from . import rundir
from .board import BOARD_SUBDIR
from .rundir import run_files
from .tasks import LEGACY_RUN_VALUES, Task

# Fields that may legitimately differ between ranks: node-local paths, per-process CPU threads,
# and rank 0's progress bar. Everything else must be identical or the replicas train different
# things (or deadlock in mismatched collectives).
PER_RANK_FIELDS = ("data_dir", "cache_dir", "threads", "progress")
# Fields that do not change what is computed, so an automatic resume (torchelastic restart or
# ``--resume auto``) may find them changed; any other difference means the run directory holds a
# different run, which is refused rather than silently continued. ``out`` is where the run lives,
# not what it computes: a run directory moved (or copied to another machine) resumes from there.
RUN_LOCAL_FIELDS = (*PER_RANK_FIELDS, "out", "resume", "overwrite", "download", "timeout_s",
                    "keep_checkpoints", "verbose", "logger")


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
    for name in ("train_images", "train_labels", "val_images", "val_labels", "test_images",
                 "test_labels", "train", "valid", "test"):
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


def find_resume_point(cfg: TrainConfig, env: DistEnv, run_dir: Path,
                      run_fields: tuple[str, ...], *, hold: contextlib.ExitStack | None = None,
                      total_epochs: int | None = None,
                      created: bool = False) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint to continue from, or None for a fresh start. Rank 0 decides, all learn it.

    * ``--resume DIR``: the newest checkpoint of DIR that verifies; flags may change what does not
      change the run: ``run_fields``, the fields that define what the run's components compute
      (the task's and the method's), must be those of the checkpoint. With ``--out`` elsewhere
      the run continues there (a fork).
    * ``--resume auto``, or a torchelastic restart (``TORCHELASTIC_RESTART_COUNT`` > 0): the newest
      checkpoint of ``--out`` that verifies, which must be of this very configuration
      (:data:`RUN_LOCAL_FIELDS` aside); a fresh start if ``--out`` holds no checkpoint at all.
    * Otherwise a fresh start.

    Nothing the user made is deleted unasked: if no checkpoint verifies, the run refuses, naming
    each file and why; newer checkpoints skipped for an older one are moved to
    ``checkpoints/rejected/`` (the resumed run will write those steps again), never deleted. A
    fresh start or a fork into a directory that holds an earlier run refuses unless
    ``--overwrite`` is given, which removes that run's files (:func:`run_files`) and says which.
    Rank 0 checks everything before it changes anything, and broadcasts the outcome (or the
    error): every rank resumes the same checkpoint or stops with the same message. Rank 0 first
    locks ``run_dir`` (:mod:`.rundir`: another run writing there is refused, naming its pid) and
    holds the lock until ``hold`` closes (without ``hold``: for the decision only); a directory
    it ``created`` (a fresh default one) that the run leaves empty is removed. A checkpoint
    further on than ``total_epochs`` (the epochs the run now trains) is refused.
    """
    outcome: Any = None
    found = None
    if env.is_main:
        lock = None
        try:
            lock = rundir.lock_run_dir(run_dir, created)
            found = _decide(cfg, env, run_dir, run_fields, total_epochs)
            outcome = None if found is None else str(found[1])
        except (ConfigError, ckpt.CheckpointError, OSError) as e:
            outcome = e
        except BaseException:  # a bug or Ctrl-C: the directory is let go as it was
            if lock is not None:
                lock.release(refused=True)
            raise
        if lock is not None:
            if hold is None or isinstance(outcome, BaseException):
                lock.release(refused=isinstance(outcome, BaseException))
            else:
                hold.callback(lock.release)
    outcome = dist_env.broadcast_object(outcome, env)
    if isinstance(outcome, BaseException):
        raise outcome
    if outcome is None:
        return None
    if found is None:  # another rank: load what rank 0 chose
        found = ckpt.load_checkpoint(outcome), Path(outcome)
    return found


@dataclass
class _Look:
    """A directory to look for a checkpoint in, and on whose behalf."""

    directory: Path
    how: str  # what asked for it, for messages: "--resume auto", "--resume DIR", a restart
    lenient: bool = False  # the checkpoint's flags may differ where they do not define the run
    required: bool = False  # no checkpoint at all is an error, not a fresh start


def _decide(cfg: TrainConfig, env: DistEnv, run_dir: Path, run_fields: tuple[str, ...],
            total_epochs: int | None = None) -> tuple[dict[str, Any], Path] | None:
    """Rank 0's decision (:func:`find_resume_point`): every check first, then the changes."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"out {str(run_dir)!r} is a file: allowed a directory (the run's)")
    restart = _restart_count()
    explicit = bool(cfg.resume) and cfg.resume != "auto"
    source = Path(cfg.resume) if explicit else run_dir
    fork = explicit and source.resolve() != run_dir.resolve()
    if explicit and not fork and cfg.overwrite:
        raise ConfigError(f"overwrite true is invalid with --resume {source} continuing that "
                          "directory itself: allowed with --out elsewhere (a fork) or without "
                          "--resume")
    # Where to look for a checkpoint, in order. On a restart an earlier attempt of this very
    # command may have written to --out; a fork restarted before its first checkpoint there forks
    # again from its source.
    looks: list[_Look] = []
    if restart and (fork or not explicit):
        looks.append(_Look(run_dir, f"automatic resume (torchelastic restart {restart})",
                           lenient=explicit))
    if explicit:
        looks.append(_Look(source, f"--resume {source}", lenient=True, required=True))
    elif cfg.resume == "auto":
        looks.append(_Look(run_dir, "--resume auto"))
    found, rejected, look = None, [], None
    for look in looks:
        found, rejected = ckpt.find_latest(look.directory)
        if found is not None or rejected:
            break
        if look.required:
            raise ckpt.CheckpointError(
                f"{look.how}: no checkpoint in {look.directory / ckpt.CHECKPOINT_SUBDIR} to "
                "continue from; to start the run anew there use --overwrite without --resume")
    if look is not None and found is None and rejected:
        raise ckpt.CheckpointError(
            f"{look.how}: no checkpoint in {look.directory} verifies, so nothing was resumed and "
            f"nothing removed: {'; '.join(why for _, why in rejected)}; to start anew, move "
            "them away (or use --overwrite without --resume, which deletes them)")
    if look is not None and found is not None:
        _check_same_run(found, cfg, look, run_dir, env.world_size, run_fields)
        _check_not_past(found, cfg, look, total_epochs)
    in_place = look is not None and found is not None \
        and look.directory.resolve() == run_dir.resolve()
    removable = [] if in_place else _claim(cfg, run_dir, looks[0].how if looks else "",
                                           own=bool(restart) or cfg.resume == "auto")
    # Every check passed: now change the directory.
    if removable:
        _remove(run_dir, removable)
    rundir.record_run(run_dir)  # what this run writes is its own from now on
    if rejected:
        _skipped(env, rejected, found[1], set_aside=in_place)  # type: ignore[index]
    if found is None:
        if looks:
            dist_env.say(env, f"no checkpoint in {run_dir}: starting from the beginning")
        return None
    return found


def _default(name: str) -> Any:
    """What a checkpoint written before field ``name`` existed ran with: its default (e.g.
    ``grad_accum`` 1; None for a name that is no field)."""
    spec = TrainConfig.__dataclass_fields__.get(name)
    if spec is None:
        return None
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default  # type: ignore[misc]


def _check_not_past(found: tuple[dict[str, Any], Path], cfg: TrainConfig, look: _Look,
                    total_epochs: int | None) -> None:
    """A resume to fewer epochs than the checkpoint has trained would train nothing (and
    record the smaller number as the run's): refused, naming both."""
    progress = found[0].get("progress") or {}
    epoch, step = int(progress.get("epoch", 0)), int(progress.get("step_in_epoch", 0))
    if total_epochs is None or total_epochs >= epoch + (1 if step else 0):
        return
    done = f"{epoch} epoch{'s' * (epoch != 1)}" + (f" and {step} steps" if step else "")
    at_least = epoch + (1 if step else 0) + cfg.epochs - total_epochs
    raise ConfigError(f"epochs {cfg.epochs} is fewer than {look.how} has trained ({done}, "
                      f"{found[1]}); nothing was changed: allowed epochs >= {at_least}")


def _check_same_run(found: tuple[dict[str, Any], Path], cfg: TrainConfig, look: _Look,
                    run_dir: Path, world_size: int, run_fields: tuple[str, ...]) -> None:
    """The checkpoint must be of this run: all fields (automatic resume) or those defining it."""
    saved, path = found
    # A run field the checkpoint does not know (written before it was added) had its old value.
    config = {**{k: v for k, v in LEGACY_RUN_VALUES.items() if k in run_fields},
              **saved["config"]}
    if look.lenient:
        # A key the checkpoint lacks was written before the field existed: it ran the default
        # (or, for a field in LEGACY_RUN_VALUES, that old value).
        ckpt.verify_compatible({k: config.get(k, _default(k)) for k in run_fields},
                               {k: getattr(cfg, k) for k in run_fields}, what="configuration")
    else:
        # Other keys the checkpoint does not know are not compared.
        current = {k: v for k, v in cfg.to_dict().items()
                   if k not in RUN_LOCAL_FIELDS and k in config}
        try:
            ckpt.verify_compatible({k: config[k] for k in current}, current,
                                   what="configuration")
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(
                f"{e} ({look.how} from {run_dir}: to continue that run with changed flags "
                f"use --resume {run_dir}, to start a new one use another --out)") from None
    hook_states = [r.get("hook") for r in saved.get("ranks") or []]
    if any(hook_states) and len(hook_states) != world_size:
        raise ckpt.CheckpointError(
            f"{path} was written by {len(hook_states)} processes, this run has "
            f"{world_size}: the per-rank memory of comm hook {cfg.comm!r} cannot be "
            "redistributed; resume with the same number of processes")


# -- the run directory ---------------------------------------------------------------------------

def _claim(cfg: TrainConfig, run_dir: Path, how: str, own: bool) -> list[Path]:
    """May this run write into ``run_dir``? The files to remove first, or a refusal.

    ``own``: on an automatic resume (restart, ``--resume auto``) with no checkpoint, files of this
    very configuration are an earlier attempt of this run, and simply replaced as it runs again.
    """
    foreign = rundir.foreign_files(run_dir)
    if foreign:
        raise ConfigError(
            f"--out {run_dir} holds {_names(foreign, run_dir)}, which `pufferfish train` did not "
            f"write (its record, {rundir.RECORD}, does not name them); nothing was changed: "
            "allowed another --out (--overwrite removes only a run's own files)")
    found = run_files(run_dir)
    if not found:
        return []
    names = _names(found, run_dir)
    if own:
        if _same_configuration(cfg, run_dir):
            return []
        raise ConfigError(
            f"{how}: {run_dir} holds no checkpoint but files of another run ({names}); nothing "
            "was changed: start this run in another --out, or anew without --resume and with "
            "--overwrite (which removes those files)")
    if cfg.overwrite:
        return run_files(run_dir, temps=True)
    if cfg.resume:
        raise ConfigError(
            f"--out {run_dir} holds another run ({names}); nothing was changed: fork --resume "
            f"{cfg.resume} into another --out, or add --overwrite (removes those files only)")
    if not ckpt.checkpoint_files(run_dir):  # nothing to resume: only the fresh start works
        raise ConfigError(
            f"--out {run_dir} holds an earlier run that stopped before its first checkpoint "
            f"({names}); nothing was changed: start it anew there with --overwrite (removes "
            "those files only), or use another --out")
    raise ConfigError(
        f"--out {run_dir} holds an earlier run ({names}); nothing was changed: continue it with "
        f"--resume {run_dir}, or start anew there with --overwrite (removes those files only)")


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A run's saved ``config.toml`` (then ``overrides``): a field it lacks, written before the
    field existed, has its old value (:data:`~.tasks.LEGACY_RUN_VALUES`), not today's default."""
    try:
        saved = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        saved = {}  # load_config names what is wrong with the file
    old = {k: v for k, v in LEGACY_RUN_VALUES.items() if k not in saved}
    return load_config(path, {**old, **(overrides or {})})


def _same_configuration(cfg: TrainConfig, run_dir: Path) -> bool:
    """Whether ``run_dir/config.toml`` is ``cfg`` up to :data:`RUN_LOCAL_FIELDS`."""

    try:
        saved = load_run_config(run_dir / "config.toml").to_dict()
    except ConfigError:
        return False
    current = cfg.to_dict()
    return all(saved[k] == current[k] for k in current if k not in RUN_LOCAL_FIELDS)


def _remove(run_dir: Path, files: list[Path]) -> None:
    """--overwrite: remove the earlier run's files (checkpoints first, config.toml last)."""
    ordered = sorted(files, key=lambda p: (p.parent == run_dir, p.name == "config.toml"))
    # A checkpoint that does not verify is evidence (a bad copy, tampering, a crash): it is moved
    # to checkpoints/rejected/ like on resume, never deleted, even under --overwrite.
    aside = [p for p in ordered if p.suffix == ".pt" and p.parent != run_dir and p.exists()
             and ckpt.rejection(p) is not None]
    for path in aside:
        ckpt.set_aside(path)
    for path in ordered:
        if path.is_dir():  # the sharded part of an FSDP2 checkpoint
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # tb/, if only the event files removed were in it
        (run_dir / BOARD_SUBDIR).rmdir()
    others = sorted(p for p in [*run_dir.iterdir(), *_entries(run_dir / ckpt.CHECKPOINT_SUBDIR)]
                    if (p.name != ckpt.CHECKPOINT_SUBDIR or p.parent != run_dir)
                    and p.name not in rundir.BOOKKEEPING)
    kept = f"; left alone: {_names(others, run_dir)}" if others else ""
    gone = [p for p in files if p not in aside and not (p.suffix == ".json" and any(
        a.with_suffix(".json") == p for a in aside))]
    moved = (f"; set aside in {ckpt.CHECKPOINT_SUBDIR}/{ckpt.REJECTED_SUBDIR}/ (they do not "
             f"verify): {_names(aside, run_dir)}") if aside else ""
    print(f"--overwrite: removed the earlier run in {run_dir}: {_names(gone, run_dir)}{moved}"
          f"{kept}", flush=True)


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


def _skipped(env: DistEnv, rejected: list[tuple[Path, str]], used: Path, set_aside: bool) -> None:
    """Newer checkpoints that do not verify: moved to ``rejected/`` (in place) or left (a fork)."""
    reasons = "; ".join(why for _, why in rejected)
    if set_aside:
        moved = [p for path, _ in rejected for p in ckpt.set_aside(path)]
        where = (f"moved to {used.parent / ckpt.REJECTED_SUBDIR} (kept, never deleted): "
                 f"{', '.join(p.name for p in moved)}")
    else:
        where = "they stay where they are"
    dist_env.say(env, f"pufferfish: warning: skipped checkpoint(s) that do not verify: {reasons}; "
                      f"resuming from {used}; {where}")


def _names(paths: list[Path], run_dir: Path) -> str:
    return ", ".join(str(p.relative_to(run_dir)) + ("/" if p.is_dir() else "") for p in paths)


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
