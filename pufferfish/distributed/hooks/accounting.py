"""What a comm hook puts on the wire and how long it takes: :class:`CommStats`.

``bytes_sent`` counts the *payload* this rank hands to each collective, i.e. the size in bytes of
its input buffer: ``numel * element_size`` for an all-reduce, and this rank's own contribution (not
the gathered output) for an all-gather. It deliberately does NOT include any algorithm factor, so it
is the same number whatever the backend does. What actually crosses this rank's NIC depends on the
collective algorithm; ``ring_bytes`` gives the textbook ring model for it, applied consistently to
every hook:

* all-reduce of ``b`` bytes over ``p`` ranks: each rank sends ``2 (p - 1) / p * b``;
* all-gather of ``b`` bytes per rank: each rank sends ``(p - 1) * b``.

This distinction matters for a fair comparison: all-gather based compressors (signum, topk) have
per-rank traffic that grows linearly with ``p`` while all-reduce traffic does not, so
``bytes_sent`` flatters them at large ``p``. Compare ``ring_bytes`` across hooks.

Time accounting: ``compress_time`` is host wall time measured with ``time.perf_counter`` around
encode/decode work only (never around a wait on a collective); ``hook_time`` is the latency from
hook entry to its result being ready (encode + communication + decode), summed over buckets, so
buckets whose communication overlaps are double counted. On CUDA, kernels are asynchronous and
``perf_counter`` only sees launch overhead unless the caller synchronizes; on CPU (gloo) the times
are the real compute. For ``fp16`` and ``powersgd`` part of the decoding runs inside torch's
callbacks and is only in ``hook_time`` (see those hooks).
"""

import threading
import time

import torch

__all__ = ["CommStats", "ring_bytes", "with_hook_time"]


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


def with_hook_time(
    stats: CommStats, fut: torch.futures.Future[torch.Tensor], t_start: float
) -> torch.futures.Future[torch.Tensor]:
    """``fut`` chained with a callback that records the hook's end-to-end latency."""

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        value = f.value()  # re-raises a failed collective
        stats.add_hook_time(time.perf_counter() - t_start)
        return value

    return fut.then(done)
