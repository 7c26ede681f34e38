"""The device mesh, sharding of parameters and batches, and multi-host set-up.

One mesh with axes ("data", "fsdp", "tensor"). Parameters carry logical axis
names that a rules table (grpojax.models.sharding) maps to mesh axes; batches
are split by rows over ("data", "fsdp") so that whole groups stay together on
each process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_shape(shape: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Sizes for AXES from a {axis: size} dict, where one size may be -1 (the rest)."""
  sizes = [int(shape[a]) for a in AXES]
  known = math.prod(s for s in sizes if s != -1)
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh.shape={dict(shape)}: sizes must be >= 1 with at most one -1")
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh.shape={dict(shape)} does not divide {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh.shape={dict(shape)} needs {math.prod(sizes)} devices, "
                     f"{num_devices} are available")
  return tuple(sizes)


def make_mesh(shape: Mapping[str, int], devices=None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over all (or the given) devices."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = resolve_shape(shape, len(devices))
  try:
    grid = mesh_utils.create_device_mesh(sizes, devices)
  except Exception:  # noqa: BLE001 -- odd topologies: fall back to device order
    grid = np.asarray(devices).reshape(sizes)
  return Mesh(grid, AXES)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows over ("data", "fsdp"), everything else replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def put(x, sharding):
  """`jax.device_put(x, sharding)`, also where JAX's own goes wrong: a device array
  put onto a replicated sharding over several processes with one device each (how
  TPU VMs and multi-node GPU jobs look to JAX) comes back from jax 0.10 as an array
  whose one local shard claims every device, which breaks at its first use (a
  checkpoint's save). Here each local device gets a copy of this process's `x`,
  which must hold the same value on every process, as a replicated value does."""
  if (isinstance(x, jax.Array) and isinstance(sharding, NamedSharding)
      and not sharding.is_fully_addressable and sharding.is_fully_replicated):
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [jax.device_put(x, d) for d in sharding.addressable_devices])
  return jax.device_put(x, sharding)


def rows_per_process(num_rows: int, mesh: Mesh) -> int:
  """Rows each process feeds; raises unless rows split evenly over the batch shards."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if num_rows % shards:
    raise ValueError(f"{num_rows} rows do not split over {shards} data x fsdp shards")
  return num_rows // jax.process_count()


def row_sharding(mesh: Mesh, num_rows: int, ndim: int = 2) -> NamedSharding:
  """Rows over ("data", "fsdp") when they divide evenly, else replicated.

  A step's B prompts can be fewer than the batch shards (B*G rows are not):
  with one process such small arrays are replicated rather than refused.
  """
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if num_rows % shards == 0:
    return batch_sharding(mesh, ndim)
  if jax.process_count() > 1:
    raise ValueError(f"{num_rows} rows do not split over the {shards} data x fsdp shards of a "
                     "multi-process mesh: make rollout.prompts_per_step a multiple of it")
  return replicated(mesh)


def global_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Global arrays, rows sharded over the batch axes, from this process's rows.

  Every process passes its own contiguous slice of rows (whole groups); with one
  process this is a plain sharded device_put.
  """
  out = {}
  for name, x in local.items():
    x = np.asarray(x)
    rows = x.shape[0] * jax.process_count()
    out[name] = jax.make_array_from_process_local_data(row_sharding(mesh, rows, x.ndim), x)
  return out


def initialize_distributed() -> bool:
  """`jax.distributed.initialize()` when launched as one of several processes.

  Multi-process launches set JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and
  JAX_PROCESS_ID), or run on TPU pods / SLURM where JAX detects them itself
  (set GRPOJAX_DISTRIBUTED=1 there). Returns whether it initialised (True again
  when called a second time: the loop's entry points call it before their lock).
  """
  if jax.distributed.is_initialized():
    return True
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
  elif os.environ.get("GRPOJAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
  else:
    return False
  _watch_peers()
  return True


def _watch_peers() -> None:
  """A peer that dies silently is named in one line (grpojax.parallel.peers)."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  from grpojax.parallel import peers  # pylint: disable=import-outside-toplevel

  client = getattr(distributed.global_state, "client", None)
  peers.watch(client, jax.process_index(), jax.process_count())
