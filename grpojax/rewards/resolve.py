"""The reward functions, tools and environments a config names by import path
(`module:name`), resolved to the objects: imported, or for the Python API's own (a
script's function, a lambda, which no import path reaches) looked up where the API
registered them.

The config holds the paths as strings (grpojax.config: reward_paths, tool_paths,
environment_paths); this turns them into callables, a ConfigError in one line naming
the key for one that is not there.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

from grpojax.errors import ConfigError

# Reward functions handed to the Python API (grpojax.GRPOTrainer) that no import path
# reaches (a script's or a notebook's own, a lambda): rewards.functions names them
# "__main__:name", and this process finds them here.
IN_PROCESS_REWARDS: dict = {}

# Tools (and environment factories) handed to the Python API (GRPOTrainer(tools=,
# environment_factory=)) that no import path reaches: rollout.tools names them
# "__main__:name", and this process finds them here.
IN_PROCESS_TOOLS: dict = {}


def reward_functions(paths: Sequence[str]) -> tuple:
  """The functions rewards.functions' `paths` name."""
  return imported(paths, "rewards.functions", IN_PROCESS_REWARDS)


def tools(paths: Sequence[str]) -> tuple:
  """The functions and classes rollout.tools' `paths` name."""
  out = imported(paths, "rollout.tools", IN_PROCESS_TOOLS)
  for path, tool in zip(paths, out):
    if not callable(tool):
      raise ConfigError(f"config: rollout.tools: {path!r} is neither a function nor a class")
  return out


def environment_factories(paths: Mapping):
  """The factory rollout.environment's `paths` ({name: path}; name None: the one
  environment) name, or {name: factory} for several; None without one."""
  if not paths:
    return None
  out = dict(zip(paths, imported(list(paths.values()), "rollout.environment",
                                 IN_PROCESS_TOOLS)))
  for name, factory in out.items():
    if not callable(factory):
      raise ConfigError(f"config: rollout.environment: {paths[name]!r} is neither a class nor "
                        "a function")
  return out[None] if list(out) == [None] else out


def imported(paths: Sequence[str], key: str, registry: Mapping) -> tuple:
  """The objects `paths` (module:name) name: the Python API's own from `registry`, the
  rest imported; ConfigError in one line naming `key` for one that is not there."""
  out = []
  for path in paths:
    if path in registry:
      out.append(registry[path])
      continue
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if module == "__main__":
      raise ConfigError(
          f"config: {key} names {path!r}, an object of the script or notebook that started "
          "the run through the Python API, which this process cannot import: move it to a "
          "module and name it module:name")
    try:
      out.append(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError) as e:
      raise ConfigError(f"config: {key}: cannot import {path!r}: {e}") from None
  return tuple(out)
