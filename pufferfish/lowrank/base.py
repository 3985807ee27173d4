"""What every low-rank layer promises, and the registry that maps dense types to them.

A low-rank layer is a small wrapper around the factors of one dense module (the PEFT/LoRA shape):
``LowRankX.from_dense(dense, rank, **options)`` builds it by truncated SVD and ``to_dense()``
merges it back. ``factorize`` never special-cases a layer type; it only asks the class registered
for the dense type these questions:

- ``unsupported_reason(dense)``: ``None``, or why this instance cannot be factorized
  (a grouped conv, a bidirectional LSTM, ...), shown in the report;
- ``full_rank(dense)``: the largest meaningful rank;
- ``params_at_rank(dense, rank, **options)``: how many parameters the replacement would hold, so
  the report can say "no parameter saving" before building anything;
- ``rank_from_state_dict(state)``: the ``(rank, options)`` of a layer whose ``state_dict`` is
  ``state``, so that :func:`~pufferfish.load_factorized` can rebuild it on a fresh dense model.

Code that reads a model rather than rewrites it (MAC counting, the report, stable ranks, the
automatic recipe) asks the class too, so that no layer type is special-cased outside its own file;
the defaults fit any layer with one ``weight`` matrix (``nn.Linear``, ``nn.Conv2d``):

- ``dense_matrices(dense)``: the 2-D matrices whose rank the factorization truncates, read for
  stable ranks and spectra (default: ``weight`` reshaped to ``(out, in·…)``);
- ``shape_summary(dense)``: the shape column of the report (default: the weight's shape);
- ``uncounted_macs(dense, args, output)`` and ``counting(module)``: what torch's flop counter
  cannot see in one forward call of a dense instance (``nn.LSTM``'s fused kernel), and a context
  in which a forward pass runs the arithmetic the count should see (defaults: 0, nothing);
- ``kernel_options()``, ``current_kernel()``, ``use_kernel(name)`` (on instances): the names of
  interchangeable implementations of ``forward`` (same function, different cost), which one runs,
  and switching (default: one kernel, ``()``). The automatic recipe times every option on the
  run's shapes and keeps the fastest.

``options`` are the keyword options of ``factorize`` (``extra_bn=...``) passed to every class:
a class takes those it knows and must accept (and ignore) the others, hence ``**options``.

To code that reads a layer rather than calls it, a low-rank layer looks like the dense one: it
mirrors the dense attributes (``in_features``, ``kernel_size``, ...) and, where the dense module
has a ``weight``/``bias``, exposes them as read-only properties computed from the factors (the
merged product: right shape, dtype and device; never a parameter, so never in ``state_dict``).

Third-party code adds a layer type with :func:`register_low_rank` (docs/extending.md); types of
optional libraries (Hugging Face ``Conv1D``) are registered on first sight, without importing the
library (:data:`_LAZY`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Self

import torch
from torch import nn

__all__ = ["LowRankModule", "low_rank_class_for", "register_low_rank"]

_REGISTRY: dict[type[nn.Module], type[LowRankModule]] = {}

# (module, qualified name) of a dense type -> the pufferfish module that registers its low-rank
# class. Imported only when ``factorize`` meets an instance, so the library is already loaded.
_LAZY: dict[tuple[str, str], str] = {
    ("transformers.pytorch_utils", "Conv1D"): "pufferfish.lowrank.hf",
}


class LowRankModule(nn.Module):
    """Base class of the pre-factorized replacements of dense layers.

    Subclasses set ``dense_type`` (the dense class they replace) and, on instances, ``rank``.
    (``rank`` is deliberately not annotated here: TorchScript cannot resolve class annotations
    written as strings, and every low-rank layer must stay scriptable.)
    """

    dense_type: ClassVar[type[nn.Module]]

    @classmethod
    def unsupported_reason(cls, dense: nn.Module) -> str | None:
        return None

    @classmethod
    def full_rank(cls, dense: nn.Module) -> int:
        raise NotImplementedError

    @classmethod
    def params_at_rank(cls, dense: nn.Module, rank: int, **options: object) -> int:
        raise NotImplementedError

    @classmethod
    def from_dense(cls, dense: nn.Module, rank: int, **options: object) -> Self:
        raise NotImplementedError

    @classmethod
    def rank_from_state_dict(cls, state: Mapping[str, torch.Tensor]
                             ) -> tuple[int, dict[str, object]]:
        """``(rank, from_dense options)`` of the layer whose ``state_dict()`` is ``state``.

        Keys are relative to the layer (``"u.weight"``); raise ``KeyError`` when ``state`` does not
        hold this class's factors.
        """
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(left, right)`` 2-D factor pairs whose products are this layer's dense matrices.

        Used by Frobenius decay (penalize ``‖left @ right‖²``) and by spectral diagnostics.
        """
        raise NotImplementedError

    def project_dense_state(self, dense_state: Mapping[str, torch.Tensor]
                            ) -> dict[str, torch.Tensor]:
        """Gradient-like tensors of the dense original (``dense_state``: its parameter names, as
        in :meth:`to_dense`, to e.g. SGD momentum buffers) as tensors for this layer's parameters.

        Each factor pair ``(L, R)`` of a dense matrix ``W = L @ R`` gets the chain rule's
        ``G @ Rᵀ`` and ``Lᵀ @ G`` for the matching ``G``: what the momentum of ``W`` would be had
        it been accumulated on the factors at their current values. A vector (a bias) is carried
        over from the dense tensor of its name, or of its name less one inner component, and its
        shape (``bias`` -> ``u.bias``, ``out_proj.bias`` -> ``out_proj.u.bias``). Parameters
        with no answer are left out (their state starts from zero). Used when an optimizer's
        state is carried across the switch (``switch_momentum``).
        """
        ghost = self.to_dense()
        with torch.no_grad():
            for name, p in ghost.named_parameters():
                if name in dense_state:
                    p.copy_(dense_state[name])
                else:
                    p.zero_()
        targets = type(self).dense_matrices(ghost)
        pairs = self.factor_pairs()
        shapes_match = len(targets) == len(pairs) and all(
            t.shape == (left.shape[0], right.shape[-1]) for t, (left, right) in zip(targets, pairs))
        params = dict(self.named_parameters())
        projected: dict[str, torch.Tensor] = {}
        if shapes_match and pairs:
            with torch.enable_grad():
                total = sum((t.detach() * (left @ right)).sum()
                            for t, (left, right) in zip(targets, pairs))
                grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
            projected = {n: g.detach() for n, g in zip(params, grads) if g is not None}
        for name, p in params.items():
            parts = name.split(".")
            names = {name} | {".".join(parts[:i] + parts[i + 1:]) for i in range(len(parts) - 1)}
            same = [t for n, t in dense_state.items() if n in names and t.shape == p.shape]
            if name not in projected and p.dim() <= 1 and len(same) == 1:
                projected[name] = same[0].detach().clone()
        return projected

    # --- what code that reads a model asks; the defaults fit one-weight layers (Linear, Conv2d)

    @classmethod
    def dense_matrices(cls, dense: nn.Module) -> list[torch.Tensor]:
        """The 2-D matrices of ``dense`` whose rank the factorization truncates.

        Read (never written) for stable ranks and spectra; they share storage with the
        parameters where possible. Default: ``weight`` reshaped to ``(out, in·…)``, the matrix
        :class:`~pufferfish.lowrank.LowRankConv2d` splits.
        """
        weight = getattr(dense, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            return [weight.reshape(weight.shape[0], -1)]
        raise TypeError(f"no weight matrix known for {type(dense).__name__}")

    @classmethod
    def shape_summary(cls, dense: nn.Module) -> str:
        """The shape column of the factorization report. Default: the weight's shape, ``8x3x3x3``."""
        weight = getattr(dense, "weight", None)
        if isinstance(weight, torch.Tensor):
            return "x".join(map(str, weight.shape))
        return "-"

    @classmethod
    def uncounted_macs(cls, dense: nn.Module, args: tuple[Any, ...], output: Any) -> int:
        """MACs of one forward call of ``dense`` that torch's flop counter does not see.

        Added by :func:`~pufferfish.count_macs`; default 0: the counter sees every matmul.
        """
        return 0

    @classmethod
    def counting(cls, module: nn.Module) -> AbstractContextManager[None]:
        """A context in which a forward pass of ``module`` (dense, or of this class) runs the
        arithmetic its MAC count should see; entered by :func:`~pufferfish.count_macs`.

        Default: nothing to change.
        """
        return nullcontext()

    def kernel_options(self) -> tuple[str, ...]:
        """Names of interchangeable implementations of ``forward`` (same function, different
        cost, so worth timing on the run's shapes); ``()`` when there is only one."""
        return ()

    def current_kernel(self) -> str | None:
        """The kernel ``forward`` runs now, one of :meth:`kernel_options` (``None``: only one)."""
        return None

    def use_kernel(self, name: str) -> None:
        """Run kernel ``name`` (one of :meth:`kernel_options`) from now on."""
        allowed = ", ".join(self.kernel_options()) or "none: it has one kernel"
        raise ValueError(f"{type(self).__name__} has no kernel {name!r}: allowed {allowed}")


def register_low_rank(dense_type: type[nn.Module], low_rank_type: type[LowRankModule]) -> None:
    """Make ``factorize`` replace modules of exactly ``dense_type`` by ``low_rank_type``.

    ``low_rank_type`` implements the protocol of :class:`LowRankModule`; docs/extending.md walks
    through a complete example.
    """
    if not (isinstance(low_rank_type, type) and issubclass(low_rank_type, LowRankModule)):
        raise TypeError(f"register_low_rank expects a LowRankModule subclass, got {low_rank_type!r}")
    _REGISTRY[dense_type] = low_rank_type


def low_rank_class_for(module: nn.Module) -> type[LowRankModule] | None:
    """The registered low-rank class for ``module``'s exact type (subclasses may change forward)."""
    return low_rank_class_for_type(type(module))


def low_rank_class_for_type(kind: type) -> type[LowRankModule] | None:
    """The registered low-rank class for the module type ``kind`` exactly."""
    if kind not in _REGISTRY:
        adapter = _LAZY.get((kind.__module__, kind.__qualname__))
        if adapter is not None:
            importlib.import_module(adapter)  # registers the class for ``kind``
    return _REGISTRY.get(kind)
