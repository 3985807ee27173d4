"""A newcomer's first runs: short runs work with the default warm-up, two runs never share a
default directory, and a refusal under torchrun ends as one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY, metrics, needs_fashion, run_cli

from pufferfish.config import ConfigError, TrainConfig
from pufferfish.configfile import load_config
from pufferfish.outputs import make_fresh
from pufferfish.switch import SwitchSchedule


@pytest.mark.parametrize(("epochs", "pct", "switch"), [
    (1, "20%", 0), (2, "20%", 1), (3, "20%", 1), (10, "20%", 2), (20, "20%", 4),
    (10, "0%", 0), (4, "99%", 3), (10, "10%", 1)])
def test_warmup_as_a_share_of_the_run(epochs: int, pct: str, switch: int) -> None:
    cfg = load_config(None, {"epochs": epochs, "warmup_epochs": pct})
    assert SwitchSchedule.from_config(cfg).switch_epoch == switch
    assert SwitchSchedule.from_config(TrainConfig()).switch_epoch == 1  # the default: 10% of 10 epochs


@pytest.mark.parametrize("bad", ["100%", "-5%", "x%", "two"])
def test_bad_warmup_is_refused_naming_what_is_allowed(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"warmup_epochs .* is invalid: allowed"):
        load_config(None, {"warmup_epochs": bad})


def test_fresh_default_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cfg = TrainConfig(epochs=2)
    first = make_fresh(cfg.run_dir())  # the name, made by one atomic mkdir
    assert first.parent == Path("runs") and first.name.startswith("resnet18-pufferfish-")
    assert make_fresh(first) == Path(f"{first}-2")  # never the same twice
    assert make_fresh(cfg.run_dir()) not in (first, Path("runs/resnet18-pufferfish"))
    assert TrainConfig(out="mine").run_dir() == Path("mine")
    # torchrun: the launch's run id, the same for every rank and every restart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "d88791df-8096-4055-9e5a-c9ef69f32277")
    assert cfg.run_dir() == cfg.run_dir() == Path("runs/resnet18-pufferfish-d88791df")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(ConfigError, match="resume 'auto' continues the run in --out"):
        TrainConfig(resume="auto").run_dir()


@needs_fashion
def test_a_quick_first_try_and_the_same_under_torchrun(tmp_path: Path) -> None:
    # --epochs 1 with every method default (warm-up 10% -> 0), then the same under torchrun, in
    # the same directory: each gets its own run directory.
    one = run_cli("train", *TINY, "--epochs", "1", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "warm-up: 10% of 1 epoch is no whole epoch: full rank for the first 1 of its 8 " \
           "optimizer steps" in one.stdout
    two = run_cli("train", *TINY, "--epochs", "2", cwd=tmp_path, torchrun=2)
    assert two.returncode == 0, two.stderr[-2000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(len(metrics(r)) in (1, 2) for r in runs)
    assert all(f"run directory: runs/{r.name}" in one.stdout + two.stdout for r in runs)


@needs_fashion
def test_a_refusal_under_torchrun_is_the_last_word(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_cli("train", *TINY, "--epochs", "1", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli("train", *TINY, "--epochs", "1", "--out", str(out), torchrun=2)
    assert again.returncode != 0
    line = f"pufferfish: error: --out {out} holds an earlier run"
    ours = [x for x in again.stderr.splitlines() if x.startswith("pufferfish: error:")]
    assert len(ours) == 1 and ours[0].startswith(line)  # rank 0's, once
    # torchrun's summary names it as the root cause, instead of "To enable traceback see"
    root = again.stderr.split("Root Cause")[1]
    assert f"traceback : {line}" in root and "To enable traceback" not in again.stderr
