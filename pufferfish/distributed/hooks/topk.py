"""``topk``: top-k sparsification with error feedback (Stich et al., 2018; Lin et al., 2018).

Every worker sends its ``k`` largest-magnitude entries (values + indices) through an all-gather;
the dense average is rebuilt by scatter-add. See :class:`TopKState`.
"""

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from .accounting import with_hook_time
from .memory import BucketMemory
from .registry import HookFamily, HookOption, register_hook_family
from .state import CommHookState, forget_if_nonfinite

__all__ = ["RATIO", "TopKState", "topk_count", "topk_hook"]

RATIO = HookOption(
    "topk_ratio", "ratio", float, 0.01, "0 < ratio <= 1", lambda ratio: 0 < ratio <= 1,
    help="fraction of each bucket's entries the topk hook sends",
)


def topk_count(numel: int, ratio: float) -> int:
    """Entries kept per bucket by the ``topk`` hook: ``ceil(ratio * numel)``, clamped to [1, numel]."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


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
        RATIO.check(ratio, "ratio")
        self.ratio = float(ratio)
        self._memory = BucketMemory()

    @property
    def residual(self) -> dict[int, torch.Tensor]:
        """Residual (error-feedback) buffers keyed by bucket index."""
        return self._memory.buffers

    def _options(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def forget_bucket(self, index: int) -> None:
        self._memory.forget(index)

    def state_dict(self) -> dict[str, Any]:
        sd = self._memory.state_dict()
        return {"residual": sd["buffers"], "layouts": sd["layouts"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._memory.load_state_dict(
            {"buffers": state_dict["residual"], "layouts": state_dict["layouts"]}
        )


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

    return with_hook_time(state.stats, forget_if_nonfinite(state, bucket.index(), fut.then(decode)),
                          t_start)


register_hook_family(
    HookFamily("topk", TopKState, topk_hook, options=(RATIO,), collective="allgather")
)
