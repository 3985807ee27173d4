"""The comm-hook registry: hook name -> :class:`HookFamily` (state class, hook, user options).

Each family file ends with one :func:`register_hook_family` call; everything that offers hooks to
users reads this registry: :func:`make_comm_hook`, the ``comm`` choices and the hook options of
``pufferfish train`` (TOML keys, flags, their checks), and ``pufferfish bench --methods``.
The flat option keys (``topk_ratio``, ``--topk-ratio``) are the ones users have always typed.
"""

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .state import CommHookState, check_setting

# NOTE: no ``from __future__ import annotations`` in the hooks package: DDP's
# ``register_comm_hook`` compares the hook's annotations with the real objects
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``, and string
# annotations would be rejected.

__all__ = [
    "CommHook",
    "HookFamily",
    "HookOption",
    "all_hook_options",
    "hook_family",
    "hook_names",
    "hook_options",
    "make_comm_hook",
    "register_comm_hook",
    "register_hook_family",
    "with_option_fields",
]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class HookOption:
    """One hyperparameter of a hook family as users set it.

    ``key`` is the flat configuration key and flag stem (``topk_ratio``: TOML ``topk_ratio``,
    flag ``--topk-ratio``), unique over all families; ``argument`` the state constructor's
    keyword (``ratio``); ``default`` the value ``pufferfish train`` uses; ``accepts`` says
    whether a value is allowed and ``allowed`` says the same in words, for errors.
    """

    key: str
    argument: str
    kind: type
    default: Any
    allowed: str
    accepts: Callable[[Any], bool]
    help: str = ""

    def check(self, value: Any, name: str | None = None) -> None:
        """One-line ``ValueError`` naming ``name`` (default: ``key``) unless ``value`` is allowed."""
        try:
            ok = bool(self.accepts(value))
        except TypeError:
            ok = False
        check_setting(name or self.key, value, ok, self.allowed)


@dataclass(frozen=True)
class HookFamily:
    """A comm hook as the registry knows it: ``hook(state, bucket) -> Future[Tensor]``.

    ``state_class(process_group=..., **{o.argument: value for o in options})`` builds its state.
    ``collective`` is how the payload travels, ``"allreduce"`` or ``"allgather"`` (whose
    per-rank traffic grows with the world size; the bench's projection needs to know).
    """

    name: str
    state_class: type[CommHookState]
    hook: CommHook
    options: tuple[HookOption, ...] = ()
    collective: str = "allreduce"


_FAMILIES: dict[str, HookFamily] = {}


def register_hook_family(family: HookFamily) -> HookFamily:
    """Make ``family`` available by name everywhere hooks are offered (see the module doc)."""
    if not (isinstance(family.state_class, type) and issubclass(family.state_class, CommHookState)):
        raise TypeError(f"comm hook {family.name!r}: state_class must subclass CommHookState, "
                        f"got {family.state_class!r}")
    if family.collective not in ("allreduce", "allgather"):
        raise ValueError(f"comm hook {family.name!r}: collective {family.collective!r} is "
                         "invalid: allowed allreduce, allgather")
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"comm hook {family.name!r} is already registered")
    taken = {o.key: f.name for f in _FAMILIES.values() if f.name != family.name for o in f.options}
    for option in family.options:
        if option.key in taken:
            raise ValueError(f"comm hook {family.name!r}: option key {option.key!r} is already "
                             f"used by {taken[option.key]!r}")
        option.check(option.default)
    _FAMILIES[family.name] = family
    return family


def hook_names() -> tuple[str, ...]:
    """Names of the registered hooks, in registration order."""
    return tuple(_FAMILIES)


def hook_family(name: str) -> HookFamily:
    """The registered family ``name``; a one-line ``ValueError`` lists the allowed names."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown comm hook {name!r}; expected one of {', '.join(_FAMILIES)}"
        ) from None


def all_hook_options() -> tuple[HookOption, ...]:
    """Every registered option, family by family (the flat keys of the configuration)."""
    return tuple(option for family in _FAMILIES.values() for option in family.options)


def hook_options(name: str, settings: Any) -> dict[str, Any]:
    """State keyword arguments of hook ``name`` read from flat settings.

    ``settings`` is anything with the options' keys as attributes: a ``TrainConfig``, the
    bench's config or its parsed flags (``settings.topk_ratio`` -> ``{"ratio": ...}``). An
    option ``settings`` lacks (a family registered after ``TrainConfig`` was built) takes its
    default.
    """
    return {o.argument: getattr(settings, o.key, o.default) for o in hook_family(name).options}


def make_comm_hook(
    name: str, process_group: dist.ProcessGroup | None = None, **options: Any
) -> tuple[CommHookState, CommHook]:
    """Build ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``name`` is a registered hook (:func:`hook_names`); ``options`` are its state's
    hyperparameters (``allreduce``/``fp16``: none; ``powersgd``: see ``PowerSGDHookState``;
    ``signum``: ``beta``; ``topk``: ``ratio``). Unknown options raise ``TypeError``, bad values
    a one-line ``ValueError``. Build a new state for every DDP wrapper (or ``state.fresh()``).
    """
    family = hook_family(name)
    return family.state_class(process_group=process_group, **options), family.hook


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    name: str,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> CommHookState:
    """Create the named hook (see :func:`make_comm_hook`), bind its state to the wrapped
    module's parameters (:meth:`CommHookState.bind`), register it on ``ddp_model`` and
    return the state. ``process_group`` defaults to the DDP model's own group.

    DDP accepts one hook per wrapper, registered before the first backward.
    """
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    state, hook = make_comm_hook(name, process_group=process_group, **options)
    state.bind(ddp_model.module)
    ddp_model.register_comm_hook(state, hook)
    return state


def with_option_fields(
    after: str, defaults: Mapping[str, Any] | None = None, options: Iterable[HookOption] | None = None
) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): one field per hook option, placed after ``after``.

    So a configuration dataclass has the flat keys of every registered hook (``powersgd_rank``,
    ``topk_ratio``, ...) without listing them; ``defaults`` overrides an option's default.
    Families registered after the decorated class is built are not among its fields.
    """
    chosen = tuple(all_hook_options() if options is None else options)
    overrides = dict(defaults or {})
    unknown = set(overrides) - {o.key for o in chosen}
    if unknown:
        raise TypeError(f"defaults for unknown hook options: {', '.join(sorted(unknown))}")

    def decorate(cls: type) -> type:
        annotations: dict[str, Any] = {}
        for name, annotation in inspect.get_annotations(cls).items():
            annotations[name] = annotation
            if name == after:
                for option in chosen:
                    annotations[option.key] = option.kind
                    setattr(cls, option.key, overrides.get(option.key, option.default))
        if after not in annotations:
            raise TypeError(f"{cls.__name__} has no field {after!r} to put hook options after")
        cls.__annotations__ = annotations
        return cls

    return decorate
