"""Crash-safe, pickle-free checkpoint store for a training run directory.

Layout: ``run_dir/checkpoints/ckpt-{step:09d}.pt`` (the ``torch.save`` payload) plus
``ckpt-{step:09d}.json`` (a manifest holding the payload's size and SHA-256).

Why it is built this way:

* **Atomicity.** Every file is written to a hidden temp file in the same directory,
  flushed, ``fsync``-ed, ``os.replace``-d onto its final name, and the directory is
  ``fsync``-ed. A reader therefore never sees a half-written file under a final name,
  even after a kill or power loss.
* **Completeness marker.** The manifest is written *after* the payload is in place, so
  "a manifest exists and matches" means "this checkpoint is complete". A payload
  without a manifest (killed between the two renames) is treated as incomplete.
* **Integrity.** :func:`load_checkpoint` checks size and SHA-256 before unpickling, so
  truncation or bit rot is reported as such rather than as a confusing unpickling error.
* **No code execution.** Loading uses ``torch.load(weights_only=True)`` only. A file
  whose pickle references arbitrary globals (e.g. an object whose ``__reduce__`` calls
  ``os.system``) is refused with :class:`UnsafeCheckpointError` before anything runs.
  Note: globals that the *process* registered via
  ``torch.serialization.add_safe_globals`` widen what ``weights_only`` accepts.
* **Fail before writing.** :func:`save_checkpoint` walks ``state`` first and refuses
  anything ``weights_only`` loading could not read back, so a run never discovers at
  resume time that its checkpoints are unloadable.

What ``state`` may contain (everything else is refused at save time, naming the key):
``dict`` / ``collections.OrderedDict`` / ``collections.Counter``, ``list``, ``tuple``,
``set``, ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
``bytearray``, plain ``torch.Tensor`` / ``nn.Parameter``, ``torch.Size``,
``torch.dtype``, ``torch.device``. In practice:

* ``module.state_dict()``, ``optimizer.state_dict()`` (SGD momentum buffers, Adam
  ``step`` tensors, ...) and the built-in LR schedulers' ``state_dict()`` work as is.
  Schedulers holding callables (e.g. ``LambdaLR`` with a callable *object*) do not.
* ``torch.get_rng_state()`` / ``torch.cuda.get_rng_state_all()`` are tensors: fine.
* ``random.getstate()`` is a tuple of ints (and ``None``): survives as is; pass it
  straight back to ``random.setstate``.
* ``numpy.random.get_state()`` contains an ``ndarray``, and numpy scalars
  (``np.float64`` metrics, ...) are numpy objects: convert them (``float(x)``,
  ``torch.from_numpy(a)``).
* ``namedtuple``, dataclasses, ``defaultdict``, ``pathlib.Path``, enums: convert to
  plain dicts / lists / strings.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import pickle
import re
import secrets
import socket
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from ..formatting import one_line
from . import faults

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "UnsafeCheckpointError",
    "atomic_write",
    "atomic_write_text",
    "checkpoint_files",
    "checkpoint_step",
    "find_latest",
    "latest_checkpoint",
    "load_checkpoint",
    "rejection",
    "save_checkpoint",
    "set_aside",
    "verify_compatible",
]

CHECKPOINT_SUBDIR = "checkpoints"
REJECTED_SUBDIR = "rejected"  # under CHECKPOINT_SUBDIR: checkpoints set aside, never deleted
MANIFEST_FORMAT = "pufferfish-checkpoint"
MANIFEST_VERSION = 1

_PT_RE = re.compile(r"^ckpt-(\d{9,})\.pt$")
_JSON_RE = re.compile(r"^ckpt-(\d{9,})\.json$")
_TMP_RE = re.compile(
    r"^\.(?P<final>ckpt-\d{9,}\.(?:pt|json))\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$"
)

_MAX_REPORTED = 3


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified, loaded, or does not match this run."""


class UnsafeCheckpointError(CheckpointError):
    """The file passed its checksum but is not a plain-weights checkpoint.

    Distinct from :class:`CheckpointError` because it does not look like a crash
    artifact: :func:`latest_checkpoint` raises it instead of silently falling back.
    """


class CheckpointWarning(UserWarning):
    """An incomplete or corrupt checkpoint was skipped in favour of an older one."""


# --------------------------------------------------------------------------- paths


def _ckpt_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINT_SUBDIR


def _pt_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def _manifest_path(pt_path: Path) -> Path:
    return pt_path.with_suffix(".json")


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """Return the step encoded in a checkpoint file name (``ckpt-000001200.pt`` -> 1200).

    Lets the training loop resume its step counter from the path returned by
    :func:`latest_checkpoint` without storing it twice.
    """
    m = _PT_RE.match(Path(path).name)
    if m is None:
        raise CheckpointError(f"{path} is not a checkpoint file name (expected ckpt-NNNNNNNNN.pt)")
    return int(m.group(1))


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def _temp_path(final: Path) -> Path:
    # Hidden and ending in .tmp so no reader glob ever matches it; host + pid let a later
    # save recognise (and remove) temps orphaned by a killed writer.
    return final.parent / f".{final.name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


# ------------------------------------------------------------------ low-level I/O


def _fsync_dir(directory: Path) -> None:
    """Persist directory entries (renames/unlinks); without it a rename can be lost."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms that cannot open directories
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class _HashingWriter:
    """File-like wrapper that hashes and counts bytes as ``torch.save`` writes them.

    Avoids re-reading a multi-GB checkpoint just to compute its checksum.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += view.nbytes
        return n if n is not None else view.nbytes

    def flush(self) -> None:
        self._f.flush()


def atomic_write(final: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``final`` via temp file + fsync + rename + directory fsync.

    On any failure the temp file is removed and the exception propagates; ``final`` is
    either its old content or the complete new content, never a mixture.
    """
    tmp = _temp_path(final)
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(final.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write` of a small text file (metrics, config, records of the run)."""
    atomic_write(path, lambda f: f.write(text.encode()))


def _describe_failure(exc: BaseException) -> str:
    """Name the root OSError (torch wraps ENOSPC from file objects in a RuntimeError)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            name = errno.errorcode.get(cur.errno, str(cur.errno))
            return f"{name}: {cur.strerror or cur}"
        cur = cur.__cause__ or cur.__context__
    return f"{type(exc).__name__}: {one_line(str(exc), limit=200)}"


def _sha256_file(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
        size = f.tell()
    return digest.hexdigest(), size


# ------------------------------------------------------------- state validation

_LEAF_TYPES = (
    type(None), bool, int, float, complex, str, bytes, bytearray,
    torch.dtype, torch.device, torch.Size,
)
_DICT_TYPES = (dict, OrderedDict, Counter)
_SEQ_TYPES = (list, tuple, set)


def _key_path(parent: str, key: Any) -> str:
    return f"{parent}[{key!r}]"


def _check_weights_only_safe(obj: Any, where: str = "state", _seen: set[int] | None = None) -> None:
    """Refuse values ``torch.load(weights_only=True)`` could not read back, naming the key."""
    if _seen is None:
        _seen = set()
    t = type(obj)
    if t in _LEAF_TYPES:
        return
    if t is torch.Tensor or t is nn.Parameter:
        return
    if id(obj) in _seen:
        return
    if t in _DICT_TYPES:
        _seen.add(id(obj))
        for k, v in obj.items():
            if type(k) not in _LEAF_TYPES:
                raise CheckpointError(
                    f"cannot save {where}: key {k!r} has type {t.__module__}.{type(k).__qualname__}; "
                    "use str/int keys"
                )
            _check_weights_only_safe(v, _key_path(where, k), _seen)
        return
    if t in _SEQ_TYPES:
        _seen.add(id(obj))
        for i, v in enumerate(obj):
            _check_weights_only_safe(v, _key_path(where, i), _seen)
        return
    raise CheckpointError(
        f"cannot save {where}: {t.__module__}.{t.__qualname__} would not load with "
        f"torch.load(weights_only=True); {_conversion_hint(obj)}"
    )


def _conversion_hint(obj: Any) -> str:
    mod = type(obj).__module__ or ""
    if mod.startswith("numpy"):
        return "convert numpy values (float(x), int(x), torch.from_numpy(a))"
    if isinstance(obj, torch.Tensor):
        return "convert the tensor subclass to a plain tensor (t.as_subclass(torch.Tensor))"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "convert the namedtuple with ._asdict() or tuple(x)"
    if isinstance(obj, Mapping):
        return "convert the mapping with dict(x)"
    if isinstance(obj, os.PathLike):
        return "store the path as str(x)"
    if callable(obj):
        return "callables cannot be stored; store a name or config instead"
    return "convert it to plain dicts/lists/numbers/strings/tensors"


# ---------------------------------------------------------------------- saving


def save_checkpoint(
    run_dir: str | os.PathLike[str], state: dict[str, Any], step: int, keep_last: int = 3
) -> Path:
    """Atomically write ``state`` as the checkpoint for ``step`` and prune old ones.

    Order of operations (each step durable before the next, so a kill at any point
    leaves every *previous* checkpoint intact and the new one either complete or
    recognisably incomplete):

    1. validate ``state`` loads with ``weights_only=True`` (see module docstring);
    2. remove an existing manifest for the same ``step`` (re-save) so the old manifest
       never vouches for new bytes;
    3. ``torch.save`` to a temp file, fsync, rename to ``ckpt-{step:09d}.pt``, fsync dir;
    4. write the manifest (size + SHA-256) the same way;
    5. prune: keep the newest ``keep_last`` complete checkpoints (always including this
       one); checkpoints with a *larger* step than ``step`` are left alone.

    Raises :class:`CheckpointError` (naming the path and e.g. ``ENOSPC``) if writing
    fails; the temp files and any partial files for ``step`` are removed. Pruning
    failures only warn: the new checkpoint is already safe.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    _check_weights_only_safe(state)

    ckpt_dir = _ckpt_dir(run_dir)
    pt_path = ckpt_dir / _pt_name(step)
    manifest_path = _manifest_path(pt_path)
    try:
        created = not ckpt_dir.is_dir()
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if created:
            _fsync_dir(ckpt_dir.parent)
        _remove_orphaned_temps(ckpt_dir)
        if manifest_path.exists():
            manifest_path.unlink()
            _fsync_dir(ckpt_dir)
    except OSError as exc:
        raise CheckpointError(
            f"cannot prepare checkpoint directory {ckpt_dir}: {_describe_failure(exc)}"
        ) from exc

    hashed: dict[str, Any] = {}

    def write_payload(f: IO[bytes]) -> None:
        w = _HashingWriter(f)
        torch.save(state, w)  # type: ignore[arg-type]
        hashed["sha256"], hashed["size"] = w.sha256.hexdigest(), w.size
        faults.strike("save-payload", step)

    def write_manifest(f: IO[bytes]) -> None:
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "file": pt_path.name,
            "step": step,
            "size": hashed["size"],
            "sha256": hashed["sha256"],
            "torch_version": torch.__version__,
            "created_unix": time.time(),
        }
        f.write((json.dumps(manifest, indent=1) + "\n").encode())

    current = pt_path
    try:
        atomic_write(pt_path, write_payload)
        faults.strike("save-manifest", step)
        current = manifest_path
        atomic_write(manifest_path, write_manifest)
    except Exception as exc:
        # A payload without a manifest is useless; remove it so it neither wastes the
        # space that just ran out nor triggers "skipped incomplete" warnings later.
        for p in (manifest_path, pt_path):
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            _fsync_dir(ckpt_dir)
        raise CheckpointError(
            f"failed to write checkpoint {current}: {_describe_failure(exc)}"
        ) from exc

    _prune(ckpt_dir, step, keep_last)
    return pt_path


def _remove_orphaned_temps(ckpt_dir: Path) -> None:
    """Delete temp files left by killed writers on this host (their pid is gone)."""
    host = _host_tag()
    for entry in ckpt_dir.iterdir():
        m = _TMP_RE.match(entry.name)
        if m is None or m.group("host") != host:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                entry.unlink()
        except OSError:
            pass  # alive but not ours (EPERM), or unknown: leave it


def _scan(ckpt_dir: Path) -> tuple[set[int], set[int]]:
    """Return (steps with a payload, steps with a manifest)."""
    pts: set[int] = set()
    manifests: set[int] = set()
    if not ckpt_dir.is_dir():
        return pts, manifests
    for entry in ckpt_dir.iterdir():
        if m := _PT_RE.match(entry.name):
            pts.add(int(m.group(1)))
        elif m := _JSON_RE.match(entry.name):
            manifests.add(int(m.group(1)))
    return pts, manifests


def _prune(ckpt_dir: Path, step: int, keep_last: int) -> None:
    pts, manifests = _scan(ckpt_dir)
    complete = sorted(s for s in pts & manifests if s <= step)
    keep = set(complete[-keep_last:]) | {step}
    doomed = sorted(s for s in pts | manifests if s < step and s not in keep)
    failed: list[str] = []
    for s in doomed:
        pt = ckpt_dir / _pt_name(s)
        # Manifest first: a crash mid-prune leaves an "incomplete" payload, never a
        # manifest vouching for a missing file.
        for p in (_manifest_path(pt), pt):
            try:
                p.unlink(missing_ok=True)
            except OSError as exc:
                failed.append(f"{p} ({_describe_failure(exc)})")
    if doomed:
        with contextlib.suppress(OSError):
            _fsync_dir(ckpt_dir)
    if failed:
        warnings.warn(
            f"could not prune old checkpoints: {', '.join(failed)}", CheckpointWarning, stacklevel=3
        )


# --------------------------------------------------------------------- loading


def _verify_manifest(pt_path: Path) -> None:
    manifest_path = _manifest_path(pt_path)
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{pt_path} has no manifest {manifest_path.name} (write interrupted?)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read manifest {manifest_path}: {_describe_failure(exc)}") from exc
    try:
        manifest = json.loads(raw)
        expected_size = int(manifest["size"])
        expected_sha = str(manifest["sha256"]).lower()
        ok = manifest.get("format") == MANIFEST_FORMAT and manifest.get("file") == pt_path.name
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"manifest {manifest_path} is corrupt: {one_line(str(exc), limit=200)}") from exc
    if not ok:
        raise CheckpointError(f"manifest {manifest_path} does not describe {pt_path.name}")
    try:
        actual_size = pt_path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{pt_path} is missing (manifest {manifest_path.name} exists)") from None
    if actual_size != expected_size:
        raise CheckpointError(
            f"{pt_path} is {actual_size} bytes, manifest says {expected_size} (truncated?)"
        )
    actual_sha, _ = _sha256_file(pt_path)
    if actual_sha != expected_sha:
        raise CheckpointError(f"{pt_path} fails its SHA-256 check (corrupted)")


def rejection(pt_path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint ``pt_path`` does not verify (size, SHA-256, manifest), or None if it does.

    A checksum check only, without unpickling: enough to tell a checkpoint the program wrote and
    vouched for from a crash artifact or a damaged file, which callers set aside instead of
    deleting.
    """
    try:
        _verify_manifest(Path(pt_path))
    except CheckpointError as exc:
        return str(exc)
    return None


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
        _verify_manifest(pt_path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {pt_path}: {_describe_failure(exc)}") from exc
    try:
        state = torch.load(pt_path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{pt_path} is not a plain-weights checkpoint (refused by weights_only loading; "
            f"not executed): {_first_line(exc)}"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{pt_path} is unreadable: {_describe_failure(exc)}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{pt_path} holds a {type(state).__name__}, expected a dict")
    return state


def _first_line(exc: BaseException) -> str:
    # torch's weights_only error is a long essay; the useful part is the "Unsupported
    # global" line naming what the file tried to reference.
    text = str(exc)
    for line in text.splitlines():
        if "Unsupported" in line or "GLOBAL" in line:
            return one_line(line, limit=200)
    return one_line(text, limit=200)


def _candidates(ckpt_dir: Path) -> Iterator[Path]:
    pts, manifests = _scan(ckpt_dir)
    for s in sorted(pts | manifests, reverse=True):
        yield ckpt_dir / _pt_name(s)


def find_latest(
    run_dir: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> tuple[tuple[dict[str, Any], Path] | None, list[tuple[Path, str]]]:
    """The newest complete, verified checkpoint (or None), and the newer ones rejected on the way.

    Each rejected checkpoint comes with why (truncated, no manifest, checksum mismatch,
    unreadable archive), in one line that names the file. Nothing is removed or moved: what to do
    with a rejected file is the caller's decision. A file that passes its checksum but is refused
    as not plain-weights raises :class:`UnsafeCheckpointError` (tampering or a bug, not a crash).
    """
    rejected: list[tuple[Path, str]] = []
    for pt_path in _candidates(_ckpt_dir(run_dir)):
        try:
            return (load_checkpoint(pt_path, map_location=map_location), pt_path), rejected
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            rejected.append((pt_path, str(exc)))
    return None, rejected


def latest_checkpoint(
    run_dir: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> tuple[dict[str, Any], Path] | None:
    """Return ``(state, path)`` of the newest complete, verified checkpoint, or None.

    Checkpoints that are incomplete or corrupt (truncated, manifest missing or not
    matching, checksum mismatch, unreadable archive) are skipped with one
    :class:`CheckpointWarning` naming each skipped file and the file used instead: a
    crash during a save must not stop the run from resuming from the previous one.

    A file that passes its checksum but is refused as not plain-weights raises
    :class:`UnsafeCheckpointError` instead: that is tampering or a bug, not a crash,
    and silently resuming from an older checkpoint would hide it.
    """
    found, rejected = find_latest(run_dir, map_location=map_location)
    skipped = "; ".join(f"{path} ({why})" for path, why in rejected)
    if rejected and found is not None:
        warnings.warn(
            f"skipped incomplete/corrupt checkpoint(s) {skipped}; resuming from {found[1]} instead",
            CheckpointWarning,
            stacklevel=2,
        )
    elif rejected:
        warnings.warn(
            f"no usable checkpoint in {_ckpt_dir(run_dir)}: skipped {skipped}",
            CheckpointWarning,
            stacklevel=2,
        )
    return found


def checkpoint_files(run_dir: str | os.PathLike[str], *, temps: bool = False) -> list[Path]:
    """The checkpoint files (payloads and manifests) in ``run_dir``, verified or not, by step.

    With ``temps``, also the hidden temp files of interrupted writes. Never anything under
    ``checkpoints/rejected/`` nor files of other names.
    """
    ckpt_dir = _ckpt_dir(run_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir()
                  if _PT_RE.match(p.name) or _JSON_RE.match(p.name)
                  or (temps and _TMP_RE.match(p.name)))


def set_aside(pt_path: str | os.PathLike[str]) -> list[Path]:
    """Move a rejected checkpoint (payload and manifest, those that exist) into ``rejected/``.

    A run resuming from an older checkpoint will write the same step again; moving the rejected
    files first keeps them (for inspection: a bad copy, tampering, a crash) instead of replacing
    them. An earlier file of the same name there is not replaced either: the newcomer gets a
    numbered name. Returns the new paths.
    """
    pt_path = Path(pt_path)
    rejected = pt_path.parent / REJECTED_SUBDIR
    rejected.mkdir(exist_ok=True)
    sources = [p for p in (pt_path, _manifest_path(pt_path)) if p.exists()]
    n = 0
    while any((rejected / _numbered(p.name, n)).exists() for p in sources):
        n += 1
    moved = []
    for p in sources:
        target = rejected / _numbered(p.name, n)
        os.rename(p, target)
        moved.append(target)
    _fsync_dir(rejected)
    _fsync_dir(pt_path.parent)
    return moved


def _numbered(name: str, n: int) -> str:
    stem, dot, suffix = name.partition(".")
    return name if n == 0 else f"{stem}.{n}{dot}{suffix}"


# --------------------------------------------------------------- compatibility

_MISSING = object()


def _flatten(d: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        # Configs round-tripped through JSON turn tuples into lists; that is not a change.
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        fa, fb = _flatten(a), _flatten(b)
        return fa.keys() == fb.keys() and all(_equal(fa[k], fb[k]) for k in fa)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if (type(a) is bool) != (type(b) is bool):
        return False  # True == 1 in Python, but a flag that became a rank is a change
    try:
        return bool(a == b)
    except Exception:
        return False


def _show(v: Any) -> str:
    return "<absent>" if v is _MISSING else one_line(repr(v), limit=60)


def verify_compatible(
    saved_arch: Mapping[str, Any], current_arch: Mapping[str, Any], what: str = "architecture"
) -> None:
    """Raise :class:`CheckpointError` if two records (e.g. architectures) differ.

    Resuming low-rank weights into a model whose factorization differs fails deep in
    ``load_state_dict`` with shape errors, or worse, silently with a different rank
    schedule; comparing the saved record first gives a message naming the culprit.
    Nested dicts are compared leaf by leaf (keys joined with "."); the first
    few differing keys are named with both values, in the saved record's order.
    """
    saved, current = _flatten(saved_arch), _flatten(current_arch)
    diffs: list[str] = []
    for key in [*saved, *(k for k in current if k not in saved)]:
        a, b = saved.get(key, _MISSING), current.get(key, _MISSING)
        if a is _MISSING or b is _MISSING or not _equal(a, b):
            diffs.append(f"{key}: checkpoint has {_show(a)}, this run has {_show(b)}")
    if diffs:
        more = f"; and {len(diffs) - _MAX_REPORTED} more" if len(diffs) > _MAX_REPORTED else ""
        raise CheckpointError(
            f"{what} mismatch between checkpoint and this run: "
            f"{'; '.join(diffs[:_MAX_REPORTED])}{more}"
        )
