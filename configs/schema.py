"""Typed config machinery: frozen dataclasses built from plain dicts, with dotted overrides.

Contract:
- every section is a frozen dataclass owned by the package it configures;
- `build(cls, data)` builds one from a mapping; an unknown key, a missing required key, or a value of
  the wrong type raises `ConfigError` naming the dotted field, the value and the rule;
- value rules live in each dataclass's `__post_init__`, raising `ConfigError` through `require`;
- `apply_overrides(data, ["a.b=3"])` sets dotted keys; values are parsed as YAML scalars/lists.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the field, the value and the rule."""


def require(ok: bool, field: str, value: Any, rule: str) -> None:
    """Raise ConfigError("`field` must <rule>; received <value>") unless `ok`."""
    if not ok:
        raise ConfigError(f"{field} must {rule}; received {value!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, field: str) -> Any:
    """Convert `value` to type `tp`, or raise a ConfigError naming `field`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(get_args(tp), value, field)
    if origin is Literal:
        allowed = get_args(tp)
        require(value in allowed, field, value, f"be one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        require(isinstance(value, Mapping), field, value, f"be a mapping for section {tp.__name__}")
        return build(tp, value, prefix=field)
    if origin is tuple:
        return _convert_tuple(get_args(tp), value, field)
    if origin in (dict, Mapping) or tp is dict:
        require(isinstance(value, Mapping), field, value, "be a mapping")
        return dict(value)
    if tp in (bool, int, float, str):
        return _convert_scalar(tp, value, field)
    raise ConfigError(f"{field} has an unsupported annotation {tp!r}")


def _convert_union(options: tuple[Any, ...], value: Any, field: str) -> Any:
    """`value` as the first of `options` that accepts it (None when the union allows it)."""
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            return _convert(option, value, field)
        except ConfigError:
            pass
    raise ConfigError(f"{field} must be one of {[_type_name(o) for o in options]}; received {value!r}")


def _convert_tuple(args: tuple[Any, ...], value: Any, field: str) -> tuple[Any, ...]:
    """`value` (a list) as tuple[X, ...] or a fixed tuple[X, Y, ...], each item converted."""
    require(isinstance(value, Sequence) and not isinstance(value, str), field, value, "be a list")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, f"{field}[{i}]") for i, v in enumerate(value))
    require(len(value) == len(args), field, value, f"have {len(args)} items")
    return tuple(_convert(a, v, f"{field}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))


def _convert_scalar(tp: type, value: Any, field: str) -> Any:
    """`value` as bool, int, float (ints and YAML strings like `1e-3` accepted) or str."""
    if tp is bool:
        require(isinstance(value, bool), field, value, "be true or false")
        return value
    if tp is int:
        require(isinstance(value, int) and not isinstance(value, bool), field, value, "be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        require(isinstance(value, (int, float)) and not isinstance(value, bool), field, value, "be a number")
        return float(value)
    require(isinstance(value, str), field, value, "be a string")
    return value


def build[T](cls: type[T], data: Mapping[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and wrongly typed values."""
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"section {prefix!r}" if prefix else "the recipe"
        raise ConfigError(
            f"unknown key(s) {[_join(prefix, k) for k in unknown]} in {where}; allowed keys: {sorted(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        dotted = _join(prefix, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{dotted} is required; received nothing")
    return cls(**kwargs)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def to_dict(cfg: Any) -> Any:
    """A plain (YAML-able) dict of a config dataclass; tuples become lists."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `dotted.key=value` applied (value parsed as YAML)."""
    out = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override must look like section.key=value; received {item!r}")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override key must be dotted names like train.lr; received {key!r}")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
