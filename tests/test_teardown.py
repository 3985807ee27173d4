"""Tearing down a gloo group while a collective's Python callback is still to run.

The comm hooks chain Python callbacks onto gloo futures (``fut.then``); gloo runs and releases
them on its own worker threads, taking the GIL. If that happens after the interpreter began to
shut down, Python ends the thread inside ``take_gil`` and torch's ``noexcept`` callback guard turns
that into ``std::terminate``: "terminate called ...", SIGABRT (the flaky abort of the comm-hook
tests and of ``pufferfish bench`` workers). The tests force that order deterministically: rank 1
leaves an all-reduce with a Python callback pending and tears down; rank 0 joins the all-reduce
only once rank 1's interpreter is shutting down (a module global's ``__del__`` tells it). Real
processes, a real 2-process gloo group with a DDP wrapper and comm hook, as in training.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import types
import weakref
from datetime import timedelta
from pathlib import Path

# The group's timeout once both ranks are up: how long rank 1's pending all-reduce waits for rank 0
# under cleanup() (rank 0 joins only after rank 1's shutdown began), and how long rank 0 waits for
# rank 1's part. Elsewhere rank 1's all-reduce must stay pending until rank 0 joins, whatever the
# machine's load: a long timeout.
PENDING_TIMEOUT_S = 2
LONG_TIMEOUT_S = 120


def _wait_for(*paths: Path, limit_s: float = 120.0) -> None:
    """Poll until one of ``paths`` exists (a safety limit, not part of any assertion)."""
    end = time.monotonic() + limit_s
    while not any(p.exists() for p in paths) and time.monotonic() < end:
        time.sleep(0.01)


class _SignalAtShutdown:
    """Its ``__del__`` tells rank 0 that rank 1's interpreter is shutting down.

    It keeps what it needs on the instance (module globals may already be cleared by then), and
    the DDP wrapper: as a training script's model and hook state do, that keeps the group alive
    after ``destroy_process_group``, so it is not destroyed by the garbage collection that
    precedes the modules' teardown (its destructor would wait for the pending all-reduce).
    """

    def __init__(self, tmp: Path, ddp: object) -> None:
        self.finalizing, self.joined, self.wait_for = tmp / "finalizing", tmp / "joined", _wait_for
        self.ddp = ddp

    def __del__(self) -> None:
        self.finalizing.touch()
        self.wait_for(self.joined)  # keep the process alive until rank 0 joined


def _worker(rank: int, tmp: Path, teardown: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from pufferfish.distributed.env import cleanup, exit_process
    from pufferfish.distributed.hooks import register_comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    register_comm_hook(ddp, "allreduce")
    ddp(torch.ones(3, 4)).sum().backward()
    waits_long = rank == 1 and teardown != "cleanup+exit"
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=LONG_TIMEOUT_S if waits_long
                                                    else PENDING_TIMEOUT_S))
    if rank == 0:
        _wait_for(tmp / "finalizing", tmp / "rank1_exited")
        # Completes rank 1's pending all-reduce if it still is; fails if rank 1 gave up or left.
        with contextlib.suppress(RuntimeError):
            dist.all_reduce(torch.ones(1))
        (tmp / "joined").touch()
        cleanup(drain=False)
        exit_process(0)

    def callback(fut: torch.futures.Future) -> torch.Tensor:
        return fut.value()[0]

    released = tmp / "callback_released"
    weakref.finalize(callback, released.touch).atexit = False  # runs where gloo drops it
    dist.all_reduce(torch.ones(1), async_op=True).get_future().then(callback)
    del callback
    # Held only by a module in sys.modules: the interpreter drops those once its shutdown began.
    # (Not a global here: the pending callback keeps this script's globals alive to the end.)
    holder = types.ModuleType("_teardown_signal")
    holder.signal = _SignalAtShutdown(tmp, ddp)
    sys.modules[holder.__name__] = holder
    del holder
    if teardown == "bare":  # what the comm-hook test workers did before
        dist.destroy_process_group()
    elif teardown == "cleanup+exit":  # the success path of `pufferfish train` and the bench
        cleanup()
        print("flushed before os._exit", flush=False)
        exit_process(0)
    else:  # the failure path of `pufferfish train`
        cleanup(drain=False)
        print(f"callback released at exit: {released.exists()}", flush=True)
        exit_process(1)
    print(f"callback released at exit: {released.exists()}", flush=True)


def _run_pair(tmp: Path, teardown: str) -> subprocess.CompletedProcess:
    """Start both ranks; rank 1's result (its exit status, output and errors)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(tmp), teardown], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    out, err = procs[1].communicate(timeout=300)
    (tmp / "rank1_exited").touch()
    procs[0].communicate(timeout=300)
    return subprocess.CompletedProcess(procs[1].args, procs[1].returncode, out, err)


def test_bare_destroy_aborts_when_a_callback_outlives_the_interpreter(tmp_path: Path) -> None:
    """The failing order itself (torch 2.x behaviour): why a bare teardown is not enough."""
    result = _run_pair(tmp_path, "bare")
    assert result.returncode == -6, (result.returncode, result.stderr[-2000:])  # SIGABRT
    assert "terminate called" in result.stderr


def test_a_process_that_had_a_group_exits_without_interpreter_shutdown(tmp_path: Path) -> None:
    """cleanup()'s barrier cannot wait for a callback's release (a future wakes its waiters first):
    with a normal interpreter shutdown after it, this order aborted 1 run in 30 under load. So
    exit_process never lets the interpreter shut down after a group: no late release can abort
    it. Output written before is still flushed."""
    result = _run_pair(tmp_path, "cleanup+exit")
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr[-2000:]
    assert "flushed before os._exit" in result.stdout
    assert not (tmp_path / "finalizing").exists()  # no interpreter shutdown ran


def test_undrained_teardown_exits_without_interpreter_shutdown(tmp_path: Path) -> None:
    """After a failure (no drain) the work stays pending; exit_process still exits cleanly."""
    result = _run_pair(tmp_path, "undrained")
    assert "terminate called" not in result.stderr
    assert result.returncode == 1, result.stderr[-2000:]
    assert "callback released at exit: False" in result.stdout  # it was pending at exit
    assert not (tmp_path / "finalizing").exists()  # no interpreter shutdown ran


def test_every_script_that_starts_a_group_ends_without_interpreter_shutdown() -> None:
    """The entry points of the package, its benchmarks and the tests' workers that start a gloo
    group end with ``exit_process`` (the bench's torch-only probe with ``os._exit``): one
    that shuts its interpreter down aborts now and then under load (1 in ~50 FSDP2 worker
    groups before its worker ended this way). No test starts a group in the test runner's own
    process either: its gloo threads would stay for the rest of the suite (it aborted once)."""
    root = Path(__file__).resolve().parent.parent
    scripts = [p for d in ("pufferfish", "benchmarks", "tests") for p in (root / d).rglob("*.py")
               if "init_process_group(" in p.read_text() and p.name != Path(__file__).name]
    assert len(scripts) >= 5, scripts
    missing = [str(p.relative_to(root)) for p in scripts
               if "exit_process(" not in p.read_text() and "os._exit(" not in p.read_text()]
    assert not missing, missing


if __name__ == "__main__":
    _worker(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
