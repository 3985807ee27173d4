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

One concern per module: ``files.py`` (layout and names), ``atomic.py`` (the one atomic write,
signals held while it writes), ``ranks.py`` (a run's checkpoint from every rank: per-rank states
gathered, rank 0 writes, every rank learns the outcome), ``safety.py`` (what a state may hold), ``manifest.py`` (size + SHA-256, written and verified),
``save.py`` (check, prepare, payload, manifest, prune), ``sharded.py`` (FSDP2: the model and
optimizer as ``torch.distributed.checkpoint`` shards beside the payload, each file's SHA-256 in it),
``load.py`` (verify, then load without
pickles), ``resume.py`` (the newest checkpoint that loads), ``rejected.py`` (set aside, never
deleted), ``compat.py`` (saved records against this run's), ``errors.py``.
"""

from .atomic import atomic_write, atomic_write_text, signals_deferred
from .compat import verify_compatible
from .errors import CheckpointError, CheckpointWarning, UnsafeCheckpointError
from .files import CHECKPOINT_SUBDIR, REJECTED_SUBDIR, checkpoint_files, checkpoint_step
from .load import load_checkpoint
from .manifest import MANIFEST_FORMAT, MANIFEST_VERSION, rejection
from .rejected import set_aside
from .resume import find_latest, latest_checkpoint
from .save import save_checkpoint
from .sharded import load_sharded, save_sharded, verify_sharded

__all__ = [
    "CHECKPOINT_SUBDIR",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "REJECTED_SUBDIR",
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
    "load_sharded",
    "rejection",
    "save_checkpoint",
    "save_sharded",
    "set_aside",
    "signals_deferred",
    "verify_compatible",
    "verify_sharded",
]
