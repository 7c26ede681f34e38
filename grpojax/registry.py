"""Named registries: the extension points (losses, advantage estimators, tasks)
map a config value to the object research code registered under it.

One duplicate rule everywhere: registering a name again with the same object is
a no-op (re-running a module's registrations is harmless); with a different
object it raises, unless `override=True` says the replacement is meant.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """name -> object for the config key `key` (e.g. "loss.loss_type")."""

  def __init__(self, key: str):
    self.key = key
    self._items: dict[str, T] = {}

  def register(self, name: str, value: T, *, override: bool = False) -> T:
    if not isinstance(name, str) or not name:
      raise ValueError(f"{self.key}: a registered name must be a non-empty string, got {name!r}")
    old = self._items.get(name, value)
    # `==` as well as `is`: a loss re-registered with the same function and
    # aggregation builds an equal (not identical) record.
    if not override and old is not value and old != value:
      raise ValueError(f"{self.key}={name!r} is already registered (to {old!r}); pick another "
                       f"name, or pass override=True to replace it")
    self._items[name] = value
    return value

  def get(self, name: str) -> T:
    if name not in self._items:
      raise ValueError(f"{self.key}={name!r} is unknown; known: {self.names()}")
    return self._items[name]

  def pop(self, name: str, default: T | None = None) -> T | None:
    """Removes `name` (tests, notebooks redefining a function); `default` if absent."""
    return self._items.pop(name, default)

  def names(self) -> list[str]:
    return sorted(self._items)

  def __contains__(self, name: object) -> bool:
    return name in self._items

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())

  def __len__(self) -> int:
    return len(self._items)

  def __repr__(self) -> str:
    return f"Registry({self.key!r}, {self.names()})"
