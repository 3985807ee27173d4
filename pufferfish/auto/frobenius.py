"""Frobenius decay (Khodak et al., ICLR 2021): weight decay on the product of the factors."""

from __future__ import annotations

import torch
from torch import nn

from ..lowrank.base import LowRankModule

__all__ = ["frobenius_decay", "frobenius_decay_params"]


def frobenius_decay(model: nn.Module, coeff: float) -> torch.Tensor:
    """``coeff/2 · Σ ‖U V‖²_F`` over the factor pairs of every low-rank layer of ``model``.

    Why (Khodak et al., ICLR 2021): plain weight decay on the factors penalizes
    ``‖U‖²_F + ‖V‖²_F``, which depends on how the product is split between them and, at the
    minimum over splits, equals ``2‖UV‖_*``: it pushes the *nuclear norm* of the product down,
    shrinking the rank further during training. Penalizing the product, ``‖UV‖²_F``, is exactly
    what weight decay did on the dense layer. Add the returned scalar to the loss and remove the
    factors (:func:`frobenius_decay_params`) from the optimizer's weight decay.

    Scaling: ``coeff/2`` (not ``coeff``), so that ``coeff`` means what an optimizer's
    ``weight_decay`` means: the gradient of ``coeff/2 ‖W‖²`` is ``coeff · W``. Here
    ``∂/∂U = coeff · (UV) Vᵀ`` and ``∂/∂V = coeff · Uᵀ (UV)``; reuse the dense model's weight decay
    (e.g. 1e-4 for ResNet on CIFAR) as a starting point.

    Cost: ``‖UV‖²_F = tr((UᵀU)(VVᵀ))`` uses two ``r x r`` Gram matrices (``O((m+n)r²)``), never
    the ``m x n`` product. An extra BatchNorm between conv factors is not part of the product.
    A shared module counts once. With no low-rank layer, the result is a zero scalar.
    """
    terms: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, LowRankModule):
            for left, right in module.factor_pairs():
                # both Gram matrices are symmetric, so tr(A B) = Σ_ij A_ij B_ij
                terms.append((left.mT @ left * (right @ right.mT)).sum())
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    return torch.stack(terms).sum() * (coeff / 2)


def frobenius_decay_params(model: nn.Module) -> list[nn.Parameter]:
    """The factor weights of every low-rank layer: exclude them from plain weight decay.

    These are the parameters behind ``factor_pairs()`` (``u``/``v`` weights, LSTM ``u_*``/``v_*``);
    biases and extra BatchNorm parameters are not factors and keep the caller's treatment.
    Typical use::

        factors = {id(p) for p in frobenius_decay_params(model)}
        groups = [{"params": [p for p in model.parameters() if id(p) not in factors]},
                  {"params": [p for p in model.parameters() if id(p) in factors],
                   "weight_decay": 0.0}]
        loss = criterion(out, y) + frobenius_decay(model, coeff=wd)
    """
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if not isinstance(module, LowRankModule):
            continue
        params = list(module.parameters())
        for pair in module.factor_pairs():
            for t in pair:
                p = _owner(t, params)
                if p is None:
                    raise RuntimeError(f"a factor of {type(module).__name__} is not a view of one "
                                       "of its parameters")
                found[id(p)] = p
    return list(found.values())


def _owner(t: torch.Tensor, params: list[nn.Parameter]) -> nn.Parameter | None:
    """The parameter ``t`` is, is a view of, or (``t`` a reshaped copy: a channels-last conv
    weight flattened to a matrix) was computed from alone, as autograd sees it."""
    for p in params:
        if t is p:
            return p
    start = t.data_ptr()
    for p in params:
        same = p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        if same and p.data_ptr() <= start < p.data_ptr() + p.numel() * p.element_size():
            return p
    trainable = [p for p in params if p.requires_grad]
    if t.grad_fn is None or not trainable:
        return None
    with torch.enable_grad():
        grads = torch.autograd.grad(t.sum(), trainable, allow_unused=True, retain_graph=True)
    sources = [p for p, g in zip(trainable, grads) if g is not None]
    return sources[0] if len(sources) == 1 else None
