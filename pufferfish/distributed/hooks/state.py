"""The base of every hook state: process group, :class:`CommStats`, parameter keys, fresh copies."""

from typing import Any, Self

import torch
import torch.distributed as dist

from .accounting import CommStats
from .memory import Layout

__all__ = ["CommHookState", "check_setting", "forget_if_nonfinite"]


def check_setting(name: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise a one-line ``ValueError`` naming ``name``/``value`` and what is allowed unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} {value!r} is invalid: allowed {allowed}")


class CommHookState:
    """State shared by all hooks: the process group and the :class:`CommStats`.

    Used as-is by the stateless hooks (``allreduce``, ``fp16``). Subclasses validate their
    settings in ``__init__`` (one-line ``ValueError``), return them from :meth:`_options` (for
    :meth:`fresh`) and save their per-bucket memory with ``state_dict``/``load_state_dict``.
    That memory is keyed by DDP's bucket index together with the bucket's *layout* (which
    parameters it holds, in which order) so that it follows the parameters when DDP re-buckets
    (see :class:`~pufferfish.distributed.hooks.memory.BucketMemory`).

    Parameters are identified by their index in ``module.parameters()`` once the state is bound
    with :meth:`bind` (``register_comm_hook`` does this); an unbound state numbers parameters in
    order of first appearance in the buckets, which is the same across runs of the same model and
    DDP configuration.

    A state belongs to ONE DDP wrapper. After a model switch (e.g. Pufferfish's vanilla warm-up
    followed by factorization, which builds a new model and a new DDP wrapper) use :meth:`fresh`
    to get a state with the same hyperparameters and empty memory.
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

    def forget_bucket(self, index: int) -> None:
        """Drop bucket ``index``'s memory (see :func:`forget_if_nonfinite`); stateless: nothing."""
        del index

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable memory (tensors and numbers only; never the process group)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore memory saved by :meth:`state_dict`."""
        del state_dict


def forget_if_nonfinite(
    state: CommHookState, index: int, fut: torch.futures.Future[torch.Tensor]
) -> torch.futures.Future[torch.Tensor]:
    """``fut`` that, when bucket ``index`` comes back non-finite, first drops its memory.

    A non-finite reduced gradient (an fp16 loss-scale overflow under ``GradScaler``, a NaN under
    ``--nonfinite skip``) makes the step be skipped, but error feedback or warm start would keep
    it: every later step would be non-finite too and training would silently stop (PowerSGD
    under CUDA autocast did, on the H200). The reduced bucket is the same on every rank, so every
    rank drops the same memory. Costs one device sync per bucket.
    """
    def check(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        out = f.value()
        if not bool(torch.isfinite(out).all()):
            state.forget_bucket(index)
        return out

    return fut.then(check)
