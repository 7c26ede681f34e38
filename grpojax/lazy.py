"""A package's face, imported on first use (PEP 562): `import grpojax` and
`python -m grpojax.main --help` must not wait seconds for JAX and Flax to load
what they never touch."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys


def attach(package: str, exports: dict[str, list[str]]):
  """(`__getattr__`, `__dir__`, `__all__`) for `package`: each name of
  `exports[module]` is read from `package.module` on first access, and each
  submodule is imported on first access (`grpojax.data.tasks` after `import
  grpojax`), as an eager `__init__` would have made them; both are then cached in
  the package."""
  where = {name: module for module, names in exports.items() for name in names}

  def __getattr__(name: str):
    if name in where:
      value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
      value = importlib.import_module(f"{package}.{name}")
    else:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    setattr(sys.modules[package], name, value)
    return value

  __getattr__.exports = where  # {name: module}, for the tests' check of each name

  def __dir__():
    path = sys.modules[package].__path__
    return sorted({*where, *(m.name for m in pkgutil.iter_modules(path)
                             if not m.name.startswith("_"))})

  return __getattr__, __dir__, sorted(where)
