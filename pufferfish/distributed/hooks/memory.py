"""Per-bucket memory (momentum, residual, error, Q) that follows its parameters when DDP re-buckets.

DDP assigns parameters to buckets once at construction (registration order) and again after the
first iteration (gradient-ready order, usually the reverse); a new DDP wrapper around a restored
model starts again from the first assignment. A buffer keyed only by bucket index would then be
added to the wrong parameters, silently when the sizes happen to match. So each buffer records the
*layout* it was built for; on a mismatch the new buffer is assembled parameter by parameter from
the old ones, and only parameters never seen before start from zero.
"""

from typing import Any

import torch

__all__ = ["BucketMemory", "Layout", "load_layouts", "save_layouts", "tensor_dict_copy"]

# A bucket's layout: (parameter key, numel) for each parameter, in bucket order.
Layout = tuple[tuple[int, int], ...]


class BucketMemory:
    """Flat per-bucket buffers keyed by bucket index, each with the layout it was built for.

    On a layout mismatch the buffer is re-assembled from the old buffers (a one-off copy).
    Replaced buffers are kept in ``_retired`` until the end of the step (:meth:`end_step`),
    because a later bucket of the same step may need their contents.
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

    def forget(self, index: int) -> None:
        """Drop bucket ``index``'s buffer: its next :meth:`get` starts it from zero."""
        self.buffers.pop(index, None)
        self.layouts.pop(index, None)

    def end_step(self) -> None:
        """Forget replaced buffers (every bucket of the step has been remapped by now)."""
        self._retired.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": tensor_dict_copy(self.buffers), "layouts": save_layouts(self.layouts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Mutate in place: PowerSGDHookState shares these dicts with torch's state.
        self.buffers.clear()
        self.buffers.update(tensor_dict_copy(state_dict["buffers"]))
        self.layouts = load_layouts(state_dict["layouts"])
        self._retired.clear()


def tensor_dict_copy(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Detached clones keyed by int (a checkpoint must not alias live memory)."""
    return {int(k): v.detach().clone() for k, v in tensors.items()}


def save_layouts(layouts: dict[int, Layout]) -> dict[int, torch.Tensor]:
    """Layouts as int64 ``(num_params, 2)`` tensors of ``(key, numel)`` rows."""
    return {i: torch.tensor(lay, dtype=torch.int64).reshape(-1, 2) for i, lay in layouts.items()}


def load_layouts(saved: dict[int, torch.Tensor]) -> dict[int, Layout]:
    """Inverse of :func:`save_layouts`."""
    return {int(i): tuple((int(k), int(n)) for k, n in t.tolist()) for i, t in saved.items()}
