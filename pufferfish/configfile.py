"""A run's configuration as TOML and flags: :class:`~pufferfish.config.TrainConfig` read from a
file (or a shipped config by name) with overrides, each value converted to its field's type, and
written back as flat TOML (a run directory's ``config.toml``, which every version reads). A file
may put keys at the top level or in their group's table (``[optim] lr = 0.05``, the sections of
:mod:`pufferfish.options`). The fields, defaults and checks are :mod:`pufferfish.config`'s; this
is how they travel.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, get_args, get_origin

from .config import HOOK_OPTIONS, ConfigError, TrainConfig
from .fieldhelp import field_help
from .models.spec import absolute_reference, get_spec
from .options import section_of, sections

__all__ = ["FIELDS", "SHIPPED", "coerce", "coerce_scalar", "config_path", "dump_toml",
           "field_description", "field_kind", "flat_keys", "list_item_kind", "load_config",
           "read_config_file",
           "shipped_configs"]

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# Fields that name a file or directory: a TOML number there (``out = 5``) is a mistake, not a path.
PATH_FIELDS = ("out", "resume", "data_dir", "data")


def field_description(name: str) -> str:
    """One line of help for a field: its trailing comment in :class:`TrainConfig` (the style
    ``name: type = default  # help``), or a comm-hook option's help and allowed values."""
    for option in HOOK_OPTIONS:
        if option.key == name:
            return f"{option.help} (allowed: {option.allowed})"
    return field_help(TrainConfig).get(name, "")


def field_kind(name: str) -> type:
    """The Python type a field holds: bool, int, float, str or list (of str/float)."""
    annotation = FIELDS[name].type
    if isinstance(annotation, str):  # postponed annotations
        annotation = eval(annotation, {"list": list})
    return list if get_origin(annotation) is list else annotation


def list_item_kind(name: str) -> type:
    annotation = FIELDS[name].type
    if isinstance(annotation, str):
        annotation = eval(annotation, {"list": list})
    return get_args(annotation)[0]


def coerce(name: str, value: Any) -> Any:
    """Check/convert one raw value (from TOML or a flag string) to the field's type."""
    if name not in FIELDS:
        close = difflib.get_close_matches(name, FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown configuration key {name!r}{hint}")
    kind = field_kind(name)
    if kind is list:
        item = list_item_kind(name)
        items = [s for s in value.split(",") if s] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{name} {value!r} is invalid: allowed a list")
        return [coerce_scalar(name, v, item) for v in items]
    return coerce_scalar(name, value, kind)


def coerce_scalar(name: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif kind in (int, float):
        # An int field takes only ints (3.5 epochs is an error); a float field takes ints too.
        numeric = int if kind is int else int | float
        if isinstance(value, numeric) and not isinstance(value, bool):
            return kind(value)
        if isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
        if name in PATH_FIELDS:
            raise ConfigError(f"{name} {value!r} is invalid: allowed a string (a path; in TOML "
                              f"quoted: {name} = \"{value}\")")
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{name} {value!r} is invalid: allowed a {kind.__name__}")


SHIPPED = Path(__file__).parent / "configs"  # the repository's configs/, in the package


def shipped_configs() -> dict[str, Path]:
    """The configs shipped with the package, by name (``resnet18_fashion``: its TOML file)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.toml"))}


def config_path(path: str | Path) -> Path:
    """``path`` if it exists, else the shipped config it names: ``resnet18_fashion`` (or
    ``configs/resnet18_fashion.toml``, the repository's path, from anywhere)."""
    p = Path(path)
    if p.exists():
        return p
    shipped = shipped_configs()
    if p.stem in shipped and (str(p) == p.stem or (p.suffix == ".toml" and str(p.parent) in (
            ".", "configs"))):
        return shipped[p.stem]
    raise ConfigError(f"config file {str(path)!r} does not exist: allowed a TOML file, or the "
                      f"name of a shipped config: {', '.join(shipped)}")


def read_config_file(path: str | Path, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The values of the TOML file at ``path`` (or the shipped config it names), each checked
    for its key; an error names the file. A key in ``skip`` (a flag overrides it) must be a
    field, but its value is not read: the flag's is the one used."""
    path = config_path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    skip = set(skip)
    values: dict[str, Any] = {}
    try:
        for key, value in flat_keys(raw).items():
            if key in skip and key in FIELDS:
                continue
            values[key] = coerce(key, value)
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    return values


def flat_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A TOML file's keys without their tables: ``[optim] lr = 0.05`` is ``lr = 0.05``. A table
    that is no group's, a key in another group's table, or a key given twice is refused (one
    line); a key's value is checked later, by :func:`coerce`."""
    tables = sections()
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(value, dict):  # no field takes a table
            _put(flat, key, value, "the top level")
            continue
        if key not in tables:
            close = difflib.get_close_matches(key, tables, n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            raise ConfigError(f"section [{key}] is unknown{hint}: allowed "
                              f"{', '.join(f'[{t}]' for t in tables)}, or keys without a section")
        for name, item in value.items():
            home = section_of(name)
            if home is None:
                coerce(name, item)  # raises: the unknown key, and the one it resembles
            if home != key:
                raise ConfigError(f"{name} in [{key}] is in the wrong section: allowed in "
                                  f"[{home}] or without a section")
            _put(flat, name, item, f"[{key}]")
    return flat


def _put(flat: dict[str, Any], key: str, value: Any, where: str) -> None:
    if key in flat:
        raise ConfigError(f"{key} is given twice (again in {where}): allowed once")
    flat[key] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path`` (or the shipped config it names), then
    ``overrides`` (e.g. from flags)."""
    overrides = overrides or {}
    values = {} if path is None else read_config_file(path, skip=overrides)
    for key, value in overrides.items():
        values[key] = coerce(key, value)
    model = values.get("model", FIELDS["model"].default)
    if isinstance(model, str) and "model" in values:  # PATH.py:NAME: the same file from any cwd
        values["model"] = model = absolute_reference(model)
    try:
        spec = get_spec(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for key, value in spec.defaults.items():
        if key not in values:
            values[key] = value(values) if callable(value) else value
    return TrainConfig(**values)


def dump_toml(config: TrainConfig) -> str:
    """The configuration as TOML (flat keys; every value a string, number, bool or list)."""
    lines = []
    for key, value in config.to_dict().items():
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
