"""One schedule, one carry: ``pufferfish train``'s method, ``Recipe`` and the trainer callbacks'
core switch at the same step and leave the optimizer the same state (pufferfish/switch/schedule.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pufferfish as pf
from pufferfish.config import TrainConfig
from pufferfish.integrations.core import TrainerSwitch
from pufferfish.method import PufferfishMethod
from pufferfish.switch import SwitchSchedule

STEPS = 4  # optimizer steps per epoch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(STEPS)]


def config(optimizer: str, momentum: str, **given: Any) -> TrainConfig:
    return TrainConfig(mode="pufferfish", epochs=3, rank_ratio="0.25", preset="none", keep=["0"],
                       optimizer=optimizer, switch_momentum=momentum, lr=0.01, momentum=0.9,
                       weight_decay=1e-4, **given)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    optimizer.step()


def by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """Each of ``model``'s parameters: its group's settings and its optimizer state, by name."""
    group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return {n: ({k: v for k, v in group[id(p)].items() if k in ("lr", "weight_decay")},
                dict(optimizer.state.get(p, {})))
            for n, p in model.named_parameters()}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name  # the same group settings
        assert a[name][1].keys() == b[name][1].keys(), name
        for key, value in a[name][1].items():
            torch.testing.assert_close(b[name][1][key], value, msg=f"{name} {key}")


class CliMethod:
    """``PufferfishMethod`` as the training loop drives it: at a change, a fresh optimizer from
    ``build_optimizer`` that inherits what ``carry_state`` gives it (training/build.rebuild)."""

    def __init__(self, cfg: TrainConfig, model: nn.Module) -> None:
        self.cfg, self.model, self.switched_at = cfg, model, None
        self.method = PufferfishMethod(cfg)
        self.method.setup(model, batches()[0][0], cfg)
        self.optimizer = self.method.build_optimizer(model, cfg)

    def before_step(self, epoch: int, i: int) -> None:
        before = dict(self.model.named_parameters(remove_duplicate=False))
        change = (self.method.on_epoch_start(epoch, self.model) if i == 0 else None) \
            or self.method.on_step_start(epoch, i, STEPS, self.model)
        if change is not None:
            fresh = self.method.build_optimizer(self.model, self.cfg)
            self.method.carry_state(self.optimizer, fresh, before, self.model)
            self.optimizer, self.switched_at = fresh, epoch * STEPS + i


@pytest.mark.parametrize("momentum", ["reset", "project", "auto"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_cli_method_and_recipe_switch_alike(optimizer: str, momentum: str) -> None:
    """Warm-up of 1 epoch: the same switch step, then the same state in every parameter (reset,
    auto: all empty, survivors too; project: survivors kept, factors projected), and after
    more training the same weights and state."""
    cfg = config(optimizer, momentum, warmup_epochs="1")
    cli = CliMethod(cfg, mlp())
    model = mlp()
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio=0.25, preset=None, keep=["0"],
                       switch_momentum=momentum)
    user = cli.method.build_optimizer(model, cfg)  # the same groups and hyperparameters
    switched_at = None
    for epoch in range(cfg.epochs):
        cli.before_step(epoch, 0)
        model, user, _ = recipe.on_epoch_start(epoch, model, user)
        if recipe.switched and switched_at is None:
            switched_at = epoch * STEPS
            carried = by_name(user, model)
            assert_same(by_name(cli.optimizer, cli.model), carried)
            survivor = carried["0.weight"][1]
            assert (survivor != {}) == (momentum == "project")
        for i, batch in enumerate(batches()):
            if i:
                cli.before_step(epoch, i)
            step(cli.model, cli.optimizer, batch)
            step(model, user, batch)
    assert cli.switched_at == switched_at == recipe.switched_at * STEPS == STEPS
    assert_same(by_name(cli.optimizer, cli.model), by_name(user, model))
    for (name, a), (_, b) in zip(cli.model.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize(("optimizer", "momentum"), [("adamw", "reset"), ("sgd", "project")])
def test_cli_method_and_trainer_callback_switch_alike_in_steps(optimizer: str,
                                                               momentum: str) -> None:
    """``warmup_steps=6``: mid-epoch, before the same global step in the loop's method and in the
    trainer callbacks' core, with the same optimizer state after it."""
    cfg = config(optimizer, momentum, warmup_steps=6)
    cli = CliMethod(cfg, mlp())
    model = mlp()
    callback = TrainerSwitch(warmup_steps=6, verbose=False, rank_ratio=0.25, preset=None,
                             keep=["0"], switch_momentum=momentum)
    callback.start(model, 0.0, resumed=False)
    user = cli.method.build_optimizer(model, cfg)
    for epoch in range(2):
        for i, batch in enumerate(batches()):
            cli.before_step(epoch, i)
            if callback.due_at_step(epoch * STEPS + i):
                callback.switch(epoch, epoch * STEPS + i, model, [user], None)
                assert_same(by_name(cli.optimizer, cli.model), by_name(user, model))
            step(cli.model, cli.optimizer, batch)
            step(model, user, batch)
    assert cli.switched_at == callback.switched_at_step == 6
    assert_same(by_name(cli.optimizer, cli.model), by_name(user, model))


@pytest.mark.parametrize(("given", "steps", "at"), [
    ({"warmup_epochs": "2"}, 10, 20),  # before epoch 2
    ({"warmup_epochs": "20%", "epochs": 10}, 10, 20),  # 20% of 10 epochs: epoch 2
    ({"warmup_epochs": "20%", "epochs": 1}, 50, 10),  # a 1-epoch run: 20% of its steps
    ({"warmup_steps": 7}, 10, 7),
    ({"warmup_steps": 0.25}, 10, 8),  # a quarter of 3 x 10 steps, rounded
    ({"warmup_steps": 7, "sync": "diloco", "inner_steps": 4}, 10, 8),  # the next outer step
    ({"warmup_steps": 17, "sync": "diloco", "inner_steps": 4}, 10, 20),  # or an epoch's start
])
def test_the_switch_step_of_every_form(given: dict, steps: int, at: int) -> None:
    schedule = SwitchSchedule.from_config(TrainConfig(**{"epochs": 3, **given}))
    assert schedule.switch_step(steps) == at
    assert not schedule.due_at_step(at - 1, steps) or not schedule.in_steps
    assert schedule.due_at_step(at, steps) == schedule.in_steps


def test_auto_is_bounded_and_observed_as_configured() -> None:
    auto = SwitchSchedule.from_config(TrainConfig(epochs=8, warmup_epochs="auto"))
    assert auto.auto and auto.switch_step(39) is None  # the detector decides
    assert (auto.auto_cap(39), auto.latest_auto_epoch, auto.observe_every(39)) == (4, 4, 9)
    every = SwitchSchedule.from_config(TrainConfig(epochs=8, warmup_epochs="auto",
                                                   stable_rank_every_steps=5))
    assert every.observe_every(39) == 5
    assert SwitchSchedule(warmup="auto").auto_cap(39) is None  # Recipe: no run length, no cap


def test_carry_refuses_an_unknown_meaning() -> None:
    with pytest.raises(ValueError, match=r"^switch_momentum 'keep' is invalid: allowed auto, "
                                         r"reset, project$"):
        pf.switch.carry_state({}, {}, mlp(), "keep")


def test_the_schedule_answers_when_and_what_adam_carries_in_its_docstring() -> None:
    doc = pf.switch.schedule.__doc__ or ""
    for words in ("optimizer steps", "warmup_steps", "DiLoCo", '"auto"', "switch_lr_warmup",
                  '"reset"', '"project"', "Adam moments", "step count"):
        assert words in doc, words
