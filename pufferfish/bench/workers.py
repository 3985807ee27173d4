"""Launching one process per rank, over an :class:`~.netns.EmulatedLink` or loopback.

Each rank gets the torch.distributed environment, its output goes to temp files, a failed
rank brings the others down after a grace period, and every rank is registered in
:mod:`.cleanup` so nothing outlives the bench.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from .cleanup import install_handlers, kill_running, live_procs
from .netns import EmulatedLink

__all__ = ["WorkerTimeout", "run_workers"]

# Fixed port for rank 0 inside a fresh namespace: each namespace has its own port
# space, so nothing else can be listening there.
_NETNS_MASTER_PORT = 29500


class WorkerTimeout(subprocess.TimeoutExpired):
    """All workers were killed because they did not finish within ``timeout``.

    ``results`` holds the (killed) workers' CompletedProcess objects with whatever
    they printed, which is usually what you need to see why they hung.
    """

    def __init__(
        self, cmd: list[str], timeout: float, results: list[subprocess.CompletedProcess[str]]
    ) -> None:
        tail = "\n".join(f"[rank {r}] {p.stderr[-2000:]}" for r, p in enumerate(results))
        super().__init__(cmd, timeout, output=None, stderr=tail)
        self.results = results

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr}"


def run_workers(
    link: EmulatedLink | None,
    argv_for_rank: Callable[[int], list[str]],
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    world_size: int = 2,
    fail_fast_grace: float = 5.0,
) -> list[subprocess.CompletedProcess[str]]:
    """Run one process per rank, each in its namespace, wired up for torch.distributed.

    Every rank gets ``MASTER_ADDR`` (endpoint 0), ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` (its rank: one machine's processes), ``LOCAL_WORLD_SIZE`` and
    ``GLOO_SOCKET_IFNAME`` (and NCCL's, over a link, with NCCL's same-machine paths switched
    off).  With ``link=None`` the same thing runs on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``) so
    the benchmark has a single code path for loopback and emulated conditions.

    If a rank exits non-zero the others would block in a collective until gloo's
    30-minute timeout, so they are killed after ``fail_fast_grace`` seconds.  On
    ``timeout`` all ranks are killed and :class:`WorkerTimeout` is raised; on
    KeyboardInterrupt all ranks are killed and the interrupt propagates.  Returns one
    CompletedProcess per rank (stdout/stderr captured as text); the caller checks
    ``returncode``.
    """
    install_handlers()  # SIGTERM/atexit also kill loopback workers
    workers: list[_Worker] = []
    with contextlib.ExitStack() as files:
        master_addr, port, world_size, store_env = files.enter_context(
            _rendezvous(link, master_port, world_size))
        try:
            for rank in range(world_size):
                argv = _worker_argv(rank, argv_for_rank, link)
                wenv = _worker_env(rank, world_size, master_addr, port, link,
                                   {**(env or {}), **store_env})
                # Temp files, not pipes: a chatty worker can never block on a full pipe.
                out = files.enter_context(tempfile.TemporaryFile())
                err = files.enter_context(tempfile.TemporaryFile())
                workers.append(_start_worker(argv, wenv, out, err))
            timed_out = _wait_for_exit([w.proc for w in workers], timeout, fail_fast_grace)
        except BaseException:  # KeyboardInterrupt included: never leave ranks behind
            _kill_and_reap([w.proc for w in workers])
            raise
        finally:
            live_procs.difference_update([w.proc for w in workers])
        results = [w.result() for w in workers]
    if timed_out:
        raise WorkerTimeout(workers[0].argv, timeout, results)
    return results


@contextlib.contextmanager
def _rendezvous(
    link: EmulatedLink | None, master_port: int | None, world_size: int
) -> Iterator[tuple[str, int, int, dict[str, str]]]:
    """``(MASTER_ADDR, MASTER_PORT, world size, environment)`` while the ranks run.

    On loopback without a given port, this process hosts the ranks' TCPStore on a port the
    kernel picks and holds (torchrun's agent store): a port merely found free could be taken
    by another process (a second bench, any ``bind(0)``) before rank 0 bound it. In a link's
    fresh namespace nothing else listens, so rank 0 hosts the store on a fixed port.
    """
    rank0_hosts = {"TORCHELASTIC_USE_AGENT_STORE": "False"}  # even if this process's env says so
    if link is not None:
        if link.closed:
            raise RuntimeError("EmulatedLink is closed")
        port = master_port if master_port is not None else _NETNS_MASTER_PORT
        yield link.addresses[0], port, link.n_endpoints, rank0_hosts
    elif master_port is not None:
        yield "127.0.0.1", master_port, world_size, rank0_hosts
    else:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        try:
            yield "127.0.0.1", store.port, world_size, {"TORCHELASTIC_USE_AGENT_STORE": "True"}
        finally:
            del store


def _worker_argv(
    rank: int, argv_for_rank: Callable[[int], list[str]], link: EmulatedLink | None
) -> list[str]:
    """The rank's command, wrapped to run inside its namespace when there is a link."""
    argv = list(argv_for_rank(rank))
    return link.command(rank, argv) if link is not None else argv


def _worker_env(
    rank: int,
    world_size: int,
    master_addr: str,
    port: int,
    link: EmulatedLink | None,
    env: Mapping[str, str] | None,
) -> dict[str, str]:
    """This environment, then ``env``, then the torch.distributed variables and interface."""
    wenv = dict(os.environ)
    if env:
        wenv.update(env)
    wenv.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            # the ranks are this machine's processes: each takes its own GPU where there are
            # enough (distributed.env.pick_device), as torchrun's would
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    if link is not None:
        wenv.update(link.env(rank))
        # NCCL between GPUs of one machine takes shared memory, peer-to-peer copies, NVLink
        # SHARP or InfiniBand (which namespaces do not isolate), around the emulated link:
        # switched off, its traffic goes over the veth's sockets as gloo's does.
        for key, value in (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"),
                           ("NCCL_NVLS_ENABLE", "0"), ("NCCL_IB_DISABLE", "1"),
                           ("NCCL_NET", "Socket")):
            wenv.setdefault(key, value)
    else:
        wenv.update({"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"})
    return wenv


@dataclass
class _Worker:
    """One launched rank: its command, its process and the files holding its output."""

    argv: list[str]
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]

    def result(self) -> subprocess.CompletedProcess[str]:
        """The finished (or killed) rank's exit code and output, decoded as text."""
        self.out.seek(0)
        self.err.seek(0)
        stdout = self.out.read().decode(errors="replace")
        stderr = self.err.read().decode(errors="replace")
        return subprocess.CompletedProcess(self.argv, int(self.proc.returncode), stdout, stderr)


def _start_worker(argv: list[str], wenv: dict[str, str], out: IO[bytes], err: IO[bytes]) -> _Worker:
    """Launch one rank in its own session (so it can be killed with its children)."""
    proc = subprocess.Popen(
        argv, env=wenv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
    )
    live_procs.add(proc)
    return _Worker(argv, proc, out, err)


def _wait_for_exit(
    procs: Sequence[subprocess.Popen[bytes]], timeout: float, fail_fast_grace: float
) -> bool:
    """Wait until every rank has exited; return whether ``timeout`` ran out first.

    Once a rank has failed, the rest are killed after ``fail_fast_grace`` seconds; at the
    deadline all are killed and reaped.
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > fail_fast_grace:
            kill_running(procs)
        if now > deadline:
            _kill_and_reap(procs, timeout=None)
            return True
        time.sleep(0.02)


def _kill_and_reap(procs: Sequence[subprocess.Popen[bytes]], timeout: float | None = 10) -> None:
    """Kill every running rank and wait for it (``timeout`` seconds each, if not ``None``)."""
    kill_running(procs)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=timeout)

