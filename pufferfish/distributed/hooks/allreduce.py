"""The two all-reduce hooks: ``allreduce`` (the fp32 reference) and ``fp16`` (half the bytes).

Both wrap torch's ``default_hooks`` and keep no memory, so they use :class:`CommHookState` as is.
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .accounting import with_hook_time
from .registry import HookFamily, register_hook_family
from .state import CommHookState

__all__ = ["allreduce_hook", "fp16_hook"]


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
    return with_hook_time(state.stats, default_hooks.allreduce_hook(group, bucket), t_start)


def fp16_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce in fp16 (torch's ``fp16_compress_hook``).

    Bytes: ``numel * 2`` per bucket, one all-reduce. ``compress_time`` is the synchronous
    part of torch's hook (cast to fp16, divide by world size, launch the async
    all-reduce); the cast back to the bucket dtype happens inside torch's callback and
    is only visible in ``hook_time``. Gradients below ~6e-8 (fp16 subnormal floor after the
    division by world size) flush to zero; use loss scaling if that matters.
    """
    t_start = time.perf_counter()
    group = state.group()
    buf = bucket.buffer()
    state.stats.add_bucket(buf.numel() * buf.element_size())
    state.stats.add_collective("allreduce", buf.numel() * 2, group.size())
    fut = default_hooks.fp16_compress_hook(group, bucket)
    state.stats.add_compress_time(time.perf_counter() - t_start)
    return with_hook_time(state.stats, fut, t_start)


register_hook_family(HookFamily("allreduce", CommHookState, allreduce_hook))
register_hook_family(HookFamily("fp16", CommHookState, fp16_hook))
