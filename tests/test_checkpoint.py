"""Checkpoint store: atomic writes, integrity checks, pickle-free loading, crash recovery."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pufferfish.training import checkpoint as ck
from pufferfish.training.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    UnsafeCheckpointError,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_compatible,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _small_state(i: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(i)), "i": i}


def _training_objects() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def test_round_trip_realistic_state_weights_only(tmp_path: Path) -> None:
    model, opt, sched = _training_objects()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    random.seed(123)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "architecture": {"0": {"rank": 2, "low_rank": True}, "3": {"rank": None, "low_rank": False}},
        "config": {"lr": 0.1, "nested": {"sizes": [1, 2, (3, 4)], "name": "resnet", "eps": 1e-8}},
        "step": 7,
    }
    path = save_checkpoint(tmp_path, state, step=7)
    assert path == tmp_path / "checkpoints" / "ckpt-000000007.pt"
    assert _files(tmp_path) == ["ckpt-000000007.json", "ckpt-000000007.pt"]
    manifest = json.loads(path.with_suffix(".json").read_text())
    data = path.read_bytes()
    assert manifest["size"] == len(data)
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert checkpoint_step(path) == 7

    torch.load(path, weights_only=True)  # the plain torch contract, independent of our loader
    loaded = load_checkpoint(path)

    model2, opt2, sched2 = _training_objects()
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])
    assert sched2.last_epoch == sched.last_epoch
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])

    torch.set_rng_state(state["rng"]["torch"])
    ref = torch.rand(3)
    torch.set_rng_state(loaded["rng"]["torch"])
    assert torch.equal(torch.rand(3), ref)
    random.setstate(loaded["rng"]["python"])  # the tuple survives weights_only as is
    got = random.random()
    random.seed(123)
    assert got == random.random()

    assert loaded["architecture"] == state["architecture"]
    assert loaded["config"] == state["config"]
    assert loaded["step"] == 7


def test_save_refuses_state_that_would_not_load(tmp_path: Path) -> None:
    bad = {"rng": {"numpy": np.random.get_state()}, "w": torch.ones(2)}
    with pytest.raises(CheckpointError, match=r"state\['rng'\]\['numpy'\]\[1\].*numpy"):
        save_checkpoint(tmp_path, bad, step=1)
    with pytest.raises(CheckpointError, match=r"state\['loss'\].*float\(x\)"):
        save_checkpoint(tmp_path, {"loss": np.float64(0.5)}, step=1)
    assert not (tmp_path / "checkpoints").exists() or _files(tmp_path) == []


@pytest.mark.parametrize("keep_last", [1, 2])
def test_keep_last_prunes_oldest(tmp_path: Path, keep_last: int) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, _small_state(step), step=step * 100, keep_last=keep_last)
    kept = [s * 100 for s in range(6 - keep_last, 6)]
    assert _files(tmp_path) == sorted(
        n for s in kept for n in (f"ckpt-{s:09d}.pt", f"ckpt-{s:09d}.json")
    )
    state, path = latest_checkpoint(tmp_path)  # type: ignore[misc]
    assert state["i"] == 5 and checkpoint_step(path) == 500


def test_truncated_newest_falls_back_and_warns_naming_both(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, _small_state(1), step=1)
    bad = save_checkpoint(tmp_path, _small_state(2), step=2)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.warns(CheckpointWarning) as rec:
        state, path = latest_checkpoint(tmp_path)  # type: ignore[misc]
    assert path == good and state["i"] == 1
    msg = str(rec[0].message)
    assert str(bad) in msg and str(good) in msg and "truncated" in msg
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(bad)


def test_missing_manifest_is_skipped(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, _small_state(1), step=1)
    bad = save_checkpoint(tmp_path, _small_state(2), step=2)
    bad.with_suffix(".json").unlink()  # killed between the .pt rename and the manifest
    with pytest.warns(CheckpointWarning, match="no manifest") as rec:
        state, path = latest_checkpoint(tmp_path)  # type: ignore[misc]
    assert path == good and state["i"] == 1
    assert str(bad) in str(rec[0].message) and str(good) in str(rec[0].message)


def test_checksum_mismatch_is_skipped(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, _small_state(1), step=1)
    bad = save_checkpoint(tmp_path, _small_state(2), step=2)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, flipped bits
    bad.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="SHA-256"):
        _, path = latest_checkpoint(tmp_path)  # type: ignore[misc]
    assert path == good


def test_no_checkpoints_returns_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    bad = save_checkpoint(tmp_path, _small_state(1), step=1)
    bad.write_bytes(b"")
    with pytest.warns(CheckpointWarning, match="no usable checkpoint"):
        assert latest_checkpoint(tmp_path) is None


class _Evil:
    """Pickles as a call to builtins.open(marker, "w"): creates the marker when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("container", ["torch.save", "raw pickle"])
def test_malicious_checkpoint_refused_without_executing(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "pwned"
    payload = {"model": {"w": torch.ones(2)}, "extra": _Evil(marker)}

    def dump(obj: Any, path: Path) -> None:
        if container == "torch.save":
            torch.save(obj, path)
        else:
            path.write_bytes(pickle.dumps(obj, protocol=2))

    # Sanity: the payload is live, i.e. full unpickling really would create a file.
    control_marker = tmp_path / "control"
    control = tmp_path / "control.pt"
    dump({"extra": _Evil(control_marker)}, control)
    if container == "torch.save":
        torch.load(control, weights_only=False)
    else:
        pickle.loads(control.read_bytes())
    assert control_marker.exists()

    good = save_checkpoint(tmp_path, _small_state(1), step=1)
    evil = good.parent / "ckpt-000000002.pt"
    dump(payload, evil)
    data = evil.read_bytes()
    manifest = json.loads(good.with_suffix(".json").read_text())
    manifest.update(file=evil.name, step=2, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    evil.with_suffix(".json").write_text(json.dumps(manifest))

    with pytest.raises(UnsafeCheckpointError, match="not a plain-weights checkpoint"):
        load_checkpoint(evil)
    assert issubclass(UnsafeCheckpointError, CheckpointError)
    with pytest.raises(CheckpointError, match=r"ckpt-000000002\.pt is not a plain-weights"):
        latest_checkpoint(tmp_path)  # tampering is not silently skipped
    assert not marker.exists()


def _fail_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", fake_save)


def _fail_replace(monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    real = os.replace

    def fake_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(dst).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", fake_replace)


@pytest.mark.parametrize(
    ("where", "failing_name"),
    [("torch.save", ".pt"), ("replace .pt", ".pt"), ("replace manifest", ".json")],
)
def test_disk_full_keeps_previous_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, failing_name: str
) -> None:
    good = save_checkpoint(tmp_path, _small_state(1), step=1)
    before = _files(tmp_path)
    with monkeypatch.context() as m:
        if where == "torch.save":
            _fail_torch_save(m)
        else:
            _fail_replace(m, failing_name)
        with pytest.raises(CheckpointError, match="ENOSPC") as exc_info:
            save_checkpoint(tmp_path, _small_state(2), step=2)
    assert f"ckpt-000000002{failing_name}" in str(exc_info.value)
    assert _files(tmp_path) == before  # no temp files, no half checkpoint, nothing pruned
    assert load_checkpoint(good)["i"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, path = latest_checkpoint(tmp_path)  # type: ignore[misc]
    assert path == good and state["i"] == 1


def test_resave_same_step_replaces(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _small_state(1), step=5)
    path = save_checkpoint(tmp_path, _small_state(2), step=5)
    assert load_checkpoint(path)["i"] == 2


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from pufferfish.training.checkpoint import save_checkpoint
    run_dir, n = sys.argv[1], int(sys.argv[2])
    step = 0
    while True:
        step += 1
        save_checkpoint(run_dir, {"w": torch.full((n,), float(step)), "i": step}, step, keep_last=2)
    """
)


def test_sigkill_during_writes_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), str(2_000_000)],  # 8 MB payloads
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while not (ckpt_dir / "ckpt-000000002.json").exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "writer made no progress"
            time.sleep(0.01)
        # Aim for the middle of a write: kill as soon as a temp file is being written.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
            p.name.endswith(".tmp") for p in ckpt_dir.iterdir()
        ):
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # a .pt without manifest is fine
        found = latest_checkpoint(tmp_path)
    assert found is not None
    state, path = found
    assert checkpoint_step(path) == state["i"] >= 2
    assert torch.equal(state["w"], torch.full((2_000_000,), float(state["i"])))

    # The next save (same host, writer pid dead) cleans up the killed writer's temp files.
    save_checkpoint(tmp_path, _small_state(10**6), step=10**6, keep_last=2)
    assert not [n for n in _files(tmp_path) if n.endswith(".tmp")]


_FAULTED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from pufferfish.training.checkpoint import save_checkpoint
    for step in (1, 2):
        save_checkpoint(sys.argv[1], {"i": step, "w": torch.full((4,), float(step))}, step)
    """
)


@pytest.mark.parametrize("point", ["save-payload", "save-manifest"])
def test_a_kill_at_a_save_fault_point_leaves_the_previous_checkpoint(
        tmp_path: Path, point: str) -> None:
    """The fault points of ``PUFFERFISH_KILL_DURING`` (used by benchmarks/faults.sh) strike inside
    the write: a temp file only, or a payload without its manifest; the previous one verifies."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           "PUFFERFISH_KILL_AT_STEP": "2", "PUFFERFISH_KILL_DURING": point,
           "PUFFERFISH_KILL_MARKER": str(tmp_path / "marker")}
    result = subprocess.run([sys.executable, "-c", _FAULTED_WRITER, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert (tmp_path / "marker").read_text().split()[:2] == [point, "2"]
    files = _files(tmp_path)
    if point == "save-payload":
        assert files[1:] == ["ckpt-000000001.json", "ckpt-000000001.pt"]
        assert files[0].startswith(".ckpt-000000002.pt.") and files[0].endswith(".tmp")
    else:
        assert files == ["ckpt-000000001.json", "ckpt-000000001.pt", "ckpt-000000002.pt"]
    found, rejected = ck.find_latest(tmp_path)
    assert found is not None and found[0]["i"] == 1
    assert [(p.name, "no manifest" in why) for p, why in rejected] == (
        [] if point == "save-payload" else [("ckpt-000000002.pt", True)])


def test_find_latest_names_what_it_rejects_and_set_aside_keeps_it(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, _small_state(step), step)
    ckpt_dir = tmp_path / "checkpoints"
    (ckpt_dir / "ckpt-000000003.pt").write_bytes(b"not a checkpoint")
    (ckpt_dir / "ckpt-000000002.json").unlink()
    found, rejected = ck.find_latest(tmp_path)
    assert found is not None and found[0]["i"] == 1
    assert [p.name for p, _ in rejected] == ["ckpt-000000003.pt", "ckpt-000000002.pt"]
    assert "ckpt-000000003.pt is 16 bytes, manifest says" in rejected[0][1]
    assert "ckpt-000000002.pt has no manifest" in rejected[1][1]
    assert len(_files(tmp_path)) == 5  # looking changes nothing

    payload = (ckpt_dir / "ckpt-000000003.pt").read_bytes()
    moved = [p.name for path, _ in rejected for p in ck.set_aside(path)]  # as a resume does
    assert moved == ["ckpt-000000003.pt", "ckpt-000000003.json", "ckpt-000000002.pt"]
    assert (ckpt_dir / "rejected" / "ckpt-000000003.pt").read_bytes() == payload
    assert _files(tmp_path) == ["ckpt-000000001.json", "ckpt-000000001.pt", "rejected"]
    # The same step rejected again (a later fault) does not replace the first one.
    save_checkpoint(tmp_path, _small_state(33), 3)
    again = ck.set_aside(ckpt_dir / "ckpt-000000003.pt")
    assert [p.name for p in again] == ["ckpt-000000003.1.pt", "ckpt-000000003.1.json"]
    assert (ckpt_dir / "rejected" / "ckpt-000000003.pt").read_bytes() == payload
    assert torch.load(again[0], weights_only=True)["i"] == 33  # a valid one moves the same
    # Neither the listing of checkpoint files nor pruning looks inside rejected/.
    save_checkpoint(tmp_path, _small_state(9), 9, keep_last=1)
    assert [p.name for p in ck.checkpoint_files(tmp_path)] == [
        "ckpt-000000009.json", "ckpt-000000009.pt"]
    assert len(list((ckpt_dir / "rejected").iterdir())) == 5


def test_verify_compatible_names_keys_and_values() -> None:
    saved = {
        "layer4.0.conv1": {"rank": 64, "low_rank": True},
        "fc": {"rank": None, "low_rank": False},
        "config": {"rank_ratio": 0.25, "widths": (64, 128)},
    }
    verify_compatible(saved, json.loads(json.dumps(saved)))  # tuple vs list is no change

    current = {
        "layer4.0.conv1": {"rank": None, "low_rank": False},
        "fc": {"rank": None, "low_rank": False},
        "config": {"rank_ratio": 0.25, "widths": [64, 128]},
    }
    with pytest.raises(CheckpointError) as exc_info:
        verify_compatible(saved, current)
    msg = str(exc_info.value)
    assert "architecture mismatch" in msg and "\n" not in msg
    assert "layer4.0.conv1.rank: checkpoint has 64, this run has None" in msg
    assert "layer4.0.conv1.low_rank: checkpoint has True, this run has False" in msg
    assert "fc" not in msg

    with pytest.raises(CheckpointError, match=r"^config mismatch.*: b: checkpoint has <absent>, this run has 2"):
        verify_compatible({"a": 1}, {"a": 1, "b": 2}, what="config")
    with pytest.raises(CheckpointError, match="checkpoint has 1, this run has True"):
        verify_compatible({"a": 1}, {"a": True})
    many_saved = {f"k{i}": i for i in range(6)}
    many_current = {f"k{i}": -i - 1 for i in range(6)}
    with pytest.raises(CheckpointError, match=r"k0: .*k1: .*k2: .*; and 3 more$"):
        verify_compatible(many_saved, many_current)


def test_checkpoint_step_rejects_other_names() -> None:
    assert checkpoint_step("/x/ckpt-000001200.pt") == 1200
    with pytest.raises(CheckpointError):
        checkpoint_step("/x/model.pt")
    assert ck.CHECKPOINT_SUBDIR == "checkpoints"
