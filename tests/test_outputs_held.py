"""An output directory is written by one command at a time, and a bench's measurements are never
replaced unasked (docs/reliability.md, "One writer per directory"): while a command holds its
``--out`` (``pufferfish.outputs.hold``), ``bench``, ``report``, ``compare`` and ``train`` into it
are refused in one line naming the holder's pid, and change nothing there."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BENCH_TINY,
    DDP_ROWS,
    bench_record,
    cli,
    files_with_digests,
    finish,
    needs_fashion,
    run_cli,
    write_train_run,
)

from pufferfish.outputs import LOCK, RECORD, claim_outputs, hold, owners, seal_outputs

# 64 training and 32 test images, one epoch of 2 steps: a run (or compare's) in seconds.
TRAIN = ["--model", "resnet18", "--width", "0.125", "--train-subset", "64", "--val-subset", "0",
         "--test-subset", "32", "--batch-size", "32", "--threads", "1", "--no-progress",
         "--epochs", "1"]
COMPARE = [*TRAIN, "--methods", "full", "--latency-repeats", "1"]


def _saved(path: Path, step: float) -> Path:
    """A bench's results.json (DDP over 100mbit, 2 rounds at ``step`` and 1.5x ``step``)."""
    rounds = [{**bench_record("ddp", "100mbit", 1e8, s, s / 2, 0.0, 4e6), "round": r}
              for r, s in enumerate((step, 1.5 * step))]
    path.write_text(json.dumps({
        "config": {"model": "resnet18", "width": 0.25, "methods": ["ddp"],
                   "bandwidths": ["100mbit"], "workers": 2, "rounds": 2},
        "rounds": rounds, "rows": [], "skipped": [], "failures": [],
        "links": [{"bandwidth": "100mbit", "bandwidth_bps": 1e8, "delay_ms": 0.0,
                   "link_bps": 1e8, "link_rtt_s": None}],
        "order": [[["100mbit", ["ddp"]]]] * 2}))
    return path


def _in_use(out: Path, command: str, holder: str, pid: int) -> str:
    who = f"another `pufferfish {holder}`" if command == holder else f"`pufferfish {holder}`"
    return (f"pufferfish: error: --out {out} is in use by {who} (pid {pid}); nothing was "
            "changed: allowed another --out, or wait until it ends\n")


# Each command, and who holds its --out meanwhile (the same command: "another `pufferfish X`").
HOLDERS = {"bench": "bench", "report": "compare", "compare": "train", "train": "bench"}


def _argv(command: str, tmp_path: Path, out: Path) -> list[str]:
    if command == "bench":
        return ["bench", "--from-results", str(_saved(tmp_path / "saved.json", 1.0)),
                "--out", str(out)]
    if command == "report":
        rows = [{**row, "params": 1000, "macs": 5000} for row in DDP_ROWS]
        return ["report", str(write_train_run(tmp_path / "run", rows)), "--out", str(out)]
    return [command, *(COMPARE if command == "compare" else TRAIN), "--out", str(out)]


@needs_fashion
@pytest.mark.parametrize("command", list(HOLDERS))
def test_a_held_directory_refuses_each_command_then_lets_it_proceed(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, holder = tmp_path / "out", HOLDERS[command]
    argv = _argv(command, tmp_path, out)
    with hold(out, holder):  # as a running `pufferfish HOLDER` holds it
        before = files_with_digests(out)
        code, _, err = cli(argv, capsys)
        assert (code, err) == (2, _in_use(out, command, holder, os.getpid()))
        if command == "bench":  # measuring and --train too, before anything is measured
            for extra in ([], ["--train", "--epochs", "1"]):
                code, _, err = cli(["bench", *BENCH_TINY, "--methods", "ddp", "--bandwidth",
                                    "loopback", *extra, "--out", str(out)], capsys)
                assert (code, err) == (2, _in_use(out, command, holder, os.getpid()))
        assert files_with_digests(out) == before
    assert not out.exists()  # made for the hold and left empty: gone with it
    code, _, err = cli(argv, capsys)  # released: it proceeds
    assert code == 0, err
    assert command in owners(out).values() and not (out / LOCK).exists()


def test_a_held_directory_refuses_a_process_and_a_refusal_under_torchrun_ends_every_rank(
        tmp_path: Path) -> None:
    """The holder another process: the refused one names it; under torchrun rank 0 is refused
    and the job ends (its other rank does not wait for it), nothing written."""
    out = tmp_path / "out"
    saved = _saved(tmp_path / "saved.json", 1.0)
    with hold(out, "report"):
        before = files_with_digests(out)
        refused = run_cli("bench", "--from-results", str(saved), "--out", str(out))
        assert (refused.returncode, refused.stderr) == (2, _in_use(out, "bench", "report",
                                                                   os.getpid()))
        launched = run_cli("bench", "--model", "resnet18", "--width", "0.125", "--methods", "ddp",
                           "--steps", "2", "--warmup", "2", "--compute-steps", "1",
                           "--batch-size", "4", "--no-probe", "--out", str(out), torchrun=2,
                           cwd=tmp_path)
        assert launched.returncode != 0
        assert _in_use(out, "bench", "report", os.getpid()).strip() in launched.stderr
        assert files_with_digests(out) == before


def test_a_finished_benchs_measurements_are_replaced_only_when_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    first, second = _saved(tmp_path / "first.json", 1.0), _saved(tmp_path / "second.json", 3.0)
    assert cli(["bench", "--from-results", str(first), "--out", str(out)], capsys)[0] == 0
    measured = json.loads((out / "results.json").read_text())["rounds"]
    before = files_with_digests(out)
    code, _, err = cli(["bench", "--from-results", str(second), "--out", str(out)], capsys)
    assert code == 2 and err == (
        f"pufferfish: error: --out {str(out)!r} holds results.json of an earlier `pufferfish "
        "bench`, which this one would replace: allowed another --out, --overwrite, or "
        f"--from-results {out / 'results.json'} (its measurements reused)\n")
    assert files_with_digests(out) == before
    # --from-results naming that very results.json: its rounds carried into the new one.
    for named in (out / "results.json", out):
        code, _, err = cli(["bench", "--from-results", str(named), "--compute-ms", "12",
                            "--out", str(out)], capsys)
        assert code == 0, err
        again = json.loads((out / "results.json").read_text())
        assert again["rounds"] == measured and again["config"]["compute_ms"] == "12"
    # --overwrite: replaced, as asked.
    code, _, err = cli(["bench", "--from-results", str(second), "--out", str(out),
                        "--overwrite"], capsys)
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["rounds"] == \
        json.loads(second.read_text())["rounds"]


@needs_fashion
def test_a_finished_benchs_training_runs_are_replaced_only_when_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    out.mkdir()
    with hold(out, "bench"):  # what an earlier `bench --train` left: its runs and summary
        claim_outputs(out, "bench", ["train", "train_results.json", "train.md"])
        write_train_run(out / "train" / "loopback" / "ddp", DDP_ROWS)
        (out / "train_results.json").write_text('{"runs": []}')
        seal_outputs(out, "bench", ["train", "train_results.json", "train.md"])
    before = files_with_digests(out)
    code, _, err = cli(["bench", "--train", *BENCH_TINY, "--methods", "ddp", "--bandwidth",
                        "loopback", "--epochs", "1", "--out", str(out)], capsys)
    assert code == 2 and err == (
        f"pufferfish: error: --out {str(out)!r} holds train_results.json, train of an earlier "
        "`pufferfish bench`, which this one would replace: allowed another --out, or --overwrite\n")
    assert files_with_digests(out) == before


def _start_bench(methods: str, out: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pufferfish", "bench", *BENCH_TINY, "--methods", methods,
         "--bandwidth", "loopback", "--rounds", "1", "--out", str(out)],
        cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _holder(lock: Path) -> str:
    """The pid in a lock file (written there by a command once it holds the lock), or ""."""
    try:
        return lock.read_text().split(" ")[0]
    except FileNotFoundError:
        return ""


def _stop_once_held(lock: Path, proc: subprocess.Popen, deadline_s: float = 300) -> None:
    """Stop ``proc`` (SIGSTOP) once it holds ``lock``: its pid is in the file, and while it is
    stopped a non-blocking flock from here fails (tried only then: never in its way)."""
    end = time.monotonic() + deadline_s
    while _holder(lock) != str(proc.pid):
        assert proc.poll() is None and time.monotonic() < end, finish(proc)
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    fd = os.open(lock, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert _holder(lock) == str(proc.pid)


@needs_fashion
def test_two_benches_at_once_one_writes(tmp_path: Path) -> None:
    """The second started while the first holds --out (and kept holding it: stopped until the
    second has ended) is refused naming the first; only the first's results are written."""
    out = tmp_path / "same"
    first = _start_bench("ddp", out, tmp_path)
    stopped = True  # from _stop_once_held on: it holds the lock while the second one runs
    try:
        _stop_once_held(out / LOCK, first)
        second = _start_bench("ddp,pufferfish", out, tmp_path)
        code, _, err = finish(second, timeout=300)
        assert (code, err) == (2, _in_use(out, "bench", "bench", first.pid))
        first.send_signal(signal.SIGCONT)
        stopped = False
        code, _, err = finish(first, timeout=600)
        assert code == 0, err[-3000:]
    finally:
        if stopped:
            first.send_signal(signal.SIGCONT)
        if first.poll() is None:
            first.kill()
            first.wait()
    result: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in result["rows"]] == ["ddp"]
    assert result["config"]["methods"] == ["ddp"]
    assert not (out / LOCK).exists() and set(owners(out).values()) == {"bench"}
    record = json.loads((out / RECORD).read_text())  # every file as sealed: none replaced since
    assert all(hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"]
               for name, entry in record.items() if (out / name).is_file())


def test_a_bench_without_out_gets_a_fresh_directory_each(tmp_path: Path, monkeypatch) -> None:
    # Without --out each bench makes its own runs/bench-<date-time> (one atomic mkdir, the next
    # free -N when two start in the same second), as a run does: never an earlier bench's.
    from pufferfish.bench.config import BenchConfig
    from pufferfish.bench.runner import _hold_out

    monkeypatch.chdir(tmp_path)
    first, second = BenchConfig(), BenchConfig()
    with _hold_out(first), _hold_out(second):
        assert first.out != second.out
        for cfg in (first, second):
            assert Path(cfg.out).parent == Path("runs") and Path(cfg.out).is_dir()
            assert Path(cfg.out).name.startswith("bench-")
        (Path(first.out) / "results.json").write_text("{}")
    assert Path(first.out).is_dir() and not Path(second.out).exists()  # made, left empty: gone
    given = BenchConfig(out="mine")
    with _hold_out(given):
        assert given.out == "mine"
