"""Compile for an accelerator this machine does not have.

XLA's TPU compiler ships in libtpu and runs on any x86 host: its topologies
give compile-only devices for a `Mesh`, so `jax.jit(f).lower(abstract
args).compile()` produces the TPU's own program, whose `memory_analysis()` and
`cost_analysis()` (FLOPs, bytes accessed, `optimal_seconds`) are the target's,
not XLA:CPU's proxy. Nothing runs: only compiles.

libtpu is found as JAX finds it: `$TPU_LIBRARY_PATH`, else the `libtpu`
package (`pip install "jax[tpu]"`, or `.ci/run`'s side install). Without it,
`available()` is False and `devices()` raises TargetUnavailable with the
install line.

    devs = targets.devices("tpu-v5e", chips=4)          # a v5e 2x2 slice
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    compiled = jax.jit(f).lower(*abstract_args).compile()
    targets.kernels(compiled)                           # fusions + custom calls
"""

from __future__ import annotations

import importlib.util
import os
import re

import jax

# Planner device names -> libtpu topology prefix and the accelerator type that
# keeps libtpu's start-up quiet on a host that is no TPU VM.
TPUS = {"tpu-v5e": ("v5e", "v5litepod"), "tpu-v6e": ("v6e", "v6e")}
# Chips of a single-host slice -> its grid.
_GRIDS = {1: (1, 1), 4: (2, 2), 8: (2, 4)}
INSTALL = ('pip install "jax[tpu]" (libtpu, about 210 MB; or put its libtpu.so on '
           "$TPU_LIBRARY_PATH)")


class TargetUnavailable(RuntimeError):
  """This machine cannot compile for the named target (its compiler is missing)."""


def available(target: str = "tpu-v5e") -> bool:
  """Can this machine compile for `target`?"""
  if target not in TPUS:
    return False
  path = os.environ.get("TPU_LIBRARY_PATH")
  return bool(path and os.path.isfile(path)) or importlib.util.find_spec("libtpu") is not None


def _quiet_libtpu(accelerator: str, chips: int) -> None:
  """libtpu's start-up asks the host for its TPU type and workers; a host that is
  no TPU VM gets warnings and a metadata-server query. Say them up front."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{accelerator}-{chips}")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def devices(target: str, chips: int = 1) -> list:
  """Compile-only devices of a single-host `target` slice of `chips` chips (1, 4, 8),
  for a `jax.sharding.Mesh`: programs sharded over it compile for that slice."""
  if target not in TPUS:
    raise ValueError(f"target {target!r} is unknown; known: {', '.join(TPUS)}")
  if chips not in _GRIDS:
    raise ValueError(f"chips={chips}: a single-host slice has {sorted(_GRIDS)} chips")
  if not available(target):
    raise TargetUnavailable(f"compiling for {target} needs libtpu: {INSTALL}")
  from jax.experimental import topologies

  prefix, accelerator = TPUS[target]
  x, y = _GRIDS[chips]
  _quiet_libtpu(accelerator, chips)
  topology = topologies.get_topology_desc(f"{prefix}:{x}x{y}", platform="tpu",
                                          chips_per_host_bounds=(x, y, 1))
  return list(topology.devices)


def kernels(compiled) -> int:
  """Kernels the compiled program launches: fusions plus custom calls (gemm
  libraries, Mosaic or Triton kernels) in its optimized HLO, outside the fused
  computations (which are those kernels' bodies). A loop body counts once."""
  count, fused = 0, False
  for line in compiled.as_text().splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      fused = "fused" in line.split("(")[0]  # a computation's header
    elif not fused and re.search(r"\s(?:fusion|custom-call)\(", line):
      count += 1
  return count


def mosaic_kernels(compiled) -> int:
  """Pallas TPU (Mosaic) kernels in a program compiled for a TPU."""
  return len(re.findall(r'custom_call_target="tpu_custom_call"', compiled.as_text()))


def compile_pallas_tpu(fn, *args, target: str = "tpu-v5e"):
  """Compiles `fn` (a function calling Pallas TPU kernels) for `target` on
  abstract `args` (jax.ShapeDtypeStruct; any sharding is replaced by one device
  of the target): proof that its kernels lower through Mosaic at these shapes,
  without a TPU. Returns the compiled program; raises if no Mosaic kernel is in it."""
  device = devices(target, chips=1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  compiled = jax.jit(fn).lower(*abstract).compile()
  if not mosaic_kernels(compiled):
    raise ValueError(f"{getattr(fn, '__name__', fn)!r} compiled for {target} with no "
                     "Pallas (Mosaic) kernel: it does not call one at these shapes")
  return compiled
