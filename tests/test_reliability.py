"""Reliability and security, end to end with real processes (docs/reliability.md).

Elastic restarts give bitwise the same final state as an uninterrupted run; ranks that disagree
on configuration or data stop together by name; a peer that dies or freezes is an error within the
process-group timeout, not a hung job; a diverging run stops (or skips steps) on every rank at
the same step; bad input of every kind is one line and exit status 2; a malicious checkpoint is
refused without running anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SMALL,
    cli,
    files_with_digests,
    finish,
    free_port,
    metrics,
    needs_fashion,
    run_cli,
    tiny_lm_args,
    write_idx,
)

from pufferfish.cli import main
from pufferfish.config import TrainConfig
from pufferfish.configfile import dump_toml
from pufferfish.training import checkpoint as ck
from pufferfish.training.checkpoint import latest_checkpoint, save_checkpoint
from pufferfish.training.rundir import record_run


def launch(rank: int, world: int, port: int, args: list[str],
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """One ``pufferfish train`` process of a group, started by hand (no torchrun, no restarts)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank),
            "LOCAL_RANK": str(rank), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "pufferfish", "train", *args], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- resume after a kill (elastic restarts under torchrun: test_elastic.py) ----------------

def _killed_and_resumed(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        kill_at: int, resumed_from: str) -> tuple[Path, Path]:
    """An uninterrupted run, and the same run SIGKILLed before step ``kill_at`` then resumed."""
    ref, run, marker = tmp_path / "ref", tmp_path / "run", tmp_path / "killed"
    assert cli(["train", *args, "--out", str(ref)], capsys)[0] == 0
    killed = run_cli("train", *args, "--out", str(run), env={
        "PUFFERFISH_KILL_AT_STEP": str(kill_at), "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    code, out, err = cli(["train", *args, "--out", str(run), "--resume", "auto"], capsys)
    assert code == 0, err
    assert f"resumed from {run / 'checkpoints' / resumed_from}" in out
    a, b = latest_checkpoint(ref), latest_checkpoint(run)
    assert a is not None and b is not None
    for key, t in a[0]["model"].items():
        assert torch.equal(t, b[0]["model"][key]), key
    return ref, run


def test_lstm_mid_epoch_resume_carries_the_hidden_state(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The LSTM's hidden state crosses BPTT chunks; a mid-epoch checkpoint must carry it."""
    args = tiny_lm_args(tmp_path, "--epochs", "1", "--mode", "full",
                        "--checkpoint-every-steps", "4")
    ref, run = _killed_and_resumed(args, tmp_path, capsys, 10, "ckpt-000000008.pt")
    assert metrics(ref)[0]["train_loss"] == metrics(run)[0]["train_loss"]


def test_resume_of_an_automatic_run_switches_as_uninterrupted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Killed mid-epoch during the automatic warm-up: the stable-rank record (observed every few
    steps) is restored, so the switch happens at the same epoch with the same ranks. The LSTM's
    kernel is fixed: timed at the switch, the two runs could pick different ones on a loaded
    machine, and the kernels round differently (then the weights would differ, not the switch)."""
    args = tiny_lm_args(tmp_path, "--epochs", "3", "--mode", "pufferfish", "--warmup-epochs",
                        "auto", "--rank-ratio", "auto", "--max-rank-ratio", "1",
                        "--checkpoint-every-steps", "4", "--kernel", "loop")
    ref, run = _killed_and_resumed(args, tmp_path, capsys, 70, "ckpt-000000068.pt")
    a, b = (json.loads((d / "factorization.json").read_text()) for d in (ref, run))
    assert a["epoch"] == b["epoch"] and a["layers"] == b["layers"]
    assert a["decisions"]["switch"] == b["decisions"]["switch"]
    assert a["decisions"]["stable_ranks"] == b["decisions"]["stable_ranks"]


# -- ranks must agree ------------------------------------------------------------------------

@needs_fashion
def test_mismatched_configs_stop_every_rank_by_name(tmp_path: Path) -> None:
    port = free_port()
    common = [*SMALL, "--train-subset", "128", "--epochs", "1", "--warmup-epochs", "0",
              "--timeout-s", "20",
              "--out", str(tmp_path / "run")]
    started = time.monotonic()
    procs = [launch(r, 2, port, [*common, "--lr", lr]) for r, lr in enumerate(["0.05", "0.1"])]
    results = [finish(p) for p in procs]
    for code, _, err in results:
        assert code == 2, err[-2000:]
        assert "ranks disagree on the configuration: --lr (rank 0: 0.05, rank 1: 0.1)" in err
        assert len(err.strip().splitlines()) == 1
    assert time.monotonic() - started < 120
    assert not (tmp_path / "run" / "checkpoints").exists()


def fake_fashion(directory: Path, n: int = 64, seed: int = 0, **broken: Any) -> Path:
    """A tiny Fashion-MNIST look-alike; ``broken`` overrides one file's magic/dims/payload."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for prefix in ("train", "t10k"):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        spec = {f"{prefix}-images-idx3-ubyte.gz": (2051, [n, 28, 28], images.numpy().tobytes()),
                f"{prefix}-labels-idx1-ubyte.gz": (2049, [n], labels.numpy().tobytes())}
        for name, (magic, dims, payload) in spec.items():
            if broken.get("file") == name:
                magic = broken.get("magic", magic)
                dims = broken.get("dims", dims)
                payload = broken.get("payload", payload)
            write_idx(directory / name, magic, dims, payload)
    return directory


def test_mismatched_data_stops_every_rank_by_name(tmp_path: Path) -> None:
    """``data_dir`` may differ per node; what it holds may not."""
    port = free_port()
    common = [*SMALL, "--batch-size", "16", "--train-subset", "48", "--val-subset", "16",
              "--test-subset", "16",
              "--epochs", "1", "--warmup-epochs", "0", "--timeout-s", "20",
              "--out", str(tmp_path / "run")]
    dirs = [fake_fashion(tmp_path / "d0", seed=0), fake_fashion(tmp_path / "d1", seed=1)]
    procs = [launch(r, 2, port, [*common, "--data-dir", str(d)]) for r, d in enumerate(dirs)]
    for code, _, err in (finish(p) for p in procs):
        assert code == 2, err[-2000:]
        assert "ranks disagree on the data or the checkpoint to resume: train_images (rank 0:" in err
        assert len(err.strip().splitlines()) == 1


# -- no endless hangs ------------------------------------------------------------------------

@needs_fashion
@pytest.mark.parametrize("how", ["KILL", "STOP"])  # crashed (sockets close) / frozen (they don't)
def test_a_vanished_peer_is_an_error_within_the_timeout(tmp_path: Path, how: str) -> None:
    timeout_s = 10
    port, marker = free_port(), tmp_path / "fault"
    args = [*SMALL, "--train-subset", "128", "--epochs", "2", "--warmup-epochs", "1",
            "--timeout-s", str(timeout_s), "--out", str(tmp_path / "run")]
    fault = {"PUFFERFISH_KILL_AT_STEP": "1", "PUFFERFISH_KILL_RANK": "1",
             "PUFFERFISH_KILL_MARKER": str(marker), "PUFFERFISH_KILL_SIGNAL": how}
    survivor = launch(0, 2, port, args)
    victim = launch(1, 2, port, args, env=fault)
    try:
        code, _, err = finish(survivor, timeout=240)
        ended = time.time()
    finally:
        victim.kill()  # SIGKILL also ends a stopped process
        victim.communicate()
    assert marker.exists(), err[-2000:]
    assert code == 1, err[-2000:]
    assert "lost contact with the other processes" in err
    assert len(err.strip().splitlines()) == 1, err
    assert ended - marker.stat().st_mtime < timeout_s + 20


# -- divergence ------------------------------------------------------------------------------

@needs_fashion
def test_nonfinite_stop_names_the_step_on_every_rank(tmp_path: Path) -> None:
    port, run = free_port(), tmp_path / "run"
    args = [*SMALL, "--train-subset", "128", "--epochs", "2", "--warmup-epochs", "1",
            "--lr", "1e6", "--checkpoint-every-steps", "1", "--timeout-s", "30", "--out", str(run)]
    procs = [launch(r, 2, port, args) for r in range(2)]
    errors = []
    for code, _, err in (finish(p) for p in procs):
        assert code == 2, err[-2000:]
        assert len(err.strip().splitlines()) == 1, err
        errors.append(err.strip())
    assert errors[0] == errors[1]  # the same decision, at the same step, on both ranks
    assert "pufferfish: error: non-finite " in errors[0] and " of 2 ranks at epoch " in errors[0]
    good = errors[0].split("last good checkpoint: ")[1].split(";")[0]
    state = ck.load_checkpoint(good)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


@needs_fashion
def test_nonfinite_skip_skips_and_counts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_cli("train", *SMALL, "--mode", "full", "--train-subset", "128", "--epochs", "1",
                     "--lr", "1e6", "--nonfinite", "skip", "--out", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run)
    assert 0 < rows[0]["skipped_steps"] <= 4
    found = latest_checkpoint(run)
    assert found is not None
    for key, t in found[0]["model"].items():  # BatchNorm statistics too: the skip undid them
        assert torch.isfinite(t.float()).all(), key


# -- malicious checkpoints -------------------------------------------------------------------

class _Payload:
    """Unpickling this runs ``touch <path>``: what a malicious checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _run_dir(tmp_path: Path, **overrides: Any) -> tuple[Path, TrainConfig]:
    run = tmp_path / "run"
    cfg = TrainConfig(model="resnet18", width=0.125, train_subset=64, test_subset=16,
                      batch_size=32, epochs=1, warmup_epochs="0", threads=1, progress=False,
                      out=str(run), **overrides)
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(dump_toml(cfg))
    return run, cfg


def _plant(run: Path, step: int, obj: Any) -> Path:
    """Write ``obj`` as checkpoint ``step`` with a *matching* manifest (checksums pass)."""
    pt = run / "checkpoints" / f"ckpt-{step:09d}.pt"
    torch.save(obj, pt)
    data = pt.read_bytes()
    pt.with_suffix(".json").write_text(json.dumps({
        "format": ck.MANIFEST_FORMAT, "version": ck.MANIFEST_VERSION, "file": pt.name,
        "step": step, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    return pt


@needs_fashion
def test_malicious_checkpoint_is_refused_and_not_executed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = _run_dir(tmp_path)
    evidence = tmp_path / "pwned"
    _plant(run, 4, {"model": _Payload(evidence), "epoch": 1})
    assert pickle.loads(pickle.dumps(_Payload(tmp_path / "probe"))) == 0  # the payload is live
    assert (tmp_path / "probe").exists()
    code, _, err = cli(["train", "--resume", str(run)], capsys)
    assert code == 2
    assert "is not a plain-weights checkpoint (refused by weights_only loading; not executed)" in err
    assert len(err.strip().splitlines()) == 1
    assert not evidence.exists()
    # It is refused, not skipped: the run does not quietly start over.
    assert (run / "checkpoints" / "ckpt-000000004.pt").exists()
    assert not (run / "metrics.jsonl").exists()


# -- bad input: one line, exit status 2 ------------------------------------------------------

def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    empty = tmp / "empty.txt"
    empty.write_text("  \n\n")
    bad_toml = tmp / "bad.toml"
    bad_toml.write_text("epochs = [\n")
    unknown_key = tmp / "unknown.toml"
    unknown_key.write_text("epocs = 3\n")
    data = {
        "truncated": fake_fashion(tmp / "truncated", file="t10k-images-idx3-ubyte.gz",
                                  payload=bytes(100)),
        "magic": fake_fashion(tmp / "magic", file="train-labels-idx1-ubyte.gz", magic=2051),
        "shape": fake_fashion(tmp / "shape", file="train-images-idx3-ubyte.gz",
                              dims=[64, 32, 32], payload=bytes(64 * 32 * 32)),
    }
    tiny = [*SMALL, "--train-subset", "64", "--test-subset", "16", "--epochs", "1",
            "--warmup-epochs", "0", "--out", str(tmp / "never")]
    started = tmp / "started"  # a run killed before its first checkpoint
    started.mkdir()
    (started / "config.toml").write_text(dump_toml(TrainConfig(out=str(started))))
    return [
        # flags
        (["train", "--lrr", "0.1"], "unrecognized arguments: --lrr 0.1 (did you mean --lr?)"),
        (["train", "--epoch", "3"], "unrecognized arguments: --epoch 3 (did you mean --epochs?)"),
        (["trian"], "invalid choice: 'trian'"),
        (["trian"], "(did you mean 'train'?)"),
        (["train", "--epochs"], "argument --epochs: expected one argument"),
        ([], "missing COMMAND"),
        (["train", *tiny, "--epochs", "two"], "epochs 'two' is invalid: allowed a int"),
        (["train", *tiny, "--nonfinite", "ignore"],
         "nonfinite 'ignore' is invalid: allowed stop, skip"),
        (["train", *tiny, "--lr", "-1"], "lr -1.0 is invalid: allowed a number > 0"),
        # config files
        (["train", "--config", str(unknown_key)],
         "unknown configuration key 'epocs' (did you mean 'epochs'?)"),
        (["train", "--config", str(bad_toml)], "is not valid TOML"),
        (["train", "--config", str(tmp / "missing.toml")], "missing.toml' does not exist"),
        # data files
        (["train", *tiny, "--data-dir", str(data["truncated"])], "t10k-images-idx3-ubyte.gz"),
        (["train", *tiny, "--data-dir", str(data["magic"])], "wrong IDX magic number 2051"),
        (["train", *tiny, "--data-dir", str(data["shape"])], "expected 28×28"),
        (["train", *tiny, "--data-dir", str(tmp / "nowhere")], "nowhere"),
        # text corpora
        (["train", *tiny, "--model", "lstm", "--data", str(empty)], "empty text corpus"),
        (["train", *tiny, "--model", "lstm", "--data", str(tmp / "none.txt")],
         "none.txt' does not exist: allowed an existing UTF-8 text file"),
        # run directories
        (["train", "--resume", str(tmp / "not-a-run")], "no config.toml there, not a run"),
        (["train", "--resume", str(started)], f"--resume {started}: no checkpoint in "
         f"{started / 'checkpoints'} to continue from; to start the run anew there use "
         "--overwrite without --resume"),
        (["train", "--resume", str(started), "--overwrite"],
         "--overwrite is invalid with --resume"),
        (["train", *tiny, "--resume", "auto", "--overwrite"],
         "--overwrite is invalid with --resume 'auto'"),
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Table-driven, in this process (each case would otherwise pay torch's import time)."""
    failures = []
    for argv, message in _bad_inputs(tmp_path):
        code, _, err = cli(argv, capsys)
        lines = err.strip().splitlines()
        ok = (code == 2 and len(lines) == 1 and lines[0].startswith("pufferfish: error: ")
              and message in lines[0])
        if not ok:
            failures.append(f"{argv}: exit {code}, stderr {err!r}; expected {message!r}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "never").exists()


@needs_fashion
def test_resume_of_a_different_run_names_the_key(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run, cfg = _run_dir(tmp_path)
    other = TrainConfig(**{**cfg.to_dict(), "width": 0.25})
    save_checkpoint(run, {"config": other.to_dict(), "model": {}, "epoch": 1}, 4)
    code, _, err = cli(["train", "--resume", str(run)], capsys)
    assert code == 2
    assert "configuration mismatch between checkpoint and this run: width: checkpoint has " \
           "0.25, this run has 0.125" in err
    # An automatic resume (torchelastic restart / --resume auto) refuses any difference of
    # substance, naming it, and points at --resume DIR for deliberate changes.
    code, _, err = cli(["train", "--config", str(run / "config.toml"), "--resume", "auto",
                     "--lr", "0.01"], capsys)
    assert code == 2
    assert "lr: checkpoint has 0.1, this run has 0.01" in err and f"--resume {run}" in err


def test_argparse_error_is_one_line_in_a_real_process() -> None:
    result = run_cli("train", "--batch-sise", "8")
    assert result.returncode == 2
    assert result.stderr.strip() == ("pufferfish: error: unrecognized arguments: --batch-sise 8 "
                                     "(did you mean --batch-size?)")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_cli("train", "--config", str(tmp_path / "missing.toml"), "--debug")
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "does not exist" in result.stderr


# -- files are whole or absent ---------------------------------------------------------------

def test_interrupt_during_a_checkpoint_write_is_deferred(tmp_path: Path) -> None:
    """SIGINT while a checkpoint is written: the write completes, then KeyboardInterrupt."""
    from pufferfish.training.checkpoint import signals_deferred

    # Python's Ctrl-C handler, also where pytest was started with SIGINT ignored (a background
    # job of a non-interactive shell; there a deferred SIGINT is rightly ignored as well).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    big = {"w": torch.zeros(2_000_000)}
    try:
        with pytest.raises(KeyboardInterrupt), signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            save_checkpoint(tmp_path, big, 1)
    finally:
        signal.signal(signal.SIGINT, previous)
    found = latest_checkpoint(tmp_path)
    assert found is not None and torch.equal(found[0]["w"], big["w"])
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


# -- nothing the user made is deleted unasked ----------------------------------------------------


def _unreadable_run(tmp_path: Path) -> tuple[Path, list[str]]:
    """A run directory none of whose checkpoints verifies, in three ways; and the reasons."""
    run, cfg = _run_dir(tmp_path)
    for step in (2, 4, 6):
        save_checkpoint(run, {"config": cfg.to_dict(), "model": {}, "epoch": 0}, step)
    ckpts = run / "checkpoints"
    (ckpts / "ckpt-000000006.pt").write_bytes(b"copied badly")
    flipped = bytearray((ckpts / "ckpt-000000004.pt").read_bytes())
    flipped[-20] ^= 1
    (ckpts / "ckpt-000000004.pt").write_bytes(bytes(flipped))
    (ckpts / "ckpt-000000002.json").unlink()
    return run, [f"{ckpts / 'ckpt-000000006.pt'} is 12 bytes, manifest says",
                 f"{ckpts / 'ckpt-000000004.pt'} fails its SHA-256 check (corrupted)",
                 f"{ckpts / 'ckpt-000000002.pt'} has no manifest"]


@pytest.mark.parametrize("how", ["--resume RUN", "--resume auto", "restart", "restart+overwrite"])
def test_resume_refuses_when_no_checkpoint_verifies_and_deletes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    """Asked to resume (or restarted by torchelastic), a run whose checkpoints all fail to verify
    stops in one line naming each file and why; it neither starts over nor removes them."""
    run, reasons = _unreadable_run(tmp_path)
    before = files_with_digests(run)
    same = ["train", "--config", str(run / "config.toml")]
    argv = {"--resume RUN": ["train", "--resume", str(run)],
            "--resume auto": [*same, "--resume", "auto"],
            "restart": same,  # what torchrun runs again, TORCHELASTIC_RESTART_COUNT > 0
            "restart+overwrite": [*same, "--overwrite"]}[how]
    if how.startswith("restart"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    code, _, err = cli(argv, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"no checkpoint in {run} verifies, so nothing was resumed and nothing removed" in err
    for reason in reasons:
        assert reason in err
    assert files_with_digests(run) == before


def test_unrelated_files_are_not_an_earlier_run(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A directory of one's own files is no run: a new run may use it, and leaves them alone."""
    out = tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "model-final.pt").write_text("mine too")
    before = files_with_digests(out)
    # A missing data directory fails after the run directory was accepted (which comes first).
    code, _, err = cli(["train", *SMALL, "--epochs", "1", "--warmup-epochs", "0", "--data-dir",
                        str(tmp_path / "nowhere"), "--out", str(out)], capsys)
    assert code == 2 and "nowhere" in err and "earlier run" not in err, err
    assert files_with_digests(out) == before


FINISHED = [*SMALL, "--train-subset", "64", "--epochs", "2", "--warmup-epochs", "1",
            "--checkpoint-every-steps", "1"]  # 2 steps per epoch; checkpoints 2, 3, 4 are kept


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *FINISHED, "--out", str(out)]) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, to))


@needs_fashion
def test_a_new_run_into_an_earlier_run_refuses_unless_overwrite(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "rejected").mkdir()
    (run / "checkpoints" / "rejected" / "ckpt-000000009.pt").write_text("evidence")
    before = files_with_digests(run)
    program = ("buckets.json, config.toml, factorization.json, factorization.txt, metrics.csv, "
               "metrics.jsonl, "
               "checkpoints/ckpt-000000002.json, checkpoints/ckpt-000000002.pt, "
               "checkpoints/ckpt-000000003.json, checkpoints/ckpt-000000003.pt, "
               "checkpoints/ckpt-000000004.json, checkpoints/ckpt-000000004.pt")
    again = ["train", *FINISHED, "--out", str(run)]
    code, out, err = cli(again, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {run} holds an earlier run ({program}); nothing was changed: continue it " \
           f"with --resume {run}, or start anew there with --overwrite" in err
    assert files_with_digests(run) == before

    # A checkpoint that does not verify is evidence: --overwrite sets it aside, never deletes it.
    with open(run / "checkpoints" / "ckpt-000000004.pt", "ab") as f:
        f.write(b"damage")
    damaged = files_with_digests(run)["checkpoints/ckpt-000000004.pt"]
    removed = program.replace(", checkpoints/ckpt-000000004.json, checkpoints/ckpt-000000004.pt", "")
    code, out, err = cli([*again, "--mode", "full", "--epochs", "1", "--overwrite"], capsys)
    assert code == 0, err
    assert f"--overwrite: removed the earlier run in {run}: {removed}; set aside in " \
           "checkpoints/rejected/ (they do not verify): checkpoints/ckpt-000000004.pt; left " \
           "alone: checkpoints/rejected/, notes.txt\n" in out
    after = files_with_digests(run)
    for name in ("notes.txt", "checkpoints/rejected/ckpt-000000009.pt"):
        assert after[name] == before[name]
    assert after["checkpoints/rejected/ckpt-000000004.pt"] == damaged
    assert "checkpoints/rejected/ckpt-000000004.json" in after
    assert not (run / "factorization.txt").exists()  # of the earlier run; this one is full-rank
    assert [r["epoch"] for r in metrics(run)] == [1]
    assert [p.name for p in ck.checkpoint_files(run)] == [
        "ckpt-000000001.json", "ckpt-000000001.pt", "ckpt-000000002.json", "ckpt-000000002.pt"]


@needs_fashion
def test_a_fork_into_another_run_refuses_unless_overwrite(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, target = _copy(finished, tmp_path / "a"), tmp_path / "b"
    target.mkdir()
    (target / "config.toml").write_text((source / "config.toml").read_text())
    (target / "metrics.jsonl").write_text("{}\n")
    before = files_with_digests(tmp_path)
    fork = ["train", "--resume", str(source), "--out", str(target), "--epochs", "3"]
    # Named like a run's files, but no run wrote them (by the outputs record): the user's, which
    # no flag removes.
    for extra in ([], ["--overwrite"]):
        code, _, err = cli([*fork, *extra], capsys)
        assert code == 2 and f"--out {target} holds config.toml, metrics.jsonl, which " \
            "`pufferfish train` did not write" in err, err
        assert files_with_digests(tmp_path) == before
    record_run(target)  # now they are a run's (one stopped before its first checkpoint)
    before = files_with_digests(tmp_path)
    code, _, err = cli(fork, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {target} holds another run (config.toml, metrics.jsonl); nothing was " \
           f"changed: fork --resume {source} into another --out, or add --overwrite" in err
    assert files_with_digests(tmp_path) == before

    code, out, err = cli([*fork, "--overwrite"], capsys)
    assert code == 0, err
    assert f"--overwrite: removed the earlier run in {target}: config.toml, metrics.jsonl\n" in out
    assert f"resumed from {source / 'checkpoints' / 'ckpt-000000004.pt'} at epoch 2" in out
    assert files_with_digests(source) == {k[2:]: v for k, v in before.items()
                                          if k.startswith("a/")}
    assert [r["epoch"] for r in metrics(target)] == [3]


@needs_fashion
def test_resume_past_a_corrupt_checkpoint_sets_it_aside_and_is_exact(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The newest checkpoint replaced by other data: the run resumes from the one before, moves the
    bad one to checkpoints/rejected/ (bytes intact), and ends bitwise where the original ended."""
    run = _copy(finished, tmp_path / "run")
    newest = run / "checkpoints" / "ckpt-000000004.pt"
    newest.write_bytes(b"other data" * 100)
    code, out, err = cli(["train", "--resume", str(run)], capsys)
    assert code == 0, err
    assert f"pufferfish: warning: skipped checkpoint(s) that do not verify: {newest} is 1000 " \
           "bytes, manifest says" in out
    assert f"resuming from {run / 'checkpoints' / 'ckpt-000000003.pt'}; moved to " \
           f"{run / 'checkpoints' / 'rejected'} (kept, never deleted): ckpt-000000004.pt, " \
           "ckpt-000000004.json" in out
    assert (run / "checkpoints" / "rejected" / "ckpt-000000004.pt").read_bytes() == \
        b"other data" * 100
    a, b = ck.load_checkpoint(finished / newest.relative_to(run)), ck.load_checkpoint(newest)
    for key, t in a["model"].items():
        assert torch.equal(t, b["model"][key]), key


def test_ranks_take_rank_0s_decision(tmp_path: Path) -> None:
    """Rank 0 is on its first attempt (an earlier run there: refuse), rank 1 believes it was
    restarted (it would resume): both stop with rank 0's line, and nothing is changed."""
    run, cfg = _run_dir(tmp_path)
    save_checkpoint(run, {"config": cfg.to_dict(), "model": {}, "epoch": 0}, 2)
    before = files_with_digests(run)
    port = free_port()
    args = ["--config", str(run / "config.toml"), "--timeout-s", "30"]
    procs = [launch(0, 2, port, args),
             launch(1, 2, port, args, env={"TORCHELASTIC_RESTART_COUNT": "1"})]
    results = [finish(p) for p in procs]
    for code, _, err in results:
        assert code == 2, err[-2000:]
        assert len(err.strip().splitlines()) == 1, err
    assert results[0][2] == results[1][2]
    assert f"--out {run} holds an earlier run (config.toml, checkpoints/ckpt-000000002.json, " \
           "checkpoints/ckpt-000000002.pt)" in results[0][2]
    assert files_with_digests(run) == before


@needs_fashion
def test_a_moved_run_directory_resumes_automatically_from_its_new_place(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``out`` says where a run lives, not what it computes: a killed run moved elsewhere (or
    copied to another machine) continues under ``--resume auto`` with ``--out`` its new place."""
    args = [*SMALL, "--train-subset", "128", "--val-subset", "64", "--epochs", "2",
            "--checkpoint-every-steps", "2"]
    old, new, marker = tmp_path / "old", tmp_path / "moved" / "run", tmp_path / "killed"
    killed = run_cli("train", *args, "--out", str(old), env={
        "PUFFERFISH_KILL_AT_STEP": "5", "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    new.parent.mkdir()
    old.rename(new)
    code, out, err = cli(["train", *args, "--out", str(new), "--resume", "auto"], capsys)
    assert code == 0, err
    assert f"resumed from {new / 'checkpoints' / 'ckpt-000000004.pt'}" in out
    # Anything else of substance is still refused.
    code, _, err = cli(["train", *args, "--lr", "0.01", "--out", str(new), "--resume", "auto"], capsys)
    assert code == 2 and "lr: checkpoint has" in err
