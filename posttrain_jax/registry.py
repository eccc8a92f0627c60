"""A tiny name -> object registry; the single list of valid names for each kind of part."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar, Union

T = TypeVar("T")


class Registry(Generic[T]):
  """Maps names to objects (loss functions, graders, engines, ...).

  `get` on an unknown name raises a `KeyError` that lists every registered name, so a
  typo in a config is answered with the valid choices.
  """

  def __init__(self, kind: str, discover: Union[str, tuple[str, ...], None] = None,
               skip: tuple[str, ...] = ()):
    """`discover`: the package(s) whose modules register themselves; they are all imported the
    first time a name is looked up (`import_submodules`), so a new part is one new file."""
    self.kind = kind
    self._items: dict[str, T] = {}
    self._discover = (discover,) if isinstance(discover, str) else tuple(discover or ())
    self._skip = skip

  def _discovered(self) -> None:
    packages, self._discover = self._discover, ()
    for package in packages:
      import_submodules(package, self._skip)

  def register(self, name: str) -> Callable[[T], T]:
    def deco(obj: T) -> T:
      if name in self._items:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._items[name] = obj
      return obj
    return deco

  def get(self, name: str) -> T:
    self._discovered()
    try:
      return self._items[name]
    except KeyError:
      raise KeyError(
          f"unknown {self.kind} {name!r}; registered {self._plural()}: {', '.join(self.names())}"
      ) from None

  def _plural(self) -> str:
    return self.kind + ("es" if self.kind.endswith("s") else "s")

  def names(self) -> list[str]:
    self._discovered()
    return sorted(self._items)

  def __contains__(self, name: str) -> bool:
    self._discovered()
    return name in self._items


def import_submodules(package: str, skip: tuple[str, ...] = ()) -> None:
  """Imports every module of `package` (except private ones and `skip`), so modules that
  register themselves at import are found: a new part is one new file."""
  pkg = importlib.import_module(package)
  for mod in pkgutil.iter_modules(pkg.__path__):
    if not mod.name.startswith("_") and mod.name not in skip:
      importlib.import_module(f"{package}.{mod.name}")
