"""``signum``: signSGD with majority vote (Bernstein et al., 2019), 1 bit per element.

Every worker sends ``sign(local momentum)`` packed at 1 bit per element through an all-gather;
the result is the elementwise majority vote. See :class:`SignumState`.
"""

import time
from typing import Any

import torch
import torch.distributed as dist

from .accounting import with_hook_time
from .bits import pack_bits, unpack_bits
from .memory import BucketMemory
from .registry import HookFamily, HookOption, register_hook_family
from .state import CommHookState

__all__ = ["BETA", "SignumState", "signum_hook"]

BETA = HookOption(
    "signum_beta", "beta", float, 0.9, "0 <= beta < 1", lambda beta: 0 <= beta < 1,
    help="momentum of the signum hook (0: plain signSGD)",
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
        BETA.check(beta, "beta")
        self.beta = float(beta)
        self._memory = BucketMemory()

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
    # A non-finite gradient (a skipped step) must not stay in the momentum: NaN would vote -1
    # on every later step. Its entries restart from zero instead.
    torch.nan_to_num_(momentum, nan=0.0, posinf=0.0, neginf=0.0)
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

    return with_hook_time(state.stats, fut.then(decode), t_start)


register_hook_family(
    HookFamily("signum", SignumState, signum_hook, options=(BETA,), collective="allgather")
)
