"""Model families: what Llama, Qwen2, Qwen3 ... change in the one shared decoder.

Every family is a `ModelFamily` in its own file in this package, registered with
`@register_family`; the files are found with `pkgutil`, so adding a family is one new file
here (plus its HF parity model in tests/support/hf.py). `config.py` reads and writes HF
`config.json` through the family it finds here; nothing else compares family names.

A family says three things:
- which HF `architectures` (and `model_type`, its `name`) it serves;
- `from_hf(hf)`: the ModelConfig fields it reads differently from the shared reading in
  `config.from_hf_dict` (biases, q/k norm). Called with `{}` it gives the family's defaults,
  which is what tiny models (`tiny.py`) are built with;
- `to_hf(cfg)`: the `config.json` keys only this family writes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from posttrain_jax.registry import Registry, import_submodules


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """One decoder family: its HF names and its translation to and from `config.json`."""
  name: str                        # ModelConfig.family, and HF's `model_type`
  architectures: tuple[str, ...]   # HF `architectures` it serves; the first is the one exported
  from_hf: Callable[[dict], dict]  # config.json dict -> ModelConfig fields that differ by family
  to_hf: Callable[[Any], dict]     # ModelConfig -> config.json keys only this family writes


FAMILIES: Registry[ModelFamily] = Registry("model family")


def register_family(family: ModelFamily) -> ModelFamily:
  """Adds `family` under its name (a module-level call in the family's file)."""
  return FAMILIES.register(family.name)(family)


def get(name: str) -> ModelFamily:
  """The family called `name`; a KeyError listing the registered ones otherwise."""
  return FAMILIES.get(name)


def names() -> list[str]:
  return FAMILIES.names()


def architectures() -> list[str]:
  """Every HF architecture served, family by family (in the order of `names()`)."""
  return [a for n in names() for a in get(n).architectures]


def for_hf(hf: dict) -> Optional[ModelFamily]:
  """The family serving a `config.json`: by its `architectures`, else by its `model_type`."""
  by_arch = {a: get(n) for n in names() for a in get(n).architectures}
  for arch in hf.get("architectures") or []:
    if arch in by_arch:
      return by_arch[arch]
  model_type = hf.get("model_type")
  return get(model_type) if isinstance(model_type, str) and model_type in FAMILIES else None


import_submodules(__name__)

__all__ = ["ModelFamily", "FAMILIES", "register_family", "get", "names", "architectures",
           "for_hf"]
