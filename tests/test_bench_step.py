"""The bench's compute-only steps undo their local update from copies on the CPU
(``pufferfish.bench.step._cpu_copy``): weights, buffers and the optimizer's state come back
exactly, and a module's state-dict version (``_metadata``) survives the copy."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pufferfish.bench.step import _cpu_copy


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 6)).square().mean().backward()
    opt.step()


def test_a_compute_only_step_is_undone_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    saved = _cpu_copy(model.state_dict()), _cpu_copy(opt.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    assert isinstance(saved[0], OrderedDict)
    assert saved[0]._metadata == model.state_dict()._metadata  # BatchNorm's version among them
    _step(model, opt)  # the compute-only step's local update
    assert not torch.equal(model[0].weight, weights["0.weight"])
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), moments, strict=True))
    assert all(s["step"].item() == 1 for s in opt.state.values())
