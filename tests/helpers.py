"""What more than one test file needs: data markers, run flags, CLI runners, gloo worker pairs.

The one home of the tests' shared helpers, so that no test file imports another (a test file
imported as a module runs its module-level code twice and ties one file's tests to another's
internals; tests/test_layout.py checks it). Worker scripts run as programs may import it too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pufferfish.bench import accuracy as acc
from pufferfish.cli import main
from pufferfish.configfile import dump_toml, load_config
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.training import checkpoint as ck
from pufferfish.training.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[1]

# -- data and markers ------------------------------------------------------------------------

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not FASHION.exists(), reason="dataset-fashion-mnist missing")


def write_idx(path: Path, magic: int, dims: list[int], payload: bytes) -> None:
    """A gzipped IDX file (Fashion-MNIST's format) with the given magic number and dims."""
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + payload)


def tiny_corpus(tmp_path: Path) -> Path:
    """A 2,400-word text file of 50 made-up words: a language model's data in milliseconds."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(50)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(200)) + "\n")
    return text


# -- `pufferfish train` flags ------------------------------------------------------------------

TINY = ["--model", "resnet18", "--width", "0.125", "--train-subset", "256", "--val-subset", "64",
        "--test-subset", "64", "--batch-size", "32", "--lr", "0.05", "--threads", "1",
        "--no-progress"]
SMALL = ["--model", "resnet18", "--width", "0.125", "--test-subset", "64", "--batch-size", "32",
         "--threads", "1", "--no-progress"]
FSDP_SMALL = [*SMALL, "--no-channels-last"]
# 256 examples, 32 per process and 2 processes: 4 steps per epoch; the switch is at global step 4.
SWITCHED = [*FSDP_SMALL, "--train-subset", "256", "--lr", "0.05", "--epochs", "2",
            "--warmup-epochs", "1", "--checkpoint-every-steps", "2", "--preset", "paper"]
# 256 examples, 32 per process, 2 processes: 4 steps per epoch; outer steps every 2 steps; the
# switch before epoch 1 (global step 4) is on an outer-step boundary.
DILOCO_ARGS = [*SMALL, "--train-subset", "256", "--lr", "0.05", "--epochs", "2",
               "--warmup-epochs", "1", "--sync", "diloco", "--inner-steps", "2",
               "--checkpoint-every-steps", "2", "--outer-switch-momentum", "project"]
# The metrics.jsonl fields that are wall-clock times (they differ between equal runs).
TIMES = {"epoch_time", "compute_time", "data_time", "comm_time", "compress_time"}
# `pufferfish bench` flags: a 3-step loopback bench in seconds.
BENCH_TINY = ["--model", "resnet18", "--width", "0.125", "--batch-size", "8", "--steps", "3",
              "--warmup", "2", "--compute-steps", "3", "--threads", "1", "--no-probe"]


def tiny_lm_args(tmp_path: Path, *extra: str) -> list[str]:
    """`pufferfish train` flags for a tiny 2-layer LSTM on :func:`tiny_corpus` (60 steps/epoch)."""
    return ["--model", "lstm", "--width", "0.02", "--data", str(tiny_corpus(tmp_path)),
            "--batch-size", "4", "--bptt", "10", "--lr", "1", "--threads", "1", "--no-progress",
            *extra]


def tiny_transformer_args(tmp_path: Path, *extra: str) -> list[str]:
    """A 4-layer transformer of width 32 on :func:`tiny_corpus`: 59 steps per epoch."""
    return ["--model", "transformer", "--width", "0.125", "--data", str(tiny_corpus(tmp_path)),
            "--batch-size", "4", "--bptt", "10", "--optimizer", "adamw", "--lr", "0.003",
            "--weight-decay", "0.1", "--schedule", "cosine", "--lr-warmup-epochs", "0.2",
            "--threads", "1", "--no-progress", *extra]


def llama_args(tmp_path: Path, *extra: str) -> list[str]:
    """A 1/16-width LLaMA on :func:`tiny_corpus` with a 280-token BPE cached under tmp_path."""
    return ["--model", "llama", "--width", "0.0625", "--data", str(tiny_corpus(tmp_path)),
            "--cache-dir", str(tmp_path / "cache"), "--vocab-size", "280", "--seq-len", "16",
            "--batch-size", "4", "--lr", "0.1", "--threads", "1", "--no-progress", *extra]


# -- running the CLI -------------------------------------------------------------------------

def port_slice() -> range:
    """This test process's own ports: outside the kernel's ephemeral range, one slice per
    pytest-xdist worker (``gw0``, ``gw1``, ...), so that neither a test running beside this one
    nor any process's automatic ``bind(0)`` (gloo's listeners, a bench's store) can pick them."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    below, above = range(10_000, max(low, 10_000)), range(max(high + 1, 10_000), 65_536)
    ports = max(below, above, key=len)  # the wider of the two ranges the kernel never hands out
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    span = len(ports) // max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    return range(ports.start + worker * span, ports.start + (worker + 1) * span)


_NEXT_PORT: list[int] = []


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a group's rendezvous port), from this worker's
    slice in turn, so that no port is handed out twice while an earlier run may still hold it."""
    ports = port_slice()
    if len(ports) < 100:  # the kernel hands out nearly every port: take one it picks
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    if not _NEXT_PORT:
        _NEXT_PORT.append(ports.start + os.getpid() % len(ports))
    for _ in range(len(ports)):
        port = _NEXT_PORT[0]
        _NEXT_PORT[0] = ports.start + (port + 1 - ports.start) % len(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def run_cli(*args: str, env: dict[str, str] | None = None, torchrun: int = 0,
            timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``pufferfish ARGS`` in a real process (under torchrun on ``torchrun`` processes if > 0)."""
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
               "--master-port", str(free_port()), "-m", "pufferfish", *args]
    else:
        cmd = [sys.executable, "-m", "pufferfish", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd)


def torchrun(nproc: int, *args: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC ARGS`` (a script or ``-m module``), 300 s at most."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``pufferfish ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# Warnings a plain `python` process does not print (Python's default warning filters): any other
# would be a line of stderr there.
SILENT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def cli_stderr(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """``pufferfish ARGV`` in this process, for a refusal: (exit status, the lines of stderr as a
    process of its own would print them). stderr is read at its file descriptor (C++ output
    counts) and a warning a real process would print is a line of it, so a one-line check is as
    strict as over :func:`run_cli`, without its ~2 s interpreter and torch import per case."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = cli(argv, capfd)
    shown = [f"{w.category.__name__}: {w.message}" for w in caught
             if not issubclass(w.category, SILENT)]
    return code, err.strip().splitlines() + shown


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    """Wait for a started process: (exit status, stdout, stderr); a hung one is killed, failing."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"process hung:\n{err[-3000:]}")
    return proc.returncode, out, err


def killed_and_resumed(args: list[str], tmp_path: Path, kill_step: int) -> tuple[Path, Path]:
    """``train args`` uninterrupted (``ref``) and SIGKILLed at ``kill_step`` then resumed
    (``run``): the two run directories, for a test to compare."""
    ref = tmp_path / "ref"
    assert run_cli("train", *args, "--out", str(ref)).returncode == 0
    run, marker = tmp_path / "run", tmp_path / "killed"
    killed = run_cli("train", *args, "--out", str(run), env={
        "PUFFERFISH_KILL_AT_STEP": str(kill_step), "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    resumed = run_cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    return ref, run


# -- what a run left -------------------------------------------------------------------------

def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def files_with_digests(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and its SHA-256: what "nothing was changed" compares."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def full_state(run: Path) -> tuple[dict, dict]:
    """The newest checkpoint of ``run``: its payload and its sharded part as full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    found = ck.latest_checkpoint(run)
    assert found is not None
    payload, path = found
    with tempfile.TemporaryDirectory() as tmp:  # not in the run: it may be shared
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(path.with_suffix(".dcp"), out)
        return payload, torch.load(out, weights_only=True)


# -- 2-process gloo groups in spawned workers --------------------------------------------------

def report_to_parent(rank: int, port: int, queue: Any, work: Any) -> None:
    """Worker side of :func:`run_worker_pair`: join a 2-process gloo group, put ``(rank,
    work())`` on ``queue`` (or the error's repr, so the parent fails instead of hanging), then
    a drained teardown and no interpreter shutdown (pufferfish.distributed.env)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    finished = False
    try:
        queue.put((rank, work()))
        finished = True
    except Exception as error:
        queue.put((rank, repr(error)))
        raise
    finally:
        queue.close()
        queue.join_thread()  # the result is sent before the process ends
        cleanup(drain=finished)
    exit_process(0)


def run_worker_pair(target: Any, timeout: float = 180) -> dict[int, Any]:
    """``target(rank, port, queue)`` in two spawned processes; rank -> the dict it put on the
    queue (a worker that failed puts its error's repr instead, which fails here)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, result in results.items():
        assert isinstance(result, dict), f"rank {rank}: {result}"
    return results


# -- the README's code blocks ----------------------------------------------------------------

def python_blocks() -> list[str]:
    """The README's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def block_kind(block: str) -> str:
    """Which integration a README python block shows: accelerate, hf, lightning or plain."""
    if "accelerator" in block:
        return "accelerate"
    if "transformers" in block:
        return "hf"
    if "lightning" in block:
        return "lightning"
    return "plain"


# -- time-to-accuracy inputs (bench accuracy and links) ----------------------------------------

# 12,800 examples over 2 workers at batch 64: 100 steps per epoch.
DDP_ROWS = [{"epoch": 1, "test_acc": 0.80, "lowrank": False},
            {"epoch": 2, "test_acc": 0.85, "lowrank": False},
            {"epoch": 3, "test_acc": 0.90, "lowrank": False}]
PUFF_ROWS = [{"epoch": 1, "test_acc": 0.80, "lowrank": False},
             {"epoch": 2, "test_acc": 0.891, "lowrank": True},
             {"epoch": 3, "test_acc": 0.896, "lowrank": True}]


def accuracy_runs() -> dict[str, acc.AccuracyRun]:
    """DDP_ROWS and PUFF_ROWS as the accuracy runs of 3 epochs at batch 64 on 12,800 examples."""
    return {"ddp": acc.AccuracyRun("ddp", "a", DDP_ROWS, 3, 64, 12_800),
            "pufferfish": acc.AccuracyRun("pufferfish", "b", PUFF_ROWS, 3, 64, 12_800)}


def write_train_run(path: Path, rows: list[dict[str, Any]], **overrides: Any) -> Path:
    """A `pufferfish train` run directory: its config.toml and metrics.jsonl."""
    values = {"model": "resnet18", "width": 0.25, "data": "fashion-mnist", "batch_size": 64,
              "epochs": 3, "train_subset": 12_800, "mode": "full", **overrides}
    path.mkdir(parents=True)
    (path / "config.toml").write_text(dump_toml(load_config(None, values)))
    writer = MetricsWriter(path)
    for row in rows:
        writer.write({**row, "epoch_time": 1.0})
    return path


# -- numbers ---------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius): how far an approximation ``a`` is from ``b``."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def set_diag(layer: nn.Linear, values: list[float]) -> None:
    """Make ``layer``'s weight diagonal with ``values``: a spectrum a test knows exactly."""
    with torch.no_grad():
        w = torch.zeros_like(layer.weight)
        w[range(len(values)), range(len(values))] = torch.tensor(values)
        layer.weight.copy_(w)


def bench_record(method: str, bw: str, rate: float | None, step: float, compute: float,
                 compress: float, nbytes: float, calls: float = 1.0) -> dict[str, Any]:
    """One 2-worker record of ``pufferfish bench`` as results.json holds it (a synthetic round:
    the report, the verdict and the projection read nothing else)."""
    return {"round": 0, "method": method, "bandwidth": bw, "bandwidth_bps": rate,
            "link_bps": rate, "workers": 2, "step_time": step, "compute_time": compute,
            "comm_time": step - compute, "compress_time": compress, "hook_time": 0.0,
            "bytes_per_step": nbytes, "ring_bytes_per_step": nbytes,
            "collectives_per_step": calls, "params": nbytes / 4,
            "factorized": method.startswith("pufferfish")}
