"""The training options, one dataclass per concern (:mod:`.groups`), each checking its own fields;
:class:`~pufferfish.config.TrainConfig` is all of them, with the checks across groups.

A group's ``SECTION`` names its TOML table (``[optim]``, ``[switch]``, ...): :func:`section_of`
says which table a key belongs in, :func:`sections` lists the tables.
"""

from __future__ import annotations

import dataclasses

from .checks import ConfigError, OptionGroup, group_choices, override_defaults
from .groups import (
    GROUPS,
    HOOK_OPTIONS,
    BaselineOptions,
    BatchOptions,
    DataOptions,
    DistributedOptions,
    LMOptions,
    MethodOptions,
    ModelOptions,
    OptimizerOptions,
    RunOptions,
    SubsetOptions,
    SwitchOptions,
    TrainingOptions,
)

__all__ = ["GROUPS", "HOOK_OPTIONS", "BaselineOptions", "BatchOptions", "ConfigError",
           "DataOptions", "DistributedOptions", "LMOptions", "MethodOptions", "ModelOptions",
           "OptimizerOptions", "OptionGroup", "RunOptions", "SubsetOptions", "SwitchOptions",
           "TrainingOptions", "group_choices", "override_defaults", "section_of", "sections"]


def sections() -> dict[str, list[str]]:
    """``{TOML table: its keys}``, in :data:`GROUPS`' order (groups may share a table)."""
    found: dict[str, list[str]] = {}
    for group in GROUPS:
        found.setdefault(group.SECTION, []).extend(f.name for f in dataclasses.fields(group))
    return found


def section_of(key: str) -> str | None:
    """The TOML table ``key`` belongs in (None: not an option)."""
    return next((name for name, keys in sections().items() if key in keys), None)
