"""A run directory is one run's own (docs/reliability.md): two runs at once never mix in one, a
run in use is refused naming its pid, nothing the user made is removed by any flag, a resume
reads --config like flags and never goes back in epochs, and the smaller cases of issue 44."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import cli, files_with_digests, finish, metrics, needs_fashion, run_cli
from torch import nn

import pufferfish as pf
from pufferfish.cli import main
from pufferfish.outputs import make_fresh
from pufferfish.training.checkpoint import latest_checkpoint
from pufferfish.training.rundir import LOCK, lock_run_dir

ARGS = ["--model", "resnet18", "--width", "0.125", "--train-subset", "64", "--val-subset", "64",
        "--test-subset", "64", "--batch-size", "32", "--threads", "1", "--no-progress",
        "--warmup-epochs", "0"]  # 2 steps per epoch


def _start(seed: int, cwd: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pufferfish", "train", *ARGS, "--epochs", "1",
                             "--seed", str(seed), *extra], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _seed_of(run: Path) -> int:
    """The run's seed by its config.toml, after checking its checkpoint says the same."""
    seed = tomllib.loads((run / "config.toml").read_text())["seed"]
    found = latest_checkpoint(run)
    assert found is not None and found[0]["config"]["seed"] == seed, run
    assert [r["epoch"] for r in metrics(run)] == [1]
    return seed


@needs_fashion
def test_two_runs_started_at_once_never_mix(tmp_path: Path) -> None:
    """The same --out: one run and a one-line refusal. The default directory: two whole runs."""
    shared = [_start(seed, tmp_path, "--out", "shared") for seed in (0, 1)]
    results = [finish(p, timeout=400) for p in shared]
    assert sorted(code for code, _, _ in results) == [0, 2], [err[-2000:] for _, _, err in results]
    winner = next(seed for seed, (code, _, _) in enumerate(results) if code == 0)
    refused = results[1 - winner][2].strip().splitlines()
    assert len(refused) == 1 and refused[0].startswith("pufferfish: error: --out shared "), refused
    assert "is in use by another `pufferfish train` (pid" in refused[0] \
        or "holds an earlier run" in refused[0]
    assert _seed_of(tmp_path / "shared") == winner

    default = [_start(seed, tmp_path) for seed in (0, 1)]
    results = [finish(p, timeout=400) for p in default]
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and sorted(_seed_of(r) for r in runs) == [0, 1]
    for seed, (_, out, _) in enumerate(results):
        (named,) = [r for r in runs if f"run directory: runs/{r.name} " in out]
        assert _seed_of(named) == seed


def test_default_names_are_unique_under_concurrency(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "resnet18-pufferfish-20261206-142500"
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: make_fresh(base), range(8)))
    assert len(set(made)) == 8 and all(p.is_dir() for p in made)


def test_a_run_directory_in_use_is_refused_naming_its_pid(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    held = lock_run_dir(out)  # as a running `pufferfish train` holds it
    try:
        code, _, err = cli(["train", *ARGS, "--epochs", "1", "--out", str(out)], capsys)
        assert code == 2 and err == (
            f"pufferfish: error: --out {out} is in use by another `pufferfish train` (pid "
            f"{os.getpid()}); nothing was changed: allowed another --out, or wait until it ends\n")
        assert [p.name for p in out.iterdir()] == [LOCK]
    finally:
        held.release()
    assert not out.exists()  # made for the run that never wrote anything: gone with it


def test_a_directory_of_the_users_files_is_no_earlier_run_and_no_flag_removes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.toml").write_text("lr = 0.5\n")
    (out / "data.csv").write_text("1,2\n")
    before = files_with_digests(out)
    for extra in ([], ["--overwrite"], ["--resume", "auto"]):
        code, _, err = cli(["train", *ARGS, "--epochs", "1", "--out", str(out), *extra], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--out {out} holds config.toml, which `pufferfish train` did not write" in err
        assert "earlier run" not in err
        assert files_with_digests(out) == before


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 2 epochs."""
    out = tmp_path_factory.mktemp("done") / "run"
    assert main(["train", *ARGS, "--epochs", "2", "--out", str(out)]) == 0
    return out


@needs_fashion
def test_resume_reads_config_like_flags_and_never_goes_back_in_epochs(
        done: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = Path(shutil.copytree(done, tmp_path / "run"))
    before = files_with_digests(run)
    wider = tmp_path / "wider.toml"  # what defines the run: refused, as the flag is
    wider.write_text("width = 0.25\n")
    code, _, err = cli(["train", "--config", str(wider), "--resume", str(run)], capsys)
    assert code == 2 and "width: checkpoint has 0.125, this run has 0.25" in err, err
    assert files_with_digests(run) == before
    # Fewer epochs than done: refused, config.toml untouched.
    code, _, err = cli(["train", "--resume", str(run), "--epochs", "1"], capsys)
    assert code == 2 and err == (
        f"pufferfish: error: --epochs 1 is fewer than --resume {run} has trained (2 epochs, "
        f"{run / 'checkpoints' / 'ckpt-000000004.pt'}); nothing was changed: allowed epochs >= 2\n")
    assert files_with_digests(run) == before
    # What a resume may change, from the file: applied.
    more = tmp_path / "more.toml"
    more.write_text("epochs = 3\nlr = 0.05\n")
    code, _, err = cli(["train", "--config", str(more), "--resume", str(run)], capsys)
    assert code == 0, err
    assert [r["epoch"] for r in metrics(run)] == [1, 2, 3]
    saved = tomllib.loads((run / "config.toml").read_text())
    assert (saved["epochs"], saved["lr"]) == (3, 0.05)


@needs_fashion
def test_report_and_bench_do_not_write_into_a_run(
        done: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = files_with_digests(done)
    for argv in (["report", str(done), "--out", str(done)], ["bench", "--out", str(done)]):
        code, _, err = cli(argv, capsys)
        assert code == 2 and f"--out {str(done)!r} is a training run's directory" in err, err
    assert files_with_digests(done) == before


def test_a_config_files_values_are_blamed_on_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    five, two = tmp_path / "five.toml", tmp_path / "two.toml"
    five.write_text("out = 5\n")
    two.write_text('epochs = "two"\n')
    code, _, err = cli(["train", "--config", str(five)], capsys)
    assert code == 2 and err == (f"pufferfish: error: config file {str(five)!r}: out 5 is "
                                 'invalid: allowed a string (a path; in TOML quoted: out = "5")\n')
    code, _, err = cli(["train", "--config", str(two)], capsys)
    assert code == 2 and err == (f"pufferfish: error: config file {str(two)!r}: epochs 'two' is "
                                 "invalid: allowed a int\n")
    # Overridden by the flag: the file's value is not read (the run fails later, on its data).
    code, _, err = cli(["train", *ARGS, "--config", str(two), "--epochs", "1", "--data-dir",
                        str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "nowhere" in err and "two" not in err, err
    assert not (tmp_path / "run").exists()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's Ctrl-C, whatever pytest inherited


@needs_fashion
@pytest.mark.parametrize("step", [0, 3])
def test_ctrl_c_says_how_to_continue(tmp_path: Path, step: int) -> None:
    """SIGINT after step 3 (checkpoints after every step): the command that continues the run,
    which does; before the first step: that there is nothing to continue, and report says why."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PUFFERFISH_KILL_AT_STEP": str(step),
           "PUFFERFISH_KILL_SIGNAL": "INT", "PUFFERFISH_KILL_MARKER": str(tmp_path / "hit")}
    stopped = subprocess.run(
        [sys.executable, "-m", "pufferfish", "train", *ARGS, "--epochs", "2",
         "--checkpoint-every-steps", "1", "--out", str(out)], env=env, capture_output=True,
        text=True, timeout=300, preexec_fn=_default_sigint)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    if step == 0:
        assert last == (f"pufferfish: interrupted; no checkpoint in {out} yet: start it again "
                        f"with the same command and --out {out} --overwrite")
        report = run_cli("report", str(out))
        assert report.returncode == 2 and report.stderr == (
            f"pufferfish: error: run directory {str(out)!r} has no finished epoch: the run "
            "stopped before its first epoch ended (config.toml, no metrics.jsonl); nothing to "
            "report\n")
        return
    assert last == f"pufferfish: interrupted; continue with: pufferfish train --resume {out}"
    again = run_cli("train", "--resume", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["epoch"] for r in metrics(out)] == [1, 2]


def test_recipe_refuses_an_optimizer_over_another_models_parameters() -> None:
    model, other = nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))
    recipe = pf.Recipe(warmup_epochs=0)
    with pytest.raises(ValueError, match=r"^optimizer SGD holds none of the model's parameters "
                                         r"\(2 others\): allowed an optimizer built over"):
        recipe.on_epoch_start(0, model, torch.optim.SGD(other.parameters(), lr=0.1))
    assert not recipe.switched
