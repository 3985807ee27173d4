"""Sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``), applied from outside.

Units: :func:`fsdp_units` picks them by one generic rule, the same for every model: each child with
parameters of an ``nn.ModuleList`` / ``nn.Sequential`` is a unit (ResNet's residual blocks, a
transformer's layers, VGG's layers), the outermost such container winning; the root is the last
unit and holds what is left (stem, head; the whole LSTM). :func:`shard` applies ``fully_shard`` to
each unit, then the root.

After a change of the model (new, unsharded modules swapped into a sharded one),
:func:`shard` again shards what is new: every unit that holds an unsharded parameter is rebuilt
(its FSDP2 state removed, its kept parameters gathered *for that unit only*, ``fully_shard`` applied
again), then the root, so that its lazy initialization sees the new units. FSDP2 has no public
"un-shard" call; :func:`_remove_fsdp` is the one place that knows its internals (torch 2.13).

:func:`gathered` gives one module's full weights for a moment (``DTensor.full_tensor()``), which is
how a switch reads dense weights one layer at a time (every process then takes rank 0's SVD
factors, :func:`pufferfish.distributed.env.broadcast_in_place`, before they are sharded).

Buffers (BatchNorm statistics) are not sharded and FSDP2 does not synchronize them; as DDP does
with ``broadcast_buffers``, the first process's buffers are broadcast (over the processes that
shard the model) before every forward of the root in training mode, so they agree (evaluation,
checkpoints).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "FsdpBytes",
    "comm_bytes",
    "fsdp_units",
    "gathered",
    "is_dtensor",
    "is_fsdp_module",
    "is_sharded",
    "load_sharded_state",
    "local",
    "mixed_precision",
    "shard",
    "sharded_state",
    "sharded_state_bytes",
    "step_figures",
    "unwrap_layers",
]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor. ``torch.distributed.tensor`` and ``torch.distributed.fsdp``
    take 0.8 s to import; they are imported where sharding begins, not by ``import pufferfish``
    (a refusal, ``factorize`` or a 1-process run never needs them), and no tensor or module can
    be theirs before they are imported."""
    found = sys.modules.get("torch.distributed.tensor")
    return found is not None and isinstance(t, found.DTensor)


def is_fsdp_module(module: object) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (see :func:`is_dtensor`)."""
    found = sys.modules.get("torch.distributed.fsdp")
    return found is not None and isinstance(module, found.FSDPModule)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or to modules in it (a Lightning module
    whose ``configure_model`` shards its network)."""
    return any(is_fsdp_module(m) for m in model.modules())


def _roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules of ``model``: each is the root of its own units."""
    roots: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if is_fsdp_module(module):
            roots.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return roots


def fsdp_units(model: nn.Module) -> list[str]:
    """Qualified names of the FSDP units below the root (the root is the last unit, not listed).

    Each child with parameters of an ``nn.ModuleList`` or ``nn.Sequential`` is a unit, and nothing
    inside a unit is one (outermost container wins): ResNet-18 gets its 8 residual blocks, the
    transformer LM its encoder layers, VGG each conv/BN/linear layer, the LSTM LM none.
    """
    units: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            if isinstance(module, nn.ModuleList | nn.Sequential) and module is not model \
                    and any(True for _ in child.parameters()):
                units.append(qual)
            else:
                visit(child, qual + ".")

    visit(model, "")
    return units


def mixed_precision(device: torch.device, amp: bool, model: nn.Module) -> MixedPrecisionPolicy:
    """With ``--amp``, parameters in its autocast's dtype (fp16 on CUDA, bf16 on the CPU: see
    training/precision.py), gradients reduced in fp32; without it, none (full precision). A model
    with BatchNorm keeps fp32 parameters (autocast alone): its running statistics stay fp32, and
    batch_norm refuses them beside lower-precision weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.modules.batchnorm import _BatchNorm

    if not amp or any(isinstance(m, _BatchNorm) for m in model.modules()):
        return MixedPrecisionPolicy()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(model: nn.Module, mp_policy: MixedPrecisionPolicy | None = None,
          reshard_after_forward: bool = True, mesh: DeviceMesh | None = None) -> nn.Module:
    """``fully_shard`` every unit of :func:`fsdp_units`, then the root; returns ``model``.

    ``mesh``: the 1-D mesh to shard over (default: every process); its group also shares the
    buffers (DiLoCo over FSDP2 shards within a machine: :mod:`.replicas`). On a model already
    sharded (after a switch), rebuilds only the units that hold unsharded parameters, then the
    root (see the module docs), with the options the root had.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        for root in _roots(model):
            _rebuild(root)
        return model
    mp = mp_policy or MixedPrecisionPolicy()
    for name in fsdp_units(model):
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: unsharded between fwd and bwd
    model.__dict__[_BUFFER_GROUP] = None if mesh is None else mesh.get_group()
    model.register_forward_pre_hook(_sync_buffers)
    return model


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """No reduce-scatter in the backward passes within: the unsharded gradients accumulate
    (gradient accumulation; FSDP2's ``set_requires_gradient_sync``), synchronized again after."""
    roots = _roots(model)
    for root in roots:
        root.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)  # type: ignore[operator]


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor, or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as DTensors by qualified name, for ``torch.distributed.checkpoint``
    (no gather: each rank holds its shards); the buffers are rank 0's, as in a DDP checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _broadcast_buffers(model)

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                       state: dict[str, Any]) -> None:
    """Put :func:`sharded_state` (filled by a DCP load) back into ``model`` and ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def unwrap_layers(model: nn.Module, replaced: Callable[[type], bool]) -> None:
    """Remove FSDP2 from units that are single layers the switch replaces (a user's
    ``fully_shard(linear)``), gathering that layer's weights; :func:`shard` makes the module at
    the same name a unit again (remembered on the root)."""
    for root in _roots(model):
        names = [n for n, m in root.named_modules() if m is not root
                 and is_fsdp_module(m) and replaced(_original_class(m))]
        if names:
            root.__dict__.setdefault(_OPTIONS, _options(root))  # the mesh, while units have it
        for name in names:
            _remove_fsdp(root.get_submodule(name))
        root.__dict__.setdefault(_LAYER_UNITS, set()).update(names)


_LAYER_UNITS, _OPTIONS = "_pufferfish_layer_units", "_pufferfish_fsdp_options"
_BUFFER_GROUP = "_pufferfish_buffer_group"  # the processes that share one model's shards


def _original_class(module: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    return type(module).__mro__[FSDPModule._orig_cls_mro_index]


def _rebuild(root: nn.Module) -> None:
    """Shard again the units of ``root`` that hold unsharded parameters, then ``root``."""
    from torch.distributed.fsdp import fully_shard

    options = root.__dict__.pop(_OPTIONS, None) or _options(root)
    rebuilt = [m for m in _units(root) if _holds_plain(m)]
    for module in [*rebuilt, root]:
        _remove_fsdp(module)
    for name in sorted(root.__dict__.get(_LAYER_UNITS, ())):  # layers before their parents
        layer = root.get_submodule(name)
        if not is_fsdp_module(layer):
            fully_shard(layer, **options)
    for module in rebuilt:
        fully_shard(module, **options)
    _forget_root(root)
    fully_shard(root, **{**options, "reshard_after_forward": None})


def _units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root, deepest first."""
    found = [m for m in model.modules() if m is not model and is_fsdp_module(m)]
    return found[::-1]


def _holds_plain(unit: nn.Module) -> bool:
    """Whether ``unit`` manages a parameter that is not sharded (a module swapped in)."""
    return any(not is_dtensor(p) for p in _managed_params(unit))


def _managed_params(unit: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters ``unit``'s own FSDP state manages: not those of nested units."""
    def visit(module: nn.Module) -> Iterator[nn.Parameter]:
        yield from module.parameters(recurse=False)
        for child in module.children():
            if not is_fsdp_module(child):
                yield from visit(child)
    return visit(unit)


def _options(model: nn.Module) -> dict[str, Any]:
    """``fully_shard`` options that rebuild the units as they were built (mesh, precision, CPU
    offloading)."""
    state = model._get_fsdp_state()  # type: ignore[operator]
    groups = [g for m in model.modules() if is_fsdp_module(m)
              for g in m._get_fsdp_state()._fsdp_param_groups]  # type: ignore[operator]
    units = _units(model)
    inner = units[0]._get_fsdp_state()._fsdp_param_groups if units else []  # type: ignore[operator]
    reshard = bool(inner and inner[0].post_forward_mesh_info is not None)
    options = {"mesh": groups[0].mesh_info.mesh if groups else None,
               "mp_policy": state._mp_policy, "reshard_after_forward": reshard}
    if groups:  # CPU offloading (an OffloadPolicy) kept, or the rebuilt units would be on the GPU
        options["offload_policy"] = groups[0].offload_policy
    return options


def _remove_fsdp(module: nn.Module) -> None:
    """Undo ``fully_shard`` on one module: its hooks (forward, state dict), state and class
    removed, and the parameters it manages that are still in the model made plain full tensors
    again (one all-gather per parameter, this unit only; replaced layers are not gathered)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    state = module._get_fsdp_state()  # type: ignore[operator]
    alive = {id(m) for m, _, _ in _named_managed(module)} | {id(module)}
    for group in state._fsdp_param_groups:
        for handles in (group._module_to_pre_save_state_dict_hook_handle,
                        group._module_to_pre_load_state_dict_hook_handle):
            for handle in handles.values():
                handle.remove()
        for fsdp_param in group.fsdp_params:  # read the shards, whatever the unit's state now
            fsdp_param._post_load_hook_handle.remove()
            info = fsdp_param._module_info
            holders = [(info.module, info.param_name),
                       *zip(info.shared_modules, info.shared_param_names)]
            live = [(m, name) for m, name in holders if id(m) in alive]
            if not live:  # its module was replaced (a factorized layer): not gathered
                continue
            sharded = fsdp_param.sharded_param
            full = nn.Parameter(sharded.full_tensor().detach().clone(),
                                requires_grad=sharded.requires_grad)
            for m, name in live:
                m._parameters[name] = full
    for handle in {id(h): h for h in (state._pre_forward_hook_handle,
                                      state._post_forward_hook_handle)}.values():
        handle.remove()
    for key in (STATE_KEY, REGISTRY_KEY):
        entries = module.__dict__.get(key, {})
        for k in [k for k, v in entries.items() if v is state or k == "fully_shard"]:
            del entries[k]
    _module_state_mapping.pop(module, None)
    module.__class__ = _original_class(module)


def _named_managed(unit: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    def visit(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
        for name, p in module.named_parameters(recurse=False):
            yield module, name, p
        for child in module.children():
            if not is_fsdp_module(child):
                yield from visit(child)
    return visit(unit)


def _forget_root(model: nn.Module) -> None:
    """Let the next root lazily initialize again over the units (kept ones included)."""
    for m in model.modules():
        if m is not model and is_fsdp_module(m):
            m._get_fsdp_state()._is_root = None  # type: ignore[operator]


def _sync_buffers(module: nn.Module, _args: Any) -> None:
    """Rank 0's buffers to every rank before a training forward (DDP's ``broadcast_buffers``)."""
    if module.training:
        _broadcast_buffers(module)


def _broadcast_buffers(module: nn.Module) -> None:
    """The first process's buffers to every process that shares the model's shards."""
    group = module.__dict__.get(_BUFFER_GROUP)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        for b in module.buffers():
            dist.broadcast(b, group=group, group_src=0)


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` with its sharded parameters replaced by their full tensors for the moment.

    Only ``module``'s own parameters are gathered (one layer at a time when called per layer);
    the shards are put back on exit. Every rank must call it for the same module.
    """
    saved = []
    for owner, name, p in [(m, n, p) for m in module.modules()
                           for n, p in m.named_parameters(recurse=False)]:
        if is_dtensor(p):
            saved.append((owner, name, p))
            owner._parameters[name] = nn.Parameter(p.full_tensor().detach(),
                                                   requires_grad=p.requires_grad)
    try:
        yield module
    finally:
        for owner, name, p in saved:
            owner._parameters[name] = p


# -- accounting --------------------------------------------------------------------------------

@dataclass
class FsdpBytes:
    """What FSDP2 moves per training step, for one process (see :func:`comm_bytes`)."""

    all_gather: float  # payload: this rank's shards handed to the all-gathers of one step
    reduce_scatter: float  # payload: the unsharded gradients handed to the reduce-scatters
    ring: float  # bytes this process sends under the ring model (both collectives)
    collectives: int = 0  # all-gathers and reduce-scatters launched per step

    @property
    def payload(self) -> float:
        return self.all_gather + self.reduce_scatter


def comm_bytes(model: nn.Module, world_size: int, micro_batches: int = 1) -> FsdpBytes:
    """Bytes per step of FSDP2 on ``model``, from the sharded parameters' sizes and dtypes.

    A step of ``micro_batches`` (gradient accumulation) all-gathers in each micro-batch's forward
    and backward and reduce-scatters once, after the last (:func:`gradient_sync_off`).

    Per unit, with ``S`` its padded shard bytes (``ceil(dim0 / p) * rest`` elements per
    parameter, in the mixed-precision parameter dtype) and ``p`` processes: the forward
    all-gathers ``S`` from each rank, the backward all-gathers again when the unit reshards after
    forward (every unit but the root by default), and the gradients (``p * S`` bytes in the reduce
    dtype) are reduce-scattered: ``n_gathers + 1`` collectives per unit. Ring model: an
    all-gather sends ``(p - 1) S``, a reduce-scatter ``(p - 1) / p`` of its input, so one step
    sends ``(n_gathers + 1) (p - 1) S`` per unit.
    """
    gather = scatter = ring = 0.0
    calls = 0
    p = world_size
    for unit in [m for m in model.modules() if is_fsdp_module(m)]:
        state = unit._get_fsdp_state()  # type: ignore[operator]
        for group in state._fsdp_param_groups:
            mp = state._mp_policy
            shard_el = sum(_padded_shard(fp.sharded_param, p) for fp in group.fsdp_params)
            dtypes = [fp.sharded_param.dtype for fp in group.fsdp_params]
            size = _size(mp.param_dtype, dtypes)
            grad_size = _size(mp.reduce_dtype or mp.param_dtype, dtypes)
            n = (2 if group.post_forward_mesh_info is not None else 1) * micro_batches
            gather += n * shard_el * size
            scatter += p * shard_el * grad_size
            ring += (n * size + grad_size) * (p - 1) * shard_el
            calls += n + 1
    return FsdpBytes(gather, scatter, ring, calls)


def _padded_shard(param: torch.Tensor, p: int) -> int:
    shape = param.shape
    rows = -(-shape[0] // p) if len(shape) else 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    return rows * rest


def _size(dtype: torch.dtype | None, dtypes: list[torch.dtype]) -> int:
    return (torch.empty((), dtype=dtype).element_size() if dtype is not None
            else max((torch.empty((), dtype=d).element_size() for d in dtypes), default=4))


def step_figures(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 world_size: int, micro_batches: int = 1) -> dict[str, float]:
    """The metrics row's FSDP2 figures: bytes per optimizer step of ``micro_batches``
    (:func:`comm_bytes`; ``comm_bytes_per_step`` is the payload, as the comm hooks count it),
    this process's sharded parameter, gradient and optimizer bytes, and its peak resident memory
    so far."""
    import resource

    moved = comm_bytes(model, world_size, micro_batches)
    return {"comm_bytes_per_step": moved.payload, "all_gather_bytes_per_step": moved.all_gather,
            "reduce_scatter_bytes_per_step": moved.reduce_scatter,
            "ring_bytes_per_step": moved.ring, **sharded_state_bytes(model, optimizer),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def sharded_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """This process's bytes of parameters, gradients and optimizer state (local shards)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t

    params = list(model.parameters())
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor)]
    return {"shard_param_bytes": sum(local(p).nbytes for p in params),
            "shard_grad_bytes": sum(local(p).nbytes for p in params if p.requires_grad),
            "shard_optimizer_bytes": sum(local(t).nbytes for t in state)}
