"""Gradient-compression baselines as DDP communication hooks, with byte and time accounting.

Pufferfish claims that training a pre-factorized (low-rank) model with plain all-reduce
beats compressing the gradients of the full model. To test that claim honestly the
baselines must run through the same DDP machinery and report what they put on the wire.
This module provides them as DDP communication hooks, in the style of torch's
``powerSGD_hook.py``: a *state* object (hyperparameters, per-bucket memory, counters)
plus a pure *hook* function ``hook(state, bucket) -> Future[Tensor]``.

It knows nothing about low-rank layers or training loops.

Usage::

    ddp = DistributedDataParallel(model)
    state = register_comm_hook(ddp, "topk", ratio=0.01)
    for batch in loader:
        state.stats.reset()
        loss_fn(ddp(batch)).backward()       # DDP calls the hook once per bucket
        optimizer.step()
        log(state.stats.snapshot())

Hooks (``HOOK_NAMES``)
----------------------
``allreduce``
    DDP's default (torch's ``allreduce_hook``): average of fp32 gradients. The reference.
``fp16``
    torch's ``fp16_compress_hook``: all-reduce in half precision. Halves the bytes; the
    cheapest "compression" to beat. Gradients below ~6e-8 (fp16 subnormal floor after the
    division by world size) flush to zero; use loss scaling if that matters.
``powersgd``
    torch's ``PowerSGDState`` + ``powerSGD_hook`` (Vogels et al., 2019), the strongest
    low-rank *gradient* compressor and the closest competitor to Pufferfish. See
    :class:`PowerSGDHookState` for the tuning guide.
``signum``
    signSGD with majority vote (Bernstein et al., 2019): every worker sends
    ``sign(local momentum)`` packed at 1 bit per element; the result is the elementwise
    majority vote. See :class:`SignumState`.
``topk``
    Top-k sparsification with error feedback (Stich et al., 2018; Lin et al., 2018):
    every worker sends its ``k`` largest-magnitude entries (values + indices); the dense
    average is rebuilt by scatter-add. See :class:`TopKState`.

Byte accounting (:class:`CommStats`)
------------------------------------
``bytes_sent`` counts the *payload* this rank hands to each collective, i.e. the size in
bytes of its input buffer: ``numel * element_size`` for an all-reduce, and this rank's own
contribution (not the gathered output) for an all-gather. It deliberately does NOT include
any algorithm factor, so it is the same number whatever the backend does. What actually
crosses this rank's NIC depends on the collective algorithm; ``ring_bytes`` gives the
textbook ring model for it, applied consistently to every hook:

* all-reduce of ``b`` bytes over ``p`` ranks: each rank sends ``2 (p - 1) / p * b``;
* all-gather of ``b`` bytes per rank: each rank sends ``(p - 1) * b``.

This distinction matters for a fair comparison: all-gather based compressors (signum,
topk) have per-rank traffic that grows linearly with ``p`` while all-reduce traffic does
not, so ``bytes_sent`` flatters them at large ``p``. Compare ``ring_bytes`` across hooks.

Time accounting: ``compress_time`` is host wall time measured with ``time.perf_counter``
around encode/decode work only (never around a wait on a collective); ``hook_time`` is
the latency from hook entry to its result being ready (encode + communication + decode),
summed over buckets, so buckets whose communication overlaps are double counted. On CUDA,
kernels are asynchronous and ``perf_counter`` only sees launch overhead unless the caller
synchronizes; on CPU (gloo) the times are the real compute. For ``fp16`` and ``powersgd``
part of the decoding runs inside torch's callbacks and is only in ``hook_time`` (see
the hooks).

State lifetime and checkpoints
------------------------------
A state serves ONE DDP wrapper; build a new one (``state.fresh()``) for a new wrapper,
e.g. after Pufferfish swaps the warmed-up full-rank model for its factorized version.
``state_dict()`` / ``load_state_dict()`` save and restore the per-bucket memory
(momentum, residual, PowerSGD's error/P/Q/iteration/RNG) as tensors and numbers only.
The memory is keyed by bucket index AND records which parameters each bucket holds,
because DDP re-buckets after the first iteration (and a fresh wrapper around a restored
model starts from its initial bucketing again): memory is moved to follow its
parameters instead of being added to the wrong ones. ``tests/test_comm_hooks.py``
checks that a resumed run is bit-identical to an uninterrupted one.
"""

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_powersgd

# NOTE: no ``from __future__ import annotations`` in this module: DDP's
# ``register_comm_hook`` compares the hook's annotations with the real objects
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``, and string
# annotations would be rejected.

__all__ = [
    "HOOK_NAMES",
    "CommHookState",
    "CommStats",
    "PowerSGDHookState",
    "SignumState",
    "TopKState",
    "allreduce_hook",
    "fp16_hook",
    "make_comm_hook",
    "pack_bits",
    "powersgd_hook",
    "powersgd_payload_numel",
    "register_comm_hook",
    "ring_bytes",
    "signum_hook",
    "topk_count",
    "topk_hook",
    "unpack_bits",
]

HOOK_NAMES: tuple[str, ...] = ("allreduce", "fp16", "powersgd", "signum", "topk")

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


# --------------------------------------------------------------------------- accounting


def ring_bytes(kind: str, payload_bytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective under the ring-algorithm model.

    ``kind`` is ``"allreduce"`` (``2 (p-1)/p * b``) or ``"allgather"`` (``(p-1) * b``, with
    ``b`` this rank's contribution).
    """
    p = world_size
    if kind == "allreduce":
        return 2.0 * (p - 1) / p * payload_bytes
    if kind == "allgather":
        return float((p - 1) * payload_bytes)
    raise ValueError(f"unknown collective kind {kind!r}; expected 'allreduce' or 'allgather'")


class CommStats:
    """Per-step communication counters, accumulated over the buckets of a step.

    DDP calls the hook once per gradient bucket, so a training step is several hook calls;
    the counters simply add up until :meth:`reset` (call it at the start of each step and
    :meth:`snapshot` after ``backward()``). Decode work runs in future callbacks that may
    execute on a backend thread, hence the lock.

    Counters (all for THIS rank):

    ``bytes_sent``
        Payload bytes handed to collectives: all-reduce input size, or this rank's own
        all-gather contribution. No ring factor (see ``ring_bytes``).
    ``ring_bytes``
        Bytes this rank sends under the ring model: ``2(p-1)/p`` times the payload for an
        all-reduce, ``(p-1)`` times for an all-gather.
    ``dense_bytes``
        Bytes plain DDP all-reduce would have sent for the same buckets (bucket numel x
        element size); ``dense_bytes / bytes_sent`` is the compression ratio.
    ``compress_time``
        Seconds (``time.perf_counter``) of encode + decode work, excluding collectives.
    ``hook_time``
        Seconds from hook entry to result ready, summed over buckets (overlap double counts).
    ``comm_calls``
        Number of collectives launched (an empty all-reduce still counts).
    ``buckets``
        Number of hook invocations.
    """

    _FIELDS = (
        "bytes_sent",
        "ring_bytes",
        "dense_bytes",
        "compress_time",
        "hook_time",
        "comm_calls",
        "buckets",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter (start of a step)."""
        with self._lock:
            self.bytes_sent: int = 0
            self.ring_bytes: float = 0.0
            self.dense_bytes: int = 0
            self.compress_time: float = 0.0
            self.hook_time: float = 0.0
            self.comm_calls: int = 0
            self.buckets: int = 0

    def snapshot(self) -> dict[str, float]:
        """Return the counters as a plain dict (safe to log or JSON-dump)."""
        with self._lock:
            return {name: getattr(self, name) for name in self._FIELDS}

    # The methods below are called by the hooks.

    def add_bucket(self, dense_bytes: int) -> None:
        with self._lock:
            self.buckets += 1
            self.dense_bytes += dense_bytes

    def add_collective(self, kind: str, payload_bytes: int, world_size: int) -> None:
        wire = ring_bytes(kind, payload_bytes, world_size)
        with self._lock:
            self.comm_calls += 1
            self.bytes_sent += payload_bytes
            self.ring_bytes += wire

    def add_compress_time(self, seconds: float) -> None:
        with self._lock:
            self.compress_time += seconds

    def add_hook_time(self, seconds: float) -> None:
        with self._lock:
            self.hook_time += seconds

    def __repr__(self) -> str:
        return f"CommStats({self.snapshot()})"


def _finish(
    stats: CommStats, fut: torch.futures.Future[torch.Tensor], t_start: float
) -> torch.futures.Future[torch.Tensor]:
    """Chain a callback that records the hook's end-to-end latency."""

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        value = f.value()  # re-raises a failed collective
        stats.add_hook_time(time.perf_counter() - t_start)
        return value

    return fut.then(done)


# --------------------------------------------------------------------------- states

# A bucket's layout: (parameter key, numel) for each parameter, in bucket order.
Layout = tuple[tuple[int, int], ...]


class CommHookState:
    """State shared by all hooks: the process group and the :class:`CommStats`.

    Used as-is by the stateless hooks (``allreduce``, ``fp16``). Subclasses keep
    per-bucket memory keyed by DDP's bucket index, together with the bucket's *layout*
    (which parameters it holds, in which order) so that the memory follows the
    parameters when DDP re-buckets (see :class:`_BucketMemory`).

    Parameters are identified by their index in ``module.parameters()`` once the state
    is bound with :meth:`bind` (:func:`register_comm_hook` does this); an unbound state
    numbers parameters in order of first appearance in the buckets, which is the same
    across runs of the same model and DDP configuration.

    A state belongs to ONE DDP wrapper. After a model switch (e.g. Pufferfish's vanilla
    warm-up followed by factorization, which builds a new model and a new DDP wrapper)
    use :meth:`fresh` to get a state with the same hyperparameters and empty memory.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.stats = CommStats()
        self._param_keys: dict[int, int] = {}  # id(parameter) -> key
        self._params: list[torch.Tensor] = []  # keeps the ids above valid

    def _options(self) -> dict[str, Any]:
        """Constructor keyword arguments other than the process group (for :meth:`fresh`)."""
        return {}

    def fresh(self) -> Self:
        """A new state with the same process group and hyperparameters, no memory, zero stats."""
        return type(self)(process_group=self.process_group, **self._options())

    def bind(self, module: torch.nn.Module) -> Self:
        """Key parameters by their index in ``module.parameters()`` (robust checkpoints)."""
        self._params = list(module.parameters())
        self._param_keys = {id(p): i for i, p in enumerate(self._params)}
        return self

    def group(self) -> dist.ProcessGroup:
        """The process group to communicate on (the default group when ``None``)."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        assert group is not None, "torch.distributed is not initialized"
        return group

    def _layout(self, bucket: dist.GradBucket) -> Layout:
        keys = self._param_keys
        layout = []
        for p in bucket.parameters():
            key = keys.get(id(p))
            if key is None:
                key = keys[id(p)] = len(self._params)
                self._params.append(p)
            layout.append((key, p.numel()))
        return tuple(layout)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable memory (tensors and numbers only; never the process group)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore memory saved by :meth:`state_dict`."""
        del state_dict


class _BucketMemory:
    """Flat per-bucket buffers (momentum, residual, error, Q) that follow their parameters.

    DDP assigns parameters to buckets once at construction (registration order) and
    again after the first iteration (gradient-ready order, usually the reverse); a new
    DDP wrapper around a restored model starts again from the first assignment. A buffer
    keyed only by bucket index would then be added to the wrong parameters, silently
    when the sizes happen to match. So each buffer records the layout it was built for;
    on a mismatch the new buffer is assembled parameter by parameter from the old ones
    (a one-off copy), and only parameters never seen before start from zero.

    Replaced buffers are kept in ``_retired`` until the end of the step, because a later
    bucket of the same step may need their contents.
    """

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, Layout] = {}
        self._retired: list[tuple[Layout, torch.Tensor]] = []

    def get(self, index: int, layout: Layout, like: torch.Tensor) -> torch.Tensor:
        """The buffer for bucket ``index`` laid out as ``layout``, shaped/typed like ``like``."""
        buf, _ = self.get_with_status(index, layout, like)
        return buf

    def get_with_status(
        self, index: int, layout: Layout, like: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """Like :meth:`get`; also whether every parameter's slice had a previous value."""
        buf = self.buffers.get(index)
        if buf is not None and self.layouts.get(index) == layout and buf.numel() == like.numel():
            if buf.device != like.device or buf.dtype != like.dtype:
                buf = self.buffers[index] = buf.to(device=like.device, dtype=like.dtype)
            return buf, True
        new, complete = self._assemble(layout, like)
        if buf is not None:
            self._retired.append((self.layouts.get(index, ()), buf))
        self.buffers[index] = new
        self.layouts[index] = layout
        return new, complete

    def _assemble(self, layout: Layout, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        new = torch.zeros_like(like)
        if sum(numel for _, numel in layout) != like.numel():
            return new, False  # not a plain concatenation of parameters: cannot remap
        # Newest first: current buffers, then retired ones from the latest replacement on.
        candidates = [(self.layouts.get(i, ()), b) for i, b in self.buffers.items()]
        candidates += reversed(self._retired)
        sources: dict[int, torch.Tensor] = {}
        for old_layout, old in candidates:
            if sum(numel for _, numel in old_layout) != old.numel():
                continue
            offset = 0
            for key, numel in old_layout:
                sources.setdefault(key, old[offset : offset + numel])
                offset += numel
        complete = True
        offset = 0
        for key, numel in layout:
            src = sources.get(key)
            if src is not None and src.numel() == numel:
                new[offset : offset + numel].copy_(src)
            else:
                complete = False
            offset += numel
        return new, complete

    def end_step(self) -> None:
        """Forget replaced buffers (every bucket of the step has been remapped by now)."""
        self._retired.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": _tensor_dict_copy(self.buffers), "layouts": _save_layouts(self.layouts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Mutate in place: PowerSGDHookState shares these dicts with torch's state.
        self.buffers.clear()
        self.buffers.update(_tensor_dict_copy(state_dict["buffers"]))
        self.layouts = _load_layouts(state_dict["layouts"])
        self._retired.clear()


def _tensor_dict_copy(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {int(k): v.detach().clone() for k, v in tensors.items()}


def _save_layouts(layouts: dict[int, Layout]) -> dict[int, torch.Tensor]:
    """Layouts as int64 ``(num_params, 2)`` tensors of ``(key, numel)`` rows."""
    return {i: torch.tensor(lay, dtype=torch.int64).reshape(-1, 2) for i, lay in layouts.items()}


def _load_layouts(saved: dict[int, torch.Tensor]) -> dict[int, Layout]:
    return {int(i): tuple((int(k), int(n)) for k, n in t.tolist()) for i, t in saved.items()}


class PowerSGDHookState(CommHookState):
    r"""Wraps torch's :class:`PowerSGDState`; the hook runs torch's ``powerSGD_hook``.

    Tuning guide (condensed from torch's, which applies unchanged):

    * ``matrix_approximation_rank`` (r): the compression knob. Start at 1 and double
      (1, 2, 4, ...) until accuracy is acceptable; 1-4 is typical. Each compressed
      ``n x m`` gradient (conv kernels are viewed as ``out x (in*kh*kw)``) sends
      ``(n + m) * r`` numbers instead of ``n * m``.
    * ``start_powerSGD_iter``: plain all-reduce before this iteration. Early training is
      sensitive to biased gradients; torch suggests ~10% of total steps, and no less than
      the LR warm-up. The default (torch's, 1000) means a short benchmark may never
      compress -- set it explicitly. Must be > 1 when error feedback or warm start is on,
      because DDP rebuilds its buckets after iteration 1.
    * ``min_compression_rate``: a tensor is compressed only if
      ``(n + m) * r * min_compression_rate < n * m``; others (all 1-D tensors: biases,
      norms) are all-reduced uncompressed in one flat buffer.
    * ``use_error_feedback`` / ``warm_start``: keep both on (accuracy; warm start reuses
      last step's Q so one power iteration per step suffices). Each costs memory: error
      feedback one copy of every bucket, warm start the P and Q buffers.

    Torch keys its memory by bucket index only. Before torch's hook runs, this wrapper
    checks the bucket's layout and, if DDP has re-bucketed (e.g. the first step of a new
    DDP wrapper after restoring a checkpoint), re-assembles the error and warm-start Q
    for the new layout (see :class:`_BucketMemory`); if some Q slice is unknown, P/Q are
    dropped and torch re-initializes them from its RNG, identically on all ranks.

    ``state_dict()`` stores torch's internal memory (``iter``, ``error_dict``,
    ``p_memory_dict``, ``q_memory_dict``), the layouts, the compression counters and the
    NumPy RNG that seeds Q (it must stay identical on all ranks), all as tensors and
    numbers. Torch's own ``__getstate__`` would pickle the RNG object; we avoid non-tensor
    objects so that ``torch.load(weights_only=True)`` works.

    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.batched_powerSGD_hook``
    is not offered: it crashes on CPU in recent torch. 0-d (scalar) parameters are not
    supported by torch's hook.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        super().__init__(process_group)
        self._kwargs = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": use_error_feedback,
            "warm_start": warm_start,
            "orthogonalization_epsilon": orthogonalization_epsilon,
            "random_seed": random_seed,
            "batch_tensors_with_same_shape": batch_tensors_with_same_shape,
        }
        self.powersgd = _torch_powersgd.PowerSGDState(
            process_group=process_group,
            # torch logs a compression summary at this frequency; our CommStats replace it.
            compression_stats_logging_frequency=1 << 62,
            **self._kwargs,
        )
        # Our layout bookkeeping over torch's dicts (the same dict objects).
        self._errors = _BucketMemory()
        self._qs = _BucketMemory()
        self._errors.buffers = self.powersgd.error_dict
        self._qs.buffers = self.powersgd.q_memory_dict
        self._bucket_layouts: dict[int, Layout] = {}

    def _options(self) -> dict[str, Any]:
        return dict(self._kwargs)

    def _q_layout(self, bucket: dist.GradBucket, layout: Layout) -> tuple[Layout, int]:
        """Layout of torch's flat Q memory for this bucket, and the P memory's length.

        Torch groups the compressed tensors by matrix shape (groups in order of first
        appearance, bucket order within a group) and lays out P and Q in that order.
        """
        ps = self.powersgd
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        p_numel = 0
        for (key, _), grad in zip(layout, bucket.gradients()):
            n, m, r = _powersgd_factors(
                grad.shape, ps.matrix_approximation_rank, ps.min_compression_rate
            )
            if r:
                groups.setdefault((n, m), []).append((key, m * r))
                p_numel += n * r
        return tuple(entry for group in groups.values() for entry in group), p_numel

    def _prepare_bucket(self, bucket: dist.GradBucket) -> None:
        """Re-assemble torch's per-bucket memory if this bucket's layout changed."""
        ps = self.powersgd
        index = bucket.index()
        layout = self._layout(bucket)
        if self._bucket_layouts.get(index) != layout:
            buf = bucket.buffer()
            if ps.use_error_feedback:
                self._errors.get(index, layout, buf)
            if ps.warm_start:
                q_layout, p_numel = self._q_layout(bucket, layout)
                like = buf.new_empty(sum(numel for _, numel in q_layout))
                _, complete = self._qs.get_with_status(index, q_layout, like)
                if complete:
                    ps.p_memory_dict[index] = buf.new_empty(p_numel)  # overwritten by P = MQ
                else:
                    # Let torch allocate and draw a fresh random Q, in this layout, from
                    # its RNG (the same draw on every rank).
                    ps.p_memory_dict.pop(index, None)
                    ps.q_memory_dict.pop(index, None)
            self._bucket_layouts[index] = layout
        if bucket.is_last():
            self._errors.end_step()
            self._qs.end_step()

    def state_dict(self) -> dict[str, Any]:
        ps = self.powersgd
        _, keys, pos, has_gauss, cached_gaussian = ps.rng.get_state()
        return {
            "iter": int(ps.iter),
            "error_dict": _tensor_dict_copy(ps.error_dict),
            "p_memory_dict": _tensor_dict_copy(ps.p_memory_dict),
            "q_memory_dict": _tensor_dict_copy(ps.q_memory_dict),
            "error_layouts": _save_layouts(self._errors.layouts),
            "q_layouts": _save_layouts(self._qs.layouts),
            "bucket_layouts": _save_layouts(self._bucket_layouts),
            "total_numel_before_compression": int(ps.total_numel_before_compression),
            "total_numel_after_compression": int(ps.total_numel_after_compression),
            "rng_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "rng_pos": int(pos),
            "rng_has_gauss": int(has_gauss),
            "rng_cached_gaussian": float(cached_gaussian),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ps = self.powersgd
        ps.iter = int(state_dict["iter"])
        self._errors.load_state_dict(
            {"buffers": state_dict["error_dict"], "layouts": state_dict["error_layouts"]}
        )
        self._qs.load_state_dict(
            {"buffers": state_dict["q_memory_dict"], "layouts": state_dict["q_layouts"]}
        )
        ps.p_memory_dict.clear()
        ps.p_memory_dict.update(_tensor_dict_copy(state_dict["p_memory_dict"]))
        self._bucket_layouts = _load_layouts(state_dict["bucket_layouts"])
        ps.total_numel_before_compression = int(state_dict["total_numel_before_compression"])
        ps.total_numel_after_compression = int(state_dict["total_numel_after_compression"])
        ps.rng.set_state(
            (
                "MT19937",
                state_dict["rng_keys"].numpy().astype(np.uint32),
                int(state_dict["rng_pos"]),
                int(state_dict["rng_has_gauss"]),
                float(state_dict["rng_cached_gaussian"]),
            )
        )


class SignumState(CommHookState):
    r"""State of the ``signum`` hook: signSGD with majority vote and worker momentum.

    Each rank keeps, per bucket, ``m <- beta * m + (1 - beta) * g`` (``beta = 0`` gives
    plain signSGD), sends ``sign(m)`` at 1 bit per element (zero counts as ``+1``) through
    an all-gather, and every rank computes the same vote ``sign(sum_r sign_r(m))``.

    The vote REPLACES the averaged gradient: entries are ``+1``, ``-1``, or ``0`` for a
    tie (possible only with an even world size; no consensus -> no move). Gradient scale
    is gone, so the optimizer must be plain SGD (no extra momentum) with a signSGD-sized
    learning rate (typically 1e-4 .. 1e-3, i.e. ~100x smaller than for SGD); weight decay
    still works through the optimizer since it is added after the hook.

    Tuning: ``beta`` 0.9 (the Signum paper's default) is a good start. The 32x payload
    reduction is fixed; what you pay is an all-gather whose per-rank traffic grows as
    ``(p - 1) * n / 8`` bytes (see ``CommStats.ring_bytes``), so it stops beating fp32
    all-reduce (``~2n * 4`` bytes) around ``p ~ 64``.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, beta: float = 0.9) -> None:
        super().__init__(process_group)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self._memory = _BucketMemory()

    @property
    def momentum(self) -> dict[int, torch.Tensor]:
        """Momentum buffers keyed by bucket index (flat, in the bucket's layout)."""
        return self._memory.buffers

    def _options(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def state_dict(self) -> dict[str, Any]:
        sd = self._memory.state_dict()
        return {"momentum": sd["buffers"], "layouts": sd["layouts"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._memory.load_state_dict(
            {"buffers": state_dict["momentum"], "layouts": state_dict["layouts"]}
        )


class TopKState(CommHookState):
    r"""State of the ``topk`` hook: top-k sparsification with error feedback.

    Per bucket of ``n`` elements each rank adds its residual to the gradient, keeps the
    ``k = topk_count(n, ratio)`` largest-magnitude entries, stores the rest as the new
    residual (error feedback: nothing is lost, only delayed), and all-gathers
    ``(values, indices)``. Every rank then rebuilds the same dense average
    ``sum_r scatter(values_r, indices_r) / p``, which replaces the bucket.

    Payload per bucket: ``k * (value bytes + index bytes)``: values in the bucket's dtype
    (4 bytes for fp32), indices int32 (int64 only for buckets of 2**31 elements or more).
    So top-k only beats fp32 all-reduce when ``ratio < 1/2`` even before the all-gather's
    ``(p - 1)`` growth (see ``CommStats.ring_bytes``).

    Tuning: ``ratio`` 0.01 (default) to 0.001 is the usual range; without error
    feedback such ratios diverge, with it they train but may want a short dense warm-up
    (start with ``allreduce`` and switch states). ``ratio = 1.0`` reproduces the exact
    average (a useful correctness check). The residual costs one bucket-sized buffer.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, ratio: float = 0.01) -> None:
        super().__init__(process_group)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._memory = _BucketMemory()

    @property
    def residual(self) -> dict[int, torch.Tensor]:
        """Residual (error-feedback) buffers keyed by bucket index."""
        return self._memory.buffers

    def _options(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def state_dict(self) -> dict[str, Any]:
        sd = self._memory.state_dict()
        return {"residual": sd["buffers"], "layouts": sd["layouts"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._memory.load_state_dict(
            {"buffers": state_dict["residual"], "layouts": state_dict["layouts"]}
        )


# --------------------------------------------------------------------------- bit packing

# Most-significant bit first, like ``numpy.packbits(bitorder="big")``.
_BIT_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_SHIFTS, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (flattened) into ``ceil(numel / 8)`` uint8 bytes, MSB first.

    Same layout as ``numpy.packbits``; the last byte is zero-padded.
    """
    flat = bits.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # Each row holds 8 distinct powers of two, so the uint8 sum cannot overflow.
    return (flat.view(-1, 8) << _shifts(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` along the last dim: ``(..., nbytes)`` -> bool ``(..., numel)``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if numel > 8 * packed.shape[-1]:
        raise ValueError(f"cannot unpack {numel} bits from {packed.shape[-1]} bytes")
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :numel].bool()


# --------------------------------------------------------------------------- helpers


def topk_count(numel: int, ratio: float) -> int:
    """Entries kept per bucket by the ``topk`` hook: ``ceil(ratio * numel)``, clamped to [1, numel]."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def powersgd_payload_numel(
    shapes: Iterable[torch.Size | tuple[int, ...]],
    matrix_approximation_rank: int,
    min_compression_rate: float,
) -> tuple[int, int, int]:
    """Elements PowerSGD all-reduces for one bucket: ``(uncompressed, P, Q)``.

    Mirrors the rule of torch's ``powerSGD_hook``: each gradient is viewed as
    ``n x m`` with ``n = shape[0]``; with ``r = min(n, m, rank)`` it is compressed iff
    ``(n + m) * r * min_compression_rate < n * m``, contributing ``n * r`` to P and
    ``m * r`` to Q; otherwise its ``n * m`` elements go to the uncompressed all-reduce.
    (Checked against torch's ``total_numel_after_compression`` in the tests.)
    """
    uncompressed = p_numel = q_numel = 0
    for shape in shapes:
        n, m, r = _powersgd_factors(shape, matrix_approximation_rank, min_compression_rate)
        if r:
            p_numel += n * r
            q_numel += m * r
        else:
            uncompressed += math.prod(shape)
    return uncompressed, p_numel, q_numel


def _powersgd_factors(
    shape: torch.Size | tuple[int, ...], rank: int, min_compression_rate: float
) -> tuple[int, int, int]:
    """``(n, m, r)`` of torch's PowerSGD for one gradient; ``r = 0`` when not compressed."""
    numel = math.prod(shape)
    if len(shape) == 0 or numel == 0:
        return 0, 0, 0
    n = shape[0]
    m = numel // n
    r = min(n, m, rank)
    return (n, m, r) if (n + m) * r * min_compression_rate < n * m else (n, m, 0)


# --------------------------------------------------------------------------- hooks


def allreduce_hook(
    state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Plain averaging all-reduce (torch's ``allreduce_hook``, i.e. DDP's default).

    Bytes: ``numel * element_size`` of the bucket, one all-reduce. No compression time.
    """
    t_start = time.perf_counter()
    group = state.group()
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    state.stats.add_bucket(nbytes)
    state.stats.add_collective("allreduce", nbytes, group.size())
    return _finish(state.stats, default_hooks.allreduce_hook(group, bucket), t_start)


def fp16_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce in fp16 (torch's ``fp16_compress_hook``).

    Bytes: ``numel * 2`` per bucket, one all-reduce. ``compress_time`` is the synchronous
    part of torch's hook (cast to fp16, divide by world size, launch the async
    all-reduce); the cast back to the bucket dtype happens inside torch's callback and
    is only visible in ``hook_time``.
    """
    t_start = time.perf_counter()
    group = state.group()
    buf = bucket.buffer()
    state.stats.add_bucket(buf.numel() * buf.element_size())
    state.stats.add_collective("allreduce", buf.numel() * 2, group.size())
    fut = default_hooks.fp16_compress_hook(group, bucket)
    state.stats.add_compress_time(time.perf_counter() - t_start)
    return _finish(state.stats, fut, t_start)


def powersgd_hook(
    state: PowerSGDHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (torch's ``powerSGD_hook``) with analytic byte accounting.

    Bytes are computed from the bucket's gradient shapes with the same rule torch uses
    (:func:`powersgd_payload_numel`), before torch's hook runs and advances ``iter``:

    * before ``start_powerSGD_iter``: one all-reduce of the whole bucket
      (``numel * element_size``);
    * afterwards: three all-reduces, of the flat uncompressed tensors, of all Ps and of
      all Qs: ``(uncompressed + P + Q) * element_size`` (the uncompressed all-reduce is
      launched, and counted as a call, even when empty).

    Computing the sizes is exact and cheap; intercepting ``dist.all_reduce`` instead
    would mean patching a process-global function from callbacks on backend threads.

    ``compress_time`` is the synchronous part of torch's hook in the compression phase:
    error feedback, Q initialization/orthogonalization and ``P = M Q``, which is the bulk
    of the encoding. The rest (orthogonalizing P, ``Q = M^T P``, ``M ~ P Q^T``, storing
    the error) runs inside torch's future callbacks interleaved with blocking waits on
    the P/Q all-reduces, so it cannot be separated from communication: it is included in
    ``hook_time`` only, and ``compress_time`` is a LOWER BOUND for this hook.

    On non-NCCL backends (gloo) each compressed bucket is finished before the hook
    returns (see the comment below), so PowerSGD's communication does not overlap the
    rest of backward there; on NCCL torch's asynchrony is kept.
    """
    t_start = time.perf_counter()
    ps = state.powersgd
    group = state.group()
    world = group.size()
    buf = bucket.buffer()
    esize = buf.element_size()
    stats = state.stats
    stats.add_bucket(buf.numel() * esize)
    compressing = ps.iter >= ps.start_powerSGD_iter
    if not compressing:
        stats.add_collective("allreduce", buf.numel() * esize, world)
    else:
        sizes = powersgd_payload_numel(
            (g.shape for g in bucket.gradients()),
            ps.matrix_approximation_rank,
            ps.min_compression_rate,
        )
        for numel in sizes:
            stats.add_collective("allreduce", numel * esize, world)
    t_compress = time.perf_counter()
    if compressing and (ps.use_error_feedback or ps.warm_start):
        state._prepare_bucket(bucket)
    fut = _torch_powersgd.powerSGD_hook(ps, bucket)
    if compressing:
        stats.add_compress_time(time.perf_counter() - t_compress)
        if dist.get_backend(group) != dist.Backend.NCCL:
            # Torch's hook launches the P and Q all-reduces from future callbacks. With
            # gloo those run on backend threads, so with several buckets in flight two
            # ranks can launch their collectives in different orders and deadlock (seen
            # in the tests). Finishing each bucket before DDP launches the next keeps the
            # order, at the cost of overlapping communication with backward. With NCCL
            # the callbacks run in launch order and torch's asynchrony is kept.
            fut.wait()
    return _finish(stats, fut, t_start)


def signum_hook(state: SignumState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Majority vote of ``sign(momentum)``; see :class:`SignumState`.

    Bytes: ``ceil(numel / 8)`` per bucket (this rank's packed signs), one all-gather.
    ``compress_time``: momentum update + sign + packing, and unpacking + vote.
    """
    t_start = time.perf_counter()
    group = state.group()
    world = group.size()
    buf = bucket.buffer()
    numel = buf.numel()
    state.stats.add_bucket(numel * buf.element_size())

    momentum = state._memory.get(bucket.index(), state._layout(bucket), buf)
    if bucket.is_last():
        state._memory.end_step()
    if state.beta == 0.0:
        momentum.copy_(buf)
    else:
        momentum.mul_(state.beta).add_(buf, alpha=1.0 - state.beta)
    packed = pack_bits(momentum >= 0)  # 1 = "+1"; zero momentum votes +1
    state.stats.add_compress_time(time.perf_counter() - t_start)

    gathered = [torch.empty_like(packed) for _ in range(world)]
    state.stats.add_collective("allgather", packed.numel(), world)
    fut = dist.all_gather(gathered, packed, group=group, async_op=True).get_future()

    def decode(f: torch.futures.Future[Any]) -> torch.Tensor:
        f.value()  # re-raise a failed collective
        t0 = time.perf_counter()
        positives = unpack_bits(torch.stack(gathered), numel).sum(dim=0, dtype=torch.int32)
        # sum of +-1 votes = positives - (world - positives); sign() maps ties to 0.
        buf.copy_(torch.sign(2 * positives - world).view_as(buf))
        state.stats.add_compress_time(time.perf_counter() - t0)
        return buf

    return _finish(state.stats, fut.then(decode), t_start)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k with error feedback; see :class:`TopKState`.

    Bytes: ``k * (element_size + index_size)`` per bucket (this rank's values and int32
    indices, sent as one byte buffer), one all-gather; ``k = topk_count(numel, ratio)``.
    ``compress_time``: residual update + top-k selection + packing, and the scatter-add
    reconstruction.
    """
    t_start = time.perf_counter()
    group = state.group()
    world = group.size()
    buf = bucket.buffer()
    numel = buf.numel()
    esize = buf.element_size()
    state.stats.add_bucket(numel * esize)
    k = topk_count(numel, state.ratio)
    index_dtype = _index_dtype(numel)

    # Error feedback: compress (gradient + what we failed to send before); whatever is not
    # sent now stays in the residual.
    residual = state._memory.get(bucket.index(), state._layout(bucket), buf)
    if bucket.is_last():
        state._memory.end_step()
    residual.add_(buf)
    indices = torch.topk(residual.abs(), k, sorted=False).indices
    values = residual[indices]
    residual[indices] = 0
    # One all-gather of raw bytes instead of two (values, indices): half the latency.
    payload = torch.cat([values.view(torch.uint8), indices.to(index_dtype).view(torch.uint8)])
    state.stats.add_compress_time(time.perf_counter() - t_start)

    gathered = [torch.empty_like(payload) for _ in range(world)]
    state.stats.add_collective("allgather", payload.numel(), world)
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()
    value_bytes = k * esize

    def decode(f: torch.futures.Future[Any]) -> torch.Tensor:
        f.value()  # re-raise a failed collective
        t0 = time.perf_counter()
        flat = buf.view(-1)
        flat.zero_()
        for chunk in gathered:  # rank order, so every rank sums identically
            vals = chunk[:value_bytes].view(buf.dtype)
            idx = chunk[value_bytes:].view(index_dtype).long()
            flat.index_add_(0, idx, vals)
        flat.div_(world)
        state.stats.add_compress_time(time.perf_counter() - t0)
        return buf

    return _finish(state.stats, fut.then(decode), t_start)


# --------------------------------------------------------------------------- factory

_REGISTRY: dict[str, tuple[type[CommHookState], CommHook]] = {
    "allreduce": (CommHookState, allreduce_hook),
    "fp16": (CommHookState, fp16_hook),
    "powersgd": (PowerSGDHookState, powersgd_hook),
    "signum": (SignumState, signum_hook),
    "topk": (TopKState, topk_hook),
}


def make_comm_hook(
    name: str, process_group: dist.ProcessGroup | None = None, **options: Any
) -> tuple[CommHookState, CommHook]:
    """Build ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``name`` is one of :data:`HOOK_NAMES`; ``options`` are the state's hyperparameters
    (``allreduce``/``fp16``: none; ``powersgd``: see :class:`PowerSGDHookState`;
    ``signum``: ``beta``; ``topk``: ``ratio``). Unknown options raise ``TypeError``.
    Build a new state for every DDP wrapper (or use ``state.fresh()``).
    """
    try:
        state_cls, hook = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown comm hook {name!r}; expected one of {', '.join(HOOK_NAMES)}"
        ) from None
    return state_cls(process_group=process_group, **options), hook


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    name: str,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> CommHookState:
    """Create the named hook (see :func:`make_comm_hook`), bind its state to the wrapped
    module's parameters (:meth:`CommHookState.bind`), register it on ``ddp_model`` and
    return the state. ``process_group`` defaults to the DDP model's own group.

    DDP accepts one hook per wrapper, registered before the first backward.
    """
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    state, hook = make_comm_hook(name, process_group=process_group, **options)
    state.bind(ddp_model.module)
    ddp_model.register_comm_hook(state, hook)
    return state
