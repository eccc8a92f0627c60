"""Nested dicts (ml_collections ConfigDicts, JSON) <-> frozen config dataclasses, type-checked.

`from_dict(RunConfig, d)` builds the dataclass tree, checking every value against its field's
annotation; a wrong type or an unknown key raises `ConfigTypeError` naming the full field path
(`config.rl.learner.optimizer.learning_rate: expected float, got str 'fast'`). Fields typed
`Any` whose class depends on a sibling (a loss's config depends on the loss name) are resolved
through `dynamic`: {(owner class, field name): fn(sibling values) -> class}.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Mapping, Optional, Union

from posttrain_jax.errors import UserError


class ConfigTypeError(UserError, TypeError):
  """A config value of the wrong type, or an unknown field; names the field path."""


_INT64 = 1 << 63   # ints beyond int64 overflow numpy / jax; floats must be finite


def _is_dc(cls) -> bool:
  return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def _type_name(tp) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value, tp, path: str, dynamic):
  origin = typing.get_origin(tp)
  if tp is Any:
    return value
  if origin in (Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _convert(value, arg, path, dynamic)
      except ConfigTypeError as e:
        errors.append(str(e))
    raise ConfigTypeError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
  if _is_dc(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, Mapping):
      raise ConfigTypeError(f"{path}: expected a {tp.__name__} (a dict of its fields), got "
                            f"{type(value).__name__} {value!r}")
    return from_dict(tp, value, path, dynamic)
  if origin in (tuple, list):
    if not isinstance(value, (tuple, list)):
      raise ConfigTypeError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    args = typing.get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
      if len(args) != len(value):
        raise ConfigTypeError(f"{path}: expected {len(args)} items, got {len(value)}")
      items = [_convert(v, a, f"{path}[{i}]", dynamic) for i, (v, a) in enumerate(zip(value, args))]
    else:
      item_tp = args[0] if args else Any
      items = [_convert(v, item_tp, f"{path}[{i}]", dynamic) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items
  if origin is dict:
    if not isinstance(value, Mapping):
      raise ConfigTypeError(f"{path}: expected a dict, got {type(value).__name__} {value!r}")
    return dict(value)
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigTypeError(f"{path}: expected float, got {type(value).__name__} {value!r}")
    if isinstance(value, int) and abs(value) > _INT64:
      value = math.inf          # float() of it would raise OverflowError
    if not math.isfinite(value):  # no field means anything by inf or nan
      raise ConfigTypeError(f"{path}: expected a finite float, got {value!r}")
    return float(value)
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigTypeError(f"{path}: expected int, got {type(value).__name__} {value!r}")
    if not -_INT64 <= value < _INT64:
      raise ConfigTypeError(f"{path}: expected an int in [-2**63, 2**63), got {value!r:.40}")
    return value
  if tp in (str, bool):
    if not isinstance(value, tp):
      raise ConfigTypeError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value
  return value


def from_dict(cls, d: Mapping[str, Any], path: str = "config",
              dynamic: Optional[Mapping[tuple[type, str], Callable[[Mapping], type]]] = None):
  """Builds dataclass `cls` from `d` (missing keys keep their defaults)."""
  dynamic = dynamic or {}
  d = dict(d)
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ConfigTypeError(f"{path}: unknown field(s) {unknown}; {cls.__name__} has {sorted(names)}")
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name not in d:
      continue
    value, tp = d[f.name], hints[f.name]
    resolver = dynamic.get((cls, f.name))
    if resolver is not None and isinstance(value, Mapping):
      siblings = {g.name: getattr(_defaults(cls), g.name, None) for g in dataclasses.fields(cls)
                  if _has_default(g)}
      try:
        tp = resolver({**siblings, **d})
      except KeyError as e:
        raise ConfigTypeError(f"{path}.{f.name}: {e.args[0]}") from None
    kwargs[f.name] = _convert(value, tp, f"{path}.{f.name}", dynamic)
  try:
    return cls(**kwargs)
  except (ValueError, TypeError, KeyError, ArithmeticError) as e:
    if isinstance(e, ConfigTypeError):
      raise
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    if not any(name in msg for name in kwargs):
      blamed = _blame(cls, kwargs)
      path = f"{path}.{blamed}" if blamed else path
    raise ConfigTypeError(f"{path}: {msg}") from None


def _blame(cls, kwargs: dict) -> Optional[str]:
  """The one given field that alone (the others at their defaults) makes `cls` refuse, for a
  `__post_init__` message that names no field (a registry's "unknown name 'x'")."""
  if _defaults(cls) is None:
    return None
  for name, value in kwargs.items():
    try:
      cls(**{name: value})
    except Exception:  # noqa: BLE001  (any refusal blames this field)
      return name
  return None


def _has_default(f: dataclasses.Field) -> bool:
  return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _defaults(cls):
  try:
    return cls()
  except TypeError:
    return None


def config_dict_of(obj, keep_tuples: bool = False):
  """A config dataclass tree as an ml_collections ConfigDict whose every field is a command-line
  flag (`--config.<path>=value`): a None-valued `Optional[int | float | str | bool]` field becomes
  a typed placeholder (ml_collections cannot override a plain None), a tuple a list (config
  files assign lists) or, with `keep_tuples`, a tuple (a flag: `--config.<path>="('a', 'b')"`)."""
  from ml_collections import config_dict

  out = {}
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = config_dict_of(value, keep_tuples)
    elif value is None:
      args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
      out[f.name] = (config_dict.placeholder(args[0]) if len(args) == 1
                     and args[0] in (int, float, str, bool) else None)
    elif isinstance(value, tuple):
      out[f.name] = value if keep_tuples else list(value)
    else:
      out[f.name] = value
  return config_dict.ConfigDict(out)


def to_dict(obj) -> Any:
  """A config dataclass tree as plain JSON-able dicts (for logs and checkpoints)."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
  if isinstance(obj, (list, tuple)):
    return [to_dict(v) for v in obj]
  if isinstance(obj, dict):
    return {k: to_dict(v) for k, v in obj.items()}
  return obj
