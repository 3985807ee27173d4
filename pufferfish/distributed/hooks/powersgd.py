"""``powersgd``: torch's ``PowerSGDState`` + ``powerSGD_hook`` (Vogels et al., 2019).

The strongest low-rank *gradient* compressor and the closest competitor to Pufferfish. This file
adds what torch lacks: byte accounting, memory that follows re-bucketing, and checkpoints that load
with ``weights_only=True``. See :class:`PowerSGDHookState` for the tuning guide.
"""

import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_powersgd

from .accounting import with_hook_time
from .memory import BucketMemory, Layout, load_layouts, save_layouts, tensor_dict_copy
from .registry import HookFamily, HookOption, register_hook_family
from .state import CommHookState, check_setting, forget_if_nonfinite

__all__ = ["RANK", "START_ITER", "PowerSGDHookState", "powersgd_hook", "powersgd_payload_numel"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


RANK = HookOption(
    "powersgd_rank", "matrix_approximation_rank", int, 4, "an integer >= 1",
    lambda rank: _is_int(rank) and rank >= 1, help="rank of PowerSGD's gradient approximation",
)
START_ITER = HookOption(
    "powersgd_start_iter", "start_powerSGD_iter", int, 10, "an integer >= 0",
    lambda step: _is_int(step) and step >= 0, help="PowerSGD all-reduces plainly before this step",
)


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
      compress -- set it explicitly. Torch asks for > 1 with error feedback or warm start,
      because DDP rebuilds its buckets after iteration 1 (here the memory follows them).
    * ``min_compression_rate``: a tensor is compressed only if
      ``(n + m) * r * min_compression_rate < n * m``; others (all 1-D tensors: biases,
      norms) are all-reduced uncompressed in one flat buffer.
    * ``use_error_feedback`` / ``warm_start``: keep both on (accuracy; warm start reuses
      last step's Q so one power iteration per step suffices). Each costs memory: error
      feedback one copy of every bucket, warm start the P and Q buffers.

    Torch keys its memory by bucket index only. Before torch's hook runs, this wrapper
    checks the bucket's layout and, if DDP has re-bucketed (e.g. the first step of a new
    DDP wrapper after restoring a checkpoint), re-assembles the error and warm-start Q
    for the new layout (see :class:`BucketMemory`); if some Q slice is unknown, P/Q are
    dropped and torch re-initializes them from its RNG, identically on all ranks.

    ``state_dict()`` stores torch's internal memory (``iter``, ``error_dict``,
    ``p_memory_dict``, ``q_memory_dict``), the layouts, the compression counters and the
    NumPy RNG that seeds Q (it must stay identical on all ranks), all as tensors and
    numbers. Torch's own ``__getstate__`` would pickle the RNG object; we avoid non-tensor
    objects so that ``torch.load(weights_only=True)`` works.

    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.batched_powerSGD_hook``
    is not offered: it crashes on CPU in recent torch. 0-d (scalar) parameters, which torch's
    hook cannot view as matrices, go to its plain all-reduce (:class:`_ScalarsAsVectors`).
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
        RANK.check(matrix_approximation_rank, "matrix_approximation_rank")
        START_ITER.check(start_powerSGD_iter, "start_powerSGD_iter")
        check_setting("min_compression_rate", min_compression_rate,
                      isinstance(min_compression_rate, int | float) and min_compression_rate > 0,
                      "a number > 0")
        check_setting("orthogonalization_epsilon", orthogonalization_epsilon,
                      isinstance(orthogonalization_epsilon, int | float)
                      and orthogonalization_epsilon >= 0, "a number >= 0")
        check_setting("random_seed", random_seed, _is_int(random_seed) and 0 <= random_seed < 2**32,
                      "an integer in [0, 2**32)")
        self._kwargs = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": bool(use_error_feedback),
            "warm_start": bool(warm_start),
            "orthogonalization_epsilon": orthogonalization_epsilon,
            "random_seed": random_seed,
            "batch_tensors_with_same_shape": bool(batch_tensors_with_same_shape),
        }
        self.powersgd = _torch_powersgd.PowerSGDState(
            process_group=process_group,
            # torch logs a compression summary at this frequency; our CommStats replace it.
            compression_stats_logging_frequency=1 << 62,
            **self._kwargs,
        )
        # Our layout bookkeeping over torch's dicts (the same dict objects).
        self._errors = BucketMemory()
        self._qs = BucketMemory()
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
        buf = bucket.buffer()
        if self._bucket_layouts.get(index) != layout or self._elsewhere(index, buf):
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

    def _elsewhere(self, index: int, buf: torch.Tensor) -> bool:
        """Whether the bucket's memory is on another device or of another dtype than its
        gradients (a checkpoint's, loaded on the CPU): then it is assembled again, moved."""
        ps = self.powersgd
        held = (d.get(index) for d in (ps.error_dict, ps.p_memory_dict, ps.q_memory_dict))
        return any(t is not None and (t.device != buf.device or t.dtype != buf.dtype)
                   for t in held)

    def forget_bucket(self, index: int) -> None:
        """Zero the bucket's error and let torch draw a fresh Q (identically on every rank)."""
        self._errors.forget(index)
        self._qs.forget(index)
        self.powersgd.p_memory_dict.pop(index, None)
        self._bucket_layouts.pop(index, None)

    def state_dict(self) -> dict[str, Any]:
        ps = self.powersgd
        _, keys, pos, has_gauss, cached_gaussian = ps.rng.get_state()
        return {
            "iter": int(ps.iter),
            "error_dict": tensor_dict_copy(ps.error_dict),
            "p_memory_dict": tensor_dict_copy(ps.p_memory_dict),
            "q_memory_dict": tensor_dict_copy(ps.q_memory_dict),
            "error_layouts": save_layouts(self._errors.layouts),
            "q_layouts": save_layouts(self._qs.layouts),
            "bucket_layouts": save_layouts(self._bucket_layouts),
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
        ps.p_memory_dict.update(tensor_dict_copy(state_dict["p_memory_dict"]))
        self._bucket_layouts = load_layouts(state_dict["bucket_layouts"])
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
    fut = forget_if_nonfinite(state, bucket.index(),
                              _torch_powersgd.powerSGD_hook(ps, _ScalarsAsVectors(bucket)))
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
    return with_hook_time(stats, fut, t_start)


class _ScalarsAsVectors:
    """A DDP bucket whose 0-d gradients read as 1-element vectors, views of the same memory.
    Torch's hook views every gradient as ``shape[0] x rest``, which a scalar parameter (CLIP's
    logit scale, a learned temperature) lacks: an ``IndexError`` at its first compressed step. As
    a 1 x 1 matrix it is never compressed: it joins the plain all-reduce, as
    :func:`powersgd_payload_numel` counts it."""

    def __init__(self, bucket: dist.GradBucket) -> None:
        self._bucket = bucket

    def gradients(self) -> list[torch.Tensor]:
        return [g.view(1) if g.dim() == 0 else g for g in self._bucket.gradients()]

    def __getattr__(self, name: str) -> Any:  # buffer, index, is_last, ...: the bucket's own
        return getattr(self._bucket, name)


register_hook_family(
    HookFamily("powersgd", PowerSGDHookState, powersgd_hook, options=(RANK, START_ITER))
)
