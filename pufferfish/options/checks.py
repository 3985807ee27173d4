"""What every option group shares: :class:`ConfigError`, the base :class:`OptionGroup`, and the
one-line checks the groups (and :class:`~pufferfish.config.TrainConfig`'s cross-group checks) use.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

__all__ = ["ConfigError", "OptionGroup", "as_float", "as_int", "choice", "group_choices",
           "non_negative", "override_defaults", "positive"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line naming it."""


class OptionGroup:
    """A concern's options: a dataclass of fields (``name: type = default  # help``) that checks
    its own values. ``SECTION`` is its TOML table (``[optim]``; several groups may share one),
    ``CHOICES`` its fields that take one of a list of names (a tuple, or a function of none that
    returns the names of a registry). :class:`~pufferfish.config.TrainConfig` inherits every
    group, so ``cfg.lr`` is still one attribute; it calls each group's checks on itself."""

    SECTION: ClassVar[str] = ""
    CHOICES: ClassVar[dict[str, tuple[str, ...] | Callable[[], Iterable[str]]]] = {}

    def check(self) -> None:
        """This group's own rules beyond its choices (:func:`check_group` runs both)."""

    @classmethod
    def check_group(cls, values: Any) -> None:
        """``values``' fields of this group (a group, or a configuration that inherits it): their
        names first, then :meth:`check`, both this group's (not the first base's of ``values``)."""
        for name, allowed in group_choices(cls).items():
            choice(name, getattr(values, name), allowed)
        cls.check(values)


def group_choices(group: type[OptionGroup]) -> dict[str, tuple[str, ...]]:
    """``group``'s fields that take one of a list of names, and the names (registries read now)."""
    return {name: tuple(allowed() if callable(allowed) else allowed)
            for name, allowed in group.CHOICES.items()}


def override_defaults(**defaults: Any) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): inherited option fields with other defaults, in one
    visible place: the field keeps its type, its place and its help (the group's comment)."""
    def decorate(cls: type) -> type:
        for name, value in defaults.items():
            owner = next((b for b in cls.__mro__[1:]
                          if name in getattr(b, "__dataclass_fields__", {})), None)
            if owner is None:
                raise TypeError(f"{cls.__name__} inherits no field {name!r} to give a default")
            annotations = dict(inspect.get_annotations(cls))
            annotations[name] = owner.__dataclass_fields__[name].type
            cls.__annotations__ = annotations
            setattr(cls, name, value)
        return cls
    return decorate


def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} {value!r} is invalid: allowed {', '.join(allowed)}")


def positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} {value!r} is invalid: allowed a number > 0")


def non_negative(values: Any, *names: str, finite: bool = False) -> None:
    """Each named field of ``values`` is >= 0 (and, with ``finite``, not infinite or NaN)."""
    for name in names:
        value = getattr(values, name)
        if not (0 <= value < math.inf if finite else value >= 0):
            raise ConfigError(f"{name} {value!r} is invalid: allowed >= 0")


def as_int(name: str, value: str, allowed: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} {value!r} is invalid: allowed {allowed}") from None


def as_float(name: str, value: str, allowed: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name} {value!r} is invalid: allowed {allowed}") from None
