"""The torchrun environment and DDP (re-)wrapping. Knows nothing of low-rank layers.

``pufferfish train`` runs unchanged as one process or under ``torchrun``: torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and we join its group through
the ``env://`` rendezvous. One process (no ``WORLD_SIZE``) trains without a process group and
without DDP, through the same training loop.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DistEnv", "all_reduce_sum", "broadcast_object", "cleanup", "exit_process", "gather_object",
           "say", "setup", "wrap_ddp"]


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: a single process, no process group

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(backend: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Join torchrun's process group if launched by it; pick the device and backend.

    ``auto`` means NCCL when CUDA is available and gloo otherwise. ``timeout_s`` bounds every
    collective: a peer that vanished makes the others fail after it instead of hanging forever.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA, which is not available here: use gloo or auto")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(device=device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _attempt_store(rank, world_size, timeout)
        dist.init_process_group(backend, timeout=timeout, store=store,
                                rank=rank if store is not None else -1,
                                world_size=world_size if store is not None else -1,
                                device_id=device if backend == "nccl" else None)
    return DistEnv(rank, world_size, local_rank, device, backend)


def _attempt_store(rank: int, world_size: int,
                   timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's store, namespaced by restart attempt; None for the plain ``env://`` path.

    Why: under ``torchrun --max-restarts`` (static rendezvous) the agent's TCPStore outlives the
    workers, and the process group's keys (where each rank's gloo pair listens) are the same in
    every attempt. A restarted rank can then read a peer's address from the *previous* attempt
    and fail with "connection refused", or wait for it until the timeout. Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` keeps the attempts apart. The count is the same on every
    worker of a static group (all are restarted together); if it is not in your setup (nodes
    joining a c10d rendezvous, which gives each round a fresh store anyway), set
    ``PUFFERFISH_ATTEMPT_PREFIX=0``.
    """
    try:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        restart = 0
    if (restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or os.environ.get("PUFFERFISH_ATTEMPT_PREFIX", "1") == "0"):
        return None
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"pufferfish/attempt_{restart}", store)


# Set when a process group was torn down without draining its communication (see cleanup).
_undrained = False


def cleanup(drain: bool = True) -> None:
    """Tear down the process group so that none of its communication outlives it.

    Why: gloo runs every collective on its own worker threads, and the Python callbacks that the
    comm hooks chain onto a collective's future (``fut.then(...)``) run *and are released* there,
    each release taking the GIL. A worker thread is still busy with that for a moment after the
    future has woken the main thread, longer when the machine is loaded, and for as long as the
    collective is pending. If the interpreter starts shutting down meanwhile, Python ends the
    thread inside ``take_gil`` with ``pthread_exit``; its unwinding reaches torch's ``noexcept``
    ``~PythonFunctionGuard`` and ``std::terminate`` aborts the process: "terminate called without
    an active exception", SIGABRT, exit status 134, after a run that had succeeded.
    ``destroy_process_group`` alone neither waits for that nor stops the threads: once a DDP
    wrapper has been built, gloo's threads stay alive after it (torch keeps a reference).

    ``drain=True`` (every rank finished the same work): a barrier first. gloo starts a barrier
    only after every collective this rank launched before it has finished, callbacks and their
    release included, and it returns only when every rank got there, so no rank tears down while
    a peer still sends to it. Only then is the group destroyed.

    ``drain=False`` (an exception, possibly a lost peer): no barrier, since a peer that is gone or
    busy elsewhere would leave it hanging or mismatched. gloo can neither finish nor cancel work
    still in flight to a lost peer, so the process must not shut its interpreter down normally
    afterwards: leave it with :func:`exit_process`. A barrier that fails counts as the same case.
    """
    global _undrained
    if not dist.is_initialized():
        return
    if drain:
        try:
            dist.barrier()
        except RuntimeError:  # a peer vanished after the end, or a collective before failed
            drain = False
    dist.destroy_process_group()
    _undrained = _undrained or not drain


def exit_process(status: int) -> NoReturn:
    """End the process with ``status``; without interpreter shutdown if communication may remain.

    After :func:`cleanup` could not drain the group (``drain=False`` or a failed barrier), a gloo
    thread may still be waiting on a lost peer and run Python callbacks later, which aborts a
    shutting-down interpreter (see :func:`cleanup`). Then the process flushes its output and
    leaves with ``os._exit``: no ``atexit`` handlers, no module teardown, and no abort. Otherwise
    this is ``sys.exit(status)``. Call it only at a process's entry point, never from a library.
    """
    if _undrained:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # gone, closed, broken
                stream.flush()
        os._exit(status)
    sys.exit(status)


def wrap_ddp(model: nn.Module, env: DistEnv) -> nn.Module:
    """Wrap ``model`` for data parallelism (identity on one process).

    DDP's constructor broadcasts rank 0's parameters and buffers, so every replica starts from the
    same weights: after a switch to the factorized model this is what makes the replicas identical
    even if the SVDs differed in the last bit across ranks.
    """
    if not env.distributed:
        return model
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few numbers over ranks (metrics); identity on one process."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj: Any, env: DistEnv) -> Any:
    """Rank 0's ``obj`` on every rank (decisions that must agree, e.g. the switch epoch)."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj: Any, env: DistEnv) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` on one process)."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def say(env: DistEnv, text: str) -> None:
    """Print on rank 0 only (every rank runs the same code; one copy of each line is enough)."""
    if env.is_main:
        print(text, flush=True)
