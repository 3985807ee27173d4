"""The switch's one owner and the run's stateful components, without a training run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pufferfish as pf
from pufferfish import modes
from pufferfish.config import ConfigError, TrainConfig
from pufferfish.lowrank import LowRankModule
from pufferfish.method import PufferfishMethod
from pufferfish.training.methods import Method, build_method, method_names, register_method
from pufferfish.training.step import EpochMeter, Replica, train_step


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def test_method_state_rebuilds_the_switched_architecture() -> None:
    cfg = TrainConfig(mode="pufferfish", warmup_epochs="1", rank_ratio="0.25", preset="none",
                      keep=["0"])
    x = torch.randn(2, 32)
    method, model = build_method(cfg), mlp()
    assert isinstance(method, PufferfishMethod)
    method.setup(model, x, cfg)
    assert method.on_epoch_start(0, model) is None  # still warming up
    change = method.on_epoch_start(1, model)
    assert change is not None and change.name == "factorization"
    state = method.state_dict()
    assert state["switched_at"] == 1 and set(state["ranks"]) == {"2", "4"}

    again, fresh = build_method(cfg), mlp()
    again.setup(fresh, x, cfg)
    again.load_state_dict(state, fresh)  # before the weights: the architecture they need
    fresh.load_state_dict(model.state_dict())  # strict: every factor key fits
    assert again.state_dict() == state
    assert torch.equal(fresh(x), model(x))
    assert again.on_epoch_start(2, fresh) is None  # no second switch
    assert sorted(n for n, m in fresh.named_modules() if isinstance(m, LowRankModule)) == ["2", "4"]


def test_recipe_is_a_facade_over_the_same_switch() -> None:
    recipe = pf.Recipe(warmup_epochs=0, rank_ratio=0.25, keep=["0"])
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe.on_epoch_start(0, model, opt)
    owner = recipe.switch_owner
    assert recipe.switched_at == owner.policy.switched_at == 0
    assert recipe.report is owner.plan.report and recipe.state_dict() == owner.state_dict()
    assert recipe.state_dict()["ranks"] == recipe.report.ranks


def test_registry_builds_every_mode_and_names_them_on_bad_input() -> None:
    assert method_names() == ["full", "pufferfish", "lowrank", "lth", "prune", "galore"]
    for mode in method_names():
        assert build_method(TrainConfig(mode=mode)).name in (mode, "pufferfish")
    cfg = TrainConfig(mode="full")
    cfg.mode = "nope"  # past the config's own check: the registry's error
    try:
        build_method(cfg)
    except ValueError as e:
        assert str(e) == ("mode 'nope' is invalid: allowed full, pufferfish, lowrank, lth, "
                          "prune, galore")
    else:
        raise AssertionError("no error for an unknown mode")


def test_a_registered_method_is_a_valid_mode_of_the_configuration() -> None:
    with pytest.raises(ConfigError, match=r"mode 'mine' is invalid: allowed full, .*galore$"):
        TrainConfig(mode="mine")

    class Mine(Method):
        name = "mine"

    register_method("mine", lambda cfg: Mine())
    try:
        assert isinstance(build_method(TrainConfig(mode="mine")), Mine)
    finally:
        modes._REGISTERED.pop("mine")


def test_training_imports_nothing_of_low_rank() -> None:
    code = ("import sys, pufferfish.training.loop, pufferfish.training.step; "
            "bad = sorted(m for m in sys.modules if m.startswith(('pufferfish.lowrank', "
            "'pufferfish.auto', 'pufferfish.switch', 'pufferfish.recipe', 'pufferfish.method'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    # pufferfish/__init__ imports the public API (lowrank, recipe): an empty package stands in.
    package = str(Path(__file__).resolve().parents[1] / "pufferfish")
    stub = ("import sys, types; sys.modules['pufferfish'] = types.ModuleType('pufferfish'); "
            f"sys.modules['pufferfish'].__path__ = [{package!r}]; ")
    result = subprocess.run([sys.executable, "-c", stub + code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_skipped_step_changes_nothing_and_the_meter_counts_it() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replica = Replica(model, model, opt)
    x, y = torch.randn(4, 32), torch.tensor([0, 1, 2, 3])
    before = [p.detach().clone() for p in model.parameters()]
    meter = EpochMeter()
    loss, bad = train_step(replica, lambda: nn.functional.cross_entropy(model(x), y),
                           vote=lambda loss: "loss")
    meter.step_done(loss, applied=bad is None)
    assert bad == "loss" and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    loss, bad = train_step(replica, lambda: nn.functional.cross_entropy(model(x), y))
    meter.step_done(loss, applied=bad is None)
    assert bad is None and not torch.equal(before[0], model[0].weight)
    saved = meter.state_dict()
    assert (saved["n_steps"], saved["skipped"]) == (1, 1)
    assert saved["loss_sum"] == loss.item()
    resumed = EpochMeter()
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved


def test_train_help_shows_every_default_as_it_would_be_typed(capsys: pytest.CaptureFixture) -> None:
    from pufferfish.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "MISSING" not in text and "object at 0x" not in text
    assert "comma-separated (default: '0.5,0.75')" in text
    assert "--keep LIST extra globs of layers kept full-rank, or auto;" in text
    assert "--epochs INT passes over the training data (default: 10)" in text
    assert "--warmup-epochs STR full-rank epochs before the switch: N, P% of the epochs, or " \
           "auto (default: '10%')" in text


@pytest.mark.parametrize("switch_momentum", ["reset", "project"])
def test_switch_momentum_resets_or_projects_the_optimizer_state(switch_momentum: str) -> None:
    cfg = TrainConfig(mode="pufferfish", warmup_epochs="1", rank_ratio="0.25", preset="none",
                      keep=["0"], switch_momentum=switch_momentum)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    method, model = build_method(cfg), mlp()
    method.setup(model, x, cfg)
    old = torch.optim.SGD(method.param_groups(model, cfg), lr=0.1, momentum=0.9)
    for _ in range(3):
        old.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        old.step()
    before = dict(model.named_parameters(remove_duplicate=False))
    assert method.on_epoch_start(1, model) is not None
    new = torch.optim.SGD(method.param_groups(model, cfg), lr=0.1, momentum=0.9)
    method.carry_state(old, new, before, model)
    if switch_momentum == "reset":  # the paper: every parameter starts from zero momentum
        assert not new.state
        return
    params = dict(model.named_parameters())
    assert len(new.state) == len(params)  # every parameter has momentum, factors included
    torch.testing.assert_close(new.state[params["0.weight"]]["momentum_buffer"],
                               old.state[before["0.weight"]]["momentum_buffer"])  # kept layer
    m = old.state[before["2.weight"]]["momentum_buffer"]  # the dense momentum, projected
    u, v = params["2.u.weight"], params["2.v.weight"]
    torch.testing.assert_close(new.state[u]["momentum_buffer"], m @ v.detach().T)
    torch.testing.assert_close(new.state[v]["momentum_buffer"], u.detach().T @ m)
    torch.testing.assert_close(new.state[params["2.u.bias"]]["momentum_buffer"],
                               old.state[before["2.bias"]]["momentum_buffer"])


def test_switch_momentum_allows_auto_reset_or_project() -> None:
    with pytest.raises(ConfigError, match=r"^switch_momentum 'keep' is invalid: allowed auto, "
                                          r"reset, project$"):
        TrainConfig(switch_momentum="keep")


def test_recipe_projects_sgd_momentum_onto_the_factors_of_the_users_optimizer() -> None:
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    dense = optimizer.state[model[2].weight]["momentum_buffer"].clone()
    kept = optimizer.state[model[0].weight]["momentum_buffer"].clone()
    recipe = pf.Recipe(warmup_epochs=1, keep=["0"], switch_momentum="project")
    model, same, _ = recipe.on_epoch_start(1, model, optimizer)
    assert same is optimizer
    u, v = model[2].u.weight, model[2].v.weight
    torch.testing.assert_close(optimizer.state[u]["momentum_buffer"], dense @ v.detach().T)
    torch.testing.assert_close(optimizer.state[v]["momentum_buffer"], u.detach().T @ dense)
    torch.testing.assert_close(optimizer.state[model[0].weight]["momentum_buffer"], kept)
    optimizer.step()  # SGD takes the carried buffers as they are
    with pytest.raises(ValueError, match=r"^switch_momentum 'keep' is invalid: allowed 'reset', "
                                         r"'project' or 'auto' \(= 'reset'\)$"):
        pf.Recipe(switch_momentum="keep")
