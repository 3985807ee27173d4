"""A model is a spec: a tiny MLP registered from this file trains, switches, resumes and benches
through the CLI like a built-in model (``pufferfish.models.spec``).

Registered by name (``register_model``) it trains in this process; named as
``THIS_FILE.py:TINY_MLP`` it reaches fresh processes too: a training run killed mid-epoch and
resumed, and the bench's workers, each load this file themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pufferfish import factorize
from pufferfish.cli import main
from pufferfish.configfile import load_config
from pufferfish.models import ModelSpec, build_at_width, get_spec, model_names, register_model
from pufferfish.models import spec as spec_module
from pufferfish.training.checkpoint import latest_checkpoint

try:  # the test helpers; absent where a bench worker or a run loads this file for TINY_MLP
    from helpers import cli, metrics, needs_fashion, run_cli
except ImportError:  # pragma: no cover - a worker needs only the spec below
    needs_fashion = pytest.mark.skip(reason="loaded as a model file")


class TinyMLP(nn.Module):
    """Images -> flattened -> two hidden layers -> class logits."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.head(torch.relu(self.fc2(x)))


def build_tiny_mlp(width: float, *, num_classes: int = 10, in_channels: int = 1,
                   image_size: int = 28, **_: Any) -> nn.Module:
    return TinyMLP(in_channels * image_size ** 2, max(8, round(128 * width)), num_classes)


# Trained on images; the first layer and the head kept full rank (only fc2 is factorized); a
# default of its own (the config's lr unless a flag sets it).
TINY_MLP = ModelSpec("tiny_mlp", build_tiny_mlp, task="image",
                     presets={"paper": {"keep": ["fc1", "head"]}}, defaults={"lr": 0.05})
REF = f"{Path(__file__).resolve()}:TINY_MLP"
# 256 images of 32: 8 steps an epoch; the switch at epoch 1 (step 8); a checkpoint every 2 steps.
TRAIN = ["--width", "1", "--train-subset", "256", "--val-subset", "64", "--test-subset", "64",
         "--batch-size", "32", "--epochs", "2", "--warmup-epochs", "1", "--threads", "1",
         "--checkpoint-every-steps", "2", "--no-progress"]


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> ModelSpec:
    """TINY_MLP registered for this test only (the registry restored after it)."""
    monkeypatch.setattr(spec_module, "_REGISTRY", dict(spec_module._REGISTRY))
    return register_model(TINY_MLP)


def test_a_spec_is_a_model_choice_with_its_defaults_and_presets(registered: ModelSpec) -> None:
    assert "tiny_mlp" in model_names() and get_spec("tiny_mlp") is registered
    cfg = load_config(overrides={"model": "tiny_mlp"})
    assert cfg.lr == 0.05 and not cfg.is_lm and cfg.optimizer_name == "sgd"
    assert load_config(overrides={"model": "tiny_mlp", "lr": "0.2"}).lr == 0.2
    model = build_at_width("tiny_mlp", 0.5, in_channels=1, image_size=28)
    assert model.fc2.out_features == 64 and model.PRESETS["paper"]["keep"] == ["fc1", "head"]
    # the reference form loads this file in its own module: an equal spec, not this object
    assert get_spec(REF).name == "tiny_mlp"
    with pytest.raises(ValueError, match="model 'tiny_mlp' is already registered"):
        register_model(ModelSpec("tiny_mlp", build_tiny_mlp))
    with pytest.raises(ValueError, match="task 'video' is invalid: allowed image, lm-bptt"):
        ModelSpec("x", build_tiny_mlp, task="video")


def test_an_unknown_model_or_reference_is_one_line_exit_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["train", "--model", "tiny_mlp", "--epochs", "1"], capsys)
    assert code == 2 and "model 'tiny_mlp' is invalid: allowed resnet18" in err
    not_a_spec = f"{Path(__file__).resolve()}:TinyMLP"
    code, _, err = cli(["train", "--model", not_a_spec, "--epochs", "1"], capsys)
    assert code == 2 and "is not a pufferfish.models.ModelSpec" in err


def _model_state(run: Path) -> dict[str, torch.Tensor]:
    found = latest_checkpoint(run)
    assert found is not None
    return found[0]["model"]


@needs_fashion
def test_registered_model_trains_and_its_reference_resumes_bitwise(
        registered: ModelSpec, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = tmp_path / "ref"
    code, _, err = cli(["train", "--model", "tiny_mlp", *TRAIN, "--out", str(ref)], capsys)
    assert code == 0, err[-2000:]
    rows = metrics(ref)
    assert len(rows) == 2 and rows[-1]["test_acc"] > 0.3  # 10 classes: chance is 0.1
    factorized = json.loads((ref / "factorization.json").read_text())
    assert "fc2" in json.dumps(factorized) and "fc1" in json.dumps(factorized)
    assert any(k.startswith("fc2.") and k != "fc2.weight" for k in _model_state(ref))
    # the same spec by reference, in fresh processes: killed after the switch, then resumed
    run, marker = tmp_path / "run", tmp_path / "killed"
    killed = run_cli("train", "--model", REF, *TRAIN, "--out", str(run), env={
        "PUFFERFISH_KILL_AT_STEP": "11", "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists(), killed.stderr[-2000:]
    resumed = run_cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    a, b = _model_state(ref), _model_state(run)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["test_acc"] for r in metrics(run)] == [r["test_acc"] for r in rows]


@needs_fashion
def test_referenced_model_benches_in_the_workers(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    rc = main(["bench", "--model", REF, "--width", "1", "--batch-size", "8", "--steps", "3",
               "--warmup", "2", "--compute-steps", "3", "--threads", "1", "--no-probe",
               "--methods", "ddp,pufferfish", "--bandwidth", "loopback", "--rounds", "1",
               "--out", str(out)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    model = get_spec(REF).build_at(1.0, in_channels=1, image_size=28)
    full = sum(p.numel() for p in model.parameters())
    assert rows["ddp"]["params"] == rows["ddp"]["params_full"] == full
    # the workers kept the spec's preset: fc1 and the head full rank, fc2 at rank ratio 1/4
    report = factorize(model, rank_ratio=0.25, preset="paper")
    assert [d.name for d in report.factorized] == ["fc2"]
    assert rows["pufferfish"]["params"] == report.params_after < full
    assert "Fashion-MNIST" in (out / "results.md").read_text()


def test_a_relative_reference_is_kept_as_its_absolute_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's config.toml names the file a relative ``PATH.py:NAME`` meant when it started, so
    a resume from another working directory finds it; names and modules stay as typed."""
    monkeypatch.chdir(Path(__file__).parent)
    cfg = load_config(overrides={"model": f"{Path(__file__).name}:TINY_MLP"})
    assert cfg.model == REF
    monkeypatch.chdir(tmp_path)
    assert load_config(overrides={"model": cfg.model}).model == REF
    assert load_config(overrides={"model": "resnet18"}).model == "resnet18"
    assert spec_module.absolute_reference("my_pkg.models:SPEC") == "my_pkg.models:SPEC"
