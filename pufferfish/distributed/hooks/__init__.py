"""Gradient-compression baselines as DDP communication hooks, with byte and time accounting.

Pufferfish claims that training a pre-factorized (low-rank) model with plain all-reduce beats
compressing the gradients of the full model. To test that claim honestly the baselines run
through the same DDP machinery and report what they put on the wire. In the style of torch's
``ddp_comm_hooks``, each hook family is one file: a *state* class (hyperparameters it validates
itself, per-bucket memory it saves and loads, counters) plus a pure *hook* function
``hook(state, bucket) -> Future[Tensor]``, registered by name in :mod:`.registry`.
This package knows nothing about low-rank layers or training loops.

Usage::

    ddp = DistributedDataParallel(model)
    state = register_comm_hook(ddp, "topk", ratio=0.01)
    for batch in loader:
        state.stats.reset()
        loss_fn(ddp(batch)).backward()       # DDP calls the hook once per bucket
        optimizer.step()
        log(state.stats.snapshot())

Hooks (:func:`hook_names`)
--------------------------
``allreduce`` / ``fp16`` (:mod:`.allreduce`)
    DDP's default average of fp32 gradients (the reference), and torch's
    ``fp16_compress_hook``: half the bytes, the cheapest "compression" to beat.
``powersgd`` (:mod:`.powersgd`)
    torch's ``PowerSGDState`` + ``powerSGD_hook`` (Vogels et al., 2019), the strongest low-rank
    *gradient* compressor; see :class:`PowerSGDHookState` for the tuning guide.
``signum`` (:mod:`.signum`)
    signSGD with majority vote at 1 bit per element (Bernstein et al., 2019).
``topk`` (:mod:`.topk`)
    Top-k sparsification with error feedback (Stich et al., 2018; Lin et al., 2018).

What the counters mean (payload vs. ring-model bytes, compress vs. hook time) is in
:mod:`.accounting`; how memory follows DDP's re-bucketing is in :mod:`.memory`.

State lifetime and checkpoints: a state serves ONE DDP wrapper; build a new one
(``state.fresh()``) for a new wrapper, e.g. after Pufferfish swaps the warmed-up full-rank
model for its factorized version. ``state_dict()`` / ``load_state_dict()`` save and restore
the per-bucket memory (momentum, residual, PowerSGD's error/P/Q/iteration/RNG) as tensors and
numbers only; ``tests/test_comm_hooks.py`` checks that a resumed run is bit-identical to an
uninterrupted one.

Adding a hook: one file that defines its state class and hook function and ends with
``register_hook_family(HookFamily(name, StateClass, hook, options=(...)))``, plus its test
(docs/design.md, "How to add a comm hook").
"""

# Importing a family file registers it; the order is the order of ``hook_names()``.
from . import allreduce, powersgd, signum, topk  # noqa: F401  (registration)
from .accounting import CommStats, ring_bytes
from .allreduce import allreduce_hook, fp16_hook
from .bits import pack_bits, unpack_bits
from .memory import BucketMemory
from .powersgd import PowerSGDHookState, powersgd_hook, powersgd_payload_numel
from .registry import (
    CommHook,
    HookFamily,
    HookOption,
    all_hook_options,
    hook_family,
    hook_names,
    hook_options,
    make_comm_hook,
    register_comm_hook,
    register_hook_family,
    with_option_fields,
)
from .signum import SignumState, signum_hook
from .state import CommHookState, forget_if_nonfinite
from .topk import TopKState, topk_count, topk_hook

__all__ = [
    "HOOK_NAMES",
    "BucketMemory",
    "CommHook",
    "CommHookState",
    "CommStats",
    "HookFamily",
    "HookOption",
    "PowerSGDHookState",
    "SignumState",
    "TopKState",
    "all_hook_options",
    "allreduce_hook",
    "forget_if_nonfinite",
    "fp16_hook",
    "hook_family",
    "hook_names",
    "hook_options",
    "make_comm_hook",
    "pack_bits",
    "powersgd_hook",
    "powersgd_payload_numel",
    "register_comm_hook",
    "register_hook_family",
    "ring_bytes",
    "signum_hook",
    "topk_count",
    "topk_hook",
    "unpack_bits",
    "with_option_fields",
]

# The built-in hooks; :func:`hook_names` also lists families registered later.
HOOK_NAMES: tuple[str, ...] = hook_names()

_BucketMemory = BucketMemory  # the name this class had before the package split
