"""Logical axis names → mesh axes: the rules table that places parameters on a mesh.

Parameters carry logical names (embed, mlp, heads, kv_heads, head_dim, vocab,
layers); a rules dict maps each name to mesh axes of a ("data", "fsdp", "tensor")
mesh. Names missing from the rules are replicated. Kept as a plain dict argument
so grpojax/parallel/mesh.py and the config can own the table later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: dict[str, MeshAxes] = {
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "vocab": "tensor",
}


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, MeshAxes]) -> PartitionSpec:
  """PartitionSpec for an array of `shape` whose dims are named `axes`.

  A dim whose size does not divide by its mesh axes' size is replicated rather
  than refused (e.g. 2 kv heads on tensor=4): correct, just less memory-efficient.
  A mesh axis already used by an earlier dim is not used twice.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {axes} do not match shape {shape}")
  used: set[str] = set()
  spec = []
  for name, size in zip(axes, shape):
    wanted = rules.get(name) if name is not None else None
    wanted = (wanted,) if isinstance(wanted, str) else tuple(wanted or ())
    keep = tuple(a for a in wanted if a in mesh.shape and a not in used and mesh.shape[a] > 1)
    n = math.prod(mesh.shape[a] for a in keep)
    if not keep or size % n:
      spec.append(None)
      continue
    used.update(keep)
    spec.append(keep[0] if len(keep) == 1 else keep)
  return PartitionSpec(*spec)


def named_shardings(specs: Mapping[str, tuple[tuple[int, ...], tuple[str, ...]]], mesh: Mesh,
                    rules: Mapping[str, MeshAxes] | None = None) -> dict[str, NamedSharding]:
  """{name: NamedSharding} for {name: (shape, logical_axes)}."""
  rules = DEFAULT_RULES if rules is None else rules
  return {name: NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))
          for name, (shape, axes) in specs.items()}


def put(host_array: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
  """A host array onto devices; each process copies only the slices its devices hold."""
  if sharding is None:
    return jax.device_put(host_array)
  return jax.make_array_from_callback(host_array.shape, sharding, lambda idx: host_array[idx])


def to_host(x: jax.Array) -> np.ndarray:
  """The whole array on this host (gathered across processes when sharded over several)."""
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # only multi-host runs need it
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))
