"""The torchrun environment and DDP (re-)wrapping. Knows nothing of low-rank layers.

``pufferfish train`` runs unchanged as one process or under ``torchrun``: torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and we join its group through
the ``env://`` rendezvous. One process (no ``WORLD_SIZE``) trains without a process group and
without DDP, through the same training loop.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import socket
import sys
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

__all__ = ["DistEnv", "all_reduce_sum", "broadcast_in_place", "broadcast_object", "cleanup", "collective_device", "ddp_of", "ddp_options", "exit_process",
           "gather_object", "gather_to_main", "gpu_id", "idle_cpus", "join_group", "local_ranks", "own_gpus", "pick_device",
           "rebuild_ddp_in_place", "rewrap_ddp", "say", "setup", "unwrapped", "wrap_ddp"]


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


def idle_cpus() -> int:
    """The CPUs this process may use that other processes are not busy on, at least 1.

    The default of ``--threads 0`` where a command computes on its own (``factorize``): torch's
    default, a thread per core, fights other processes for a loaded machine's cores (measured:
    ``factorize`` on 2 busy cores took 72 s with 2 threads, 13 s with 1).
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(torch.get_num_threads(), (cpus or 1) - busy))


def pick_device(requested: str, local_rank: int, cuda_count: int) -> torch.device:
    """The device of one process of a machine: ``auto`` is CUDA
    when there is a GPU (local rank ``r`` on GPU ``r mod cuda_count``), else the CPU (the
    backend is the job's answer: :func:`join_group`). ``ValueError`` (one line) for ``cuda``
    without a GPU or a device outside ``auto``, ``cpu``, ``cuda``."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {requested!r} is invalid: allowed auto, cpu, cuda")
    if requested == "cuda" and cuda_count < 1:
        raise ValueError("--device 'cuda' is invalid here: torch sees no CUDA device; allowed "
                         "auto or cpu")
    if requested == "cpu" or cuda_count < 1:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % cuda_count)


def local_ranks() -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` of this process (torchrun's; ``(0, 1)`` alone)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # without LOCAL_WORLD_SIZE (a launcher other than torchrun): one machine's processes
    return local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def setup(backend: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Join torchrun's process group if launched by it; pick the device and backend.

    The device is :func:`pick_device`'s: a GPU of this machine when CUDA is there, else the CPU;
    ``auto``'s backend is :func:`join_group`'s: NCCL when every process of the job has a GPU of
    its own, else gloo. ``timeout_s`` bounds every collective: a peer that vanished makes the
    others fail after it instead of hanging forever.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = local_ranks()[0]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = pick_device("auto", local_rank, count)
    if backend == "nccl" and not count:
        raise ValueError("backend 'nccl' needs CUDA, which is not available here: use gloo or auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(device=device)
    if dist.is_initialized():
        backend = str(dist.get_backend()).lower()
    else:
        backend = join_group(backend, device, rank, world_size, timeout_s)
    return DistEnv(rank, world_size, local_rank, device, backend)


_joins = 0  # this process's joins so far (train() twice in one process): a namespace each


def join_group(backend: str, device: torch.device, rank: int, world_size: int,
               timeout_s: float) -> str:
    """Start the default process group over torchrun's ``env://`` store; returns its backend.

    ``auto``: NCCL when every process of the job drives a GPU that no other drives, else gloo
    (processes sharing a GPU or a MIG-sliced one, which NCCL refuses, or a CPU). Why ask the job
    (:func:`own_gpus`, over a gloo group first): a count of the GPUs one process sees cannot
    tell 8 processes on one GPU from 8 that a scheduler bound to a GPU each (``srun`` with
    ``--gpus-per-task=1``), nor see another machine's; every process gets the same answer.
    """
    global _joins
    _joins += 1
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    # each group's keys its own: a group started again on the same store (a second join, or
    # NCCL after the gloo question) would otherwise read where the last one's peers listened
    store = dist.PrefixStore(f"pufferfish/join_{_joins}", _attempt_store(store))
    if backend == "auto":
        dist.init_process_group("gloo", timeout=timeout, store=dist.PrefixStore("ask", store),
                                rank=rank, world_size=world_size)
        if not own_gpus(gpu_id(device) if device.type == "cuda" else None):
            return "gloo"
        dist.destroy_process_group()  # the same processes again, over NCCL
        backend = "nccl"
    dist.init_process_group(backend, timeout=timeout, store=store, rank=rank,
                            world_size=world_size,
                            device_id=device if backend == "nccl" else None)
    return backend


def gpu_id(device: torch.device) -> str | None:
    """The GPU ``device`` is, across the job: its UUID, one per GPU whichever
    ``CUDA_VISIBLE_DEVICES`` or container shows it (without one: this machine's name and the
    index); None for a MIG slice, on which NCCL runs no rank (one rank per PCI device)."""
    props = torch.cuda.get_device_properties(device)
    if "MIG" in props.name or "MIG-" in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
        return None
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else f"{socket.gethostname()}/{device.index}"


def own_gpus(gpu: str | None) -> bool:
    """Whether each process of the default group drives a GPU of its own: every process's
    ``gpu`` (:func:`gpu_id`; None: none NCCL can use) gathered, the same answer on all."""
    ids: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, gpu)
    return None not in ids and len(set(ids)) == len(ids)


def _attempt_store(store: dist.Store) -> dist.Store:
    """torchrun's ``store``, namespaced by restart attempt after the first.

    Why: under ``torchrun --max-restarts`` (static rendezvous) the agent's TCPStore outlives the
    workers, and the process group's keys (where each rank's gloo pair listens) are the same in
    every attempt. A restarted rank can then read a peer's address from the *previous* attempt
    and fail with "connection refused", or wait for it until the timeout. Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` keeps the attempts apart. The count is the same on every
    worker of a static group (all are restarted together); if it is not in your setup (several
    nodes under a c10d rendezvous: an agent restarted by a membership change does not count
    it), set ``PUFFERFISH_ATTEMPT_PREFIX=0``.
    """
    try:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        restart = 0
    if (restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or os.environ.get("PUFFERFISH_ATTEMPT_PREFIX", "1") == "0"):
        return store
    return dist.PrefixStore(f"pufferfish/attempt_{restart}", store)


# Set once cleanup() tore a process group down in this process (see exit_process).
_torn_down = False


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
    only after every collective this rank launched before it has finished, and it returns only
    when every rank got there, so no rank tears down while a peer still sends to it, and pending
    work is done. It narrows the window but cannot close it: a future wakes its waiters before it
    drops its callbacks, so a descheduled gloo thread may release one later still.

    ``drain=False`` (an exception, possibly a lost peer): no barrier, since a peer that is gone or
    busy elsewhere would leave it hanging or mismatched; gloo can neither finish nor cancel work
    still in flight to a lost peer.

    Either way, end the process with :func:`exit_process`, which skips the interpreter shutdown
    that such a late release would abort.
    """
    global _torn_down
    if not dist.is_initialized():
        return
    if drain:
        with contextlib.suppress(RuntimeError):  # a peer vanished, or a collective before failed
            dist.barrier()
    dist.destroy_process_group()
    _torn_down = True


def exit_process(status: int) -> NoReturn:
    """End the process with ``status``, without interpreter shutdown once it had a process group.

    Why: even after :func:`cleanup`'s barrier, a gloo thread may still hold a comm hook's Python
    callback. A future wakes its waiters *before* it runs and drops its callbacks
    (``c10::ivalue::Future::markCompleted``), so the barrier, the teardown and the interpreter's
    shutdown can all happen while that thread is descheduled; its release then aborts the process
    (see :func:`cleanup`; measured: 1 abort in 225 benchmark worker groups with both cores busy,
    barrier alone). No wait from Python can close that window, so a process that used a group
    does not shut its interpreter down: it flushes ``logging`` and its standard streams and leaves
    with ``os._exit`` (``atexit`` handlers do not run). A process that never had a group gets
    ``sys.exit(status)``. A process started by a launcher for more than one process
    (``WORLD_SIZE`` > 1) counts as one that had a group, even when someone else destroyed it
    (``accelerator.end_training()``), since that leaves gloo's threads as they were. Call it
    only at a process's entry point (a script's last line), never from a library.
    """
    if _torn_down or dist.is_initialized() or _launched_with_peers():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # gone, closed, broken
                stream.flush()
        os._exit(status)
    sys.exit(status)


def _launched_with_peers() -> bool:
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def wrap_ddp(model: nn.Module, env: DistEnv, bucket_cap_mb: float | None = None) -> nn.Module:
    """Wrap ``model`` for data parallelism (identity on one process), with gradient buckets of
    ``bucket_cap_mb`` MiB (None: torch's default, see :mod:`pufferfish.distributed.buckets`).

    DDP's constructor broadcasts rank 0's parameters and buffers, so every replica starts from the
    same weights: after a switch to the factorized model this is what makes the replicas identical
    even if the SVDs differed in the last bit across ranks.
    """
    if not env.distributed:
        return model
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)


def ddp_options(ddp: DistributedDataParallel) -> dict[str, Any]:
    """The constructor arguments that rebuild ``ddp``'s configuration around a changed module.

    DDP keeps its options as attributes under other names (``bucket_cap_mb`` as
    ``bucket_bytes_cap``, ``static_graph`` set by ``_set_static_graph``) or not at all; this reads
    each back, and keeps only the arguments the installed DDP accepts. Two are not kept:
    ``init_sync`` is always on (a re-wrapped model must start equal on every rank: DDP
    broadcasts rank 0's parameters) and the deprecated no-op ``check_reduction``. A wrapper built
    with ``delay_all_reduce_named_params`` cannot be rebuilt (DDP does not keep
    ``param_to_hook_all_reduce``): ValueError.
    """
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise ValueError("a DistributedDataParallel built with delay_all_reduce_named_params cannot "
                         "be re-wrapped (DDP does not keep param_to_hook_all_reduce): allowed are "
                         "wrappers without it")
    options: dict[str, Any] = {
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
        "dim": ddp.dim,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": bool(getattr(ddp, "static_graph", getattr(ddp, "_static_graph", False))),
        "mixed_precision": getattr(ddp, "mixed_precision", None),
        "skip_all_reduce_unused_params": getattr(ddp, "skip_all_reduce_unused_params", False),
        "batched_grad_copy": getattr(ddp, "batched_grad_copy", False),
    }
    if getattr(ddp, "device_mesh", None) is not None:
        options["device_mesh"] = ddp.device_mesh
    else:
        options["process_group"] = ddp.process_group
    if not ddp.broadcast_buffers:
        # Not forward_sync_buffers=False, which would overwrite every rank's buffers with rank 0's
        # at construction: buffers the user keeps per rank stay per rank.
        options["broadcast_buffers"] = False
    mb = 1024 * 1024  # DDP's MiB
    if getattr(ddp, "bucket_bytes_cap_list", None):
        options["bucket_cap_mb_list"] = [cap / mb for cap in ddp.bucket_bytes_cap_list]
    elif not getattr(ddp, "bucket_bytes_cap_default", False):
        options["bucket_cap_mb"] = ddp.bucket_bytes_cap / mb
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    return {k: v for k, v in options.items() if k in accepted}


def unwrapped(model: nn.Module) -> nn.Module:
    """The module under any DDP and ``torch.compile`` wrappers (``compile(DDP(m))``, the order
    torch recommends and Accelerate builds, or ``DDP(compile(m))``): the one to factorize."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


def ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper that ``model`` is, or that ``torch.compile``'s wrapper ``model`` holds
    (whose reducer must be rebuilt after a switch); None without one."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def rewrap_ddp(ddp: DistributedDataParallel, register_hooks: bool = True,
               **overrides: Any) -> DistributedDataParallel:
    """A new DDP wrapper around ``ddp.module`` (changed in place) with all of ``ddp``'s options.

    Needed after the module's parameters were replaced: DDP's reducer, buckets and broadcasts
    are built from the parameters at construction. Options are carried over by
    :func:`ddp_options`; the construction broadcasts rank 0's parameters (and buffers, unless the
    user turned buffer syncing off). With ``register_hooks``, every communication hook the user
    registered on ``ddp`` is registered again, the same callable with the same state object (the
    user's reference to it stays live): hook states that follow their parameters across DDP's
    re-bucketing, such as :mod:`pufferfish.distributed.hooks`'s, carry on; torch's
    ``PowerSGDState``, whose memory is keyed by bucket index only, has that memory cleared and
    restarts its vanilla all-reduce warm-up (``start_powerSGD_iter``), which is how torch
    copes with the first re-bucketing. Hooks registered with DDP's private
    ``_register_builtin_comm_hook`` are not carried over. ``ddp`` must not be used afterwards.
    ``overrides`` replace constructor arguments (new buckets; ``init_sync=False`` where the
    replicas are known to be equal), those the installed DDP does not take are dropped.
    """
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    options = {**ddp_options(ddp), **{k: v for k, v in overrides.items() if k in accepted}}
    module = ddp.module
    _detach_wrapper(ddp)
    with warnings.catch_warnings():  # our choice, not the user's: see ddp_options
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated",
                                category=FutureWarning)
        new = DistributedDataParallel(module, **options)
    if register_hooks:
        for hook, state in getattr(ddp, "_comm_hooks", []):
            if _made_by_ddp(state, ddp):  # mixed precision, optimizer in backward: DDP's own
                continue
            _forget_buckets(state)
            new.register_comm_hook(state, hook)
    return new


def rebuild_ddp_in_place(ddp: DistributedDataParallel, register_hooks: bool = True,
                         **overrides: Any) -> DistributedDataParallel:
    """Rebuild ``ddp`` around its changed module on the SAME wrapper object; return it.

    For code that cannot swap in a new wrapper: a trainer's loop holds the wrapper in a local
    variable (Hugging Face's ``_inner_training_loop``), in ``accelerator._models`` and in
    ``trainer.model_wrapped``; every holder keeps working because the object stays the same. It
    is :func:`rewrap_ddp` without the new object: the old reducer's autograd hooks are removed,
    DDP's own constructor runs again on ``ddp`` with :func:`ddp_options` (so reducer, buckets,
    parameter lists and the broadcast of rank 0's parameters are exactly those of a fresh
    wrapper of this torch version), then what belongs to the wrapper as an ``nn.Module`` and not
    to DDP (its train/eval mode, hooks registered on it, other attributes set on it) is put back,
    and with ``register_hooks`` the comm hooks are registered again (see :func:`rewrap_ddp`;
    ``overrides`` as there). Call it on every rank at the same point, outside forward/backward.
    """
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    options = {**ddp_options(ddp), **{k: v for k, v in overrides.items() if k in accepted}}
    hooks = list(getattr(ddp, "_comm_hooks", []))
    module = ddp.module
    _detach_wrapper(ddp)
    reducer = getattr(ddp, "reducer", None)
    if reducer is not None and hasattr(reducer, "_remove_autograd_hooks"):
        reducer._remove_autograd_hooks()  # kept parameters must not call the old reducer
    own = {k: v for k, v in vars(ddp).items() if k in _MODULE_FIELDS}  # nn.Module's, not DDP's
    with warnings.catch_warnings():  # our choice, not the user's: see ddp_options
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated",
                                category=FutureWarning)
        DistributedDataParallel.__init__(ddp, module, **options)
    vars(ddp).update(own)  # the same dicts: hooks and submodule registry ("module" is unchanged)
    if register_hooks:
        for hook, state in hooks:
            if _made_by_ddp(state, ddp):
                continue
            _forget_buckets(state)
            ddp.register_comm_hook(state, hook)
    return ddp


# What nn.Module.__init__ sets: mode, hook registries, parameter/buffer/submodule dicts.
_MODULE_FIELDS = frozenset(vars(nn.Module()))


def _made_by_ddp(state: Any, ddp: DistributedDataParallel) -> bool:
    ref = state if isinstance(state, weakref.ref) else getattr(state, "ddp_weakref", None)
    return isinstance(ref, weakref.ref) and ref() is ddp


def _forget_buckets(state: Any) -> None:
    if isinstance(state, PowerSGDState):
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        state.iter = 0


def _detach_wrapper(ddp: DistributedDataParallel) -> None:
    """Remove the hooks ``ddp`` put on its module's tensors and submodules (they call ``ddp``)."""
    for handle in getattr(ddp, "_accum_grad_hooks", []):
        handle.remove()
    for module in ddp.module.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if getattr(hook, "__self__", None) is ddp:  # mixed precision's copy hooks
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few numbers over ranks (metrics); identity on one process."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj: Any, env: DistEnv | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (decisions that must agree, e.g. the switch epoch).

    Without ``env``: over the default process group if one is initialized (a user's own loop).
    """
    if not (env.distributed if env is not None else dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor made for a collective of ``group`` must live: this process's GPU under
    NCCL (which takes no CPU tensor; torchrun's ``LOCAL_RANK``'s, as :func:`pick_device` gives
    it, for a user's loop that never made it the current device), else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        if "LOCAL_RANK" in os.environ:
            return pick_device("cuda", local_ranks()[0], torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_in_place(tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0's values into every rank's ``tensors``, in place, over the default group (nothing
    on one process). For what each rank computed from equal inputs but need not get bitwise equal
    (an SVD on a GPU): replicas must hold the same numbers."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.detach(), src=0)


def gather_object(obj: Any, env: DistEnv) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` on one process)."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj: Any, env: DistEnv) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on rank 0 only (None elsewhere; ``[obj]`` on one
    process): what only rank 0 writes, without every rank receiving every rank's copy."""
    if not env.distributed:
        return [obj]
    out: list[Any] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def say(env: DistEnv, text: str) -> None:
    """Print on rank 0 only (every rank runs the same code; one copy of each line is enough),
    above any progress bar (``tqdm.write``), never inside a bar's line."""
    if env.is_main:
        tqdm.write(text)
        sys.stdout.flush()
