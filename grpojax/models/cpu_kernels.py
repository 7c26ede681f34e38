"""Native CPU kernels for the decode step (XLA FFI): attention and dense layers.

Built on first use with the system's C++ compiler (`$CXX`, default g++)
against the XLA FFI headers that ship with jaxlib, for this machine's CPU,
into a per-user cache (`$GRPOJAX_CACHE_DIR`, default ~/.cache/grpojax).
Without a compiler, or with GRPOJAX_CPU_KERNELS=0, `available()` is False and
the model keeps its XLA paths, which are also the paths on every other platform.

- `attend`: decode attention over a segmented KV cache. Axes: N query rows,
  R cache rows (N = g * R: a segment row is shared by g consecutive query
  rows), K kv heads, M queries per kv head, H head dim, S cache slots. On
  XLA:CPU the products [M, H] x [H, S] per (row, kv head) run as hundreds of
  tiny batched matmuls at ~1/3 of memory speed (~13 ms of a ~60 ms decode
  step of the benchmark model); the kernel streams each row's keys and values
  once, on two threads, with one online softmax over all segments.
- `dense`: x [M, K] times a weight packed once per decode loop (`pack`) into
  panels of 64 output columns, [P, K, 64]. XLA:CPU's GEMM repacks the weight
  on every call and runs the decode step's 64-row products at ~40% of the
  FMA peak; the kernel holds a 6 x 64 tile in registers over all of K and
  prefetches the next panel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import struct

_SOURCE = Path(__file__).with_suffix(".cc")
_ATTEND = "grpojax_decode_attention"
_DENSE = "grpojax_dense"
_PACK = "grpojax_pack"
PANEL = 64  # output columns per packed weight panel (kPanel in the kernel)
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
MAX_HEAD_DIM = 512  # kMaxHead in the kernel


def _cpu_signature() -> str:
  """What -march=native depends on, so a cache shared between machines stays correct."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [line for line in f if line.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor() or platform.machine()


def _library_path() -> Path:
  cxx = os.environ.get("CXX", "g++")
  key = hashlib.sha256()
  for part in (_SOURCE.read_bytes(), cxx.encode(), " ".join(_FLAGS).encode(),
               jax.__version__.encode(), jax.ffi.include_dir().encode(),
               _cpu_signature().encode(), sys.platform.encode()):
    key.update(part)
  cache = Path(os.environ.get("GRPOJAX_CACHE_DIR") or Path.home() / ".cache" / "grpojax")
  return cache / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  # Build next to the target and rename: concurrent processes never load a partial file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
  os.close(fd)
  try:
    cmd = [os.environ.get("CXX", "g++"), *_FLAGS, "-I", jax.ffi.include_dir(),
           str(_SOURCE), "-o", tmp]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def available() -> bool:
  """True once the kernels are built and registered with XLA for the CPU platform.

  False when JAX's default backend is not the CPU (nothing is built on TPU
  or GPU hosts), when GRPOJAX_CPU_KERNELS=0, off Linux/macOS, or (with one
  warning saying why) when the compiler is missing or fails.
  """
  if (os.environ.get("GRPOJAX_CPU_KERNELS", "1") == "0" or sys.platform not in ("linux", "darwin")
      or jax.default_backend() != "cpu"):
    return False
  return _load()


@functools.cache
def _load() -> bool:
  path = _library_path()
  try:
    if not path.exists():
      _build(path)
    lib = ctypes.cdll.LoadLibrary(str(path))
  except (OSError, subprocess.SubprocessError) as e:
    detail = getattr(e, "stderr", "") or str(e)
    warnings.warn(f"grpojax: CPU decode kernels unavailable, using XLA's "
                  f"(slower on CPU): {detail.strip()[-2000:]}", stacklevel=3)
    return False
  global _registered
  if not _registered:  # XLA keeps one handler per name for the process's lifetime
    jax.ffi.register_ffi_target(_ATTEND, jax.ffi.pycapsule(lib.GrpojaxDecodeAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target(_DENSE, jax.ffi.pycapsule(lib.GrpojaxDense), platform="cpu")
    jax.ffi.register_ffi_target(_PACK, jax.ffi.pycapsule(lib.GrpojaxPack), platform="cpu")
    _registered = True
  return True


_registered = False


def supports(dtype, head_dim: int) -> bool:
  """Whether `attend` handles this case: float32 and head_dim % 8 == 0 (at most 512)."""
  return jnp.dtype(dtype) == jnp.float32 and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


def attend(q: jax.Array, segments) -> jax.Array:
  """Attention of one decode step's queries over cache segments; CPU only (see `available`).

  Args:
    q: [N, K, M, H] float32 queries (M per kv head), already scaled.
    segments: (k [R, K, H, S], v [R, K, S, H], visible [N, S] bool) per
      segment, float32; a segment's row r serves query rows r*g .. r*g+g-1
      (g = N / R), and every segment's R is a multiple of the smallest.
      Every query must see at least one slot.

  Returns:
    [N, K, M, H] float32: softmax over all segments' visible slots, times values.
  """
  args = [q]
  for k, v, visible in segments:
    args += [k, v, jnp.asarray(visible, bool)]
  return jax.ffi.ffi_call(_ATTEND, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")(*args)


@struct.dataclass
class PackedWeight:
  """A dense layer's weight [N, K] as `dense` reads it: panels [P, K, 64], zero past N."""

  panels: jax.Array
  features: int = struct.field(pytree_node=False)  # N


def pack(*parts: jax.Array) -> PackedWeight:
  """Weights [n_i, K] (out, in), stacked along n -> PackedWeight of N = sum n_i features.

  Panel p holds output columns 64p .. 64p+63, zero past N.
  """
  return pack_layers(*(w[None] for w in parts))[0]


def pack_layers(*parts: jax.Array) -> list[PackedWeight]:
  """Per-layer weights [L, n_i, K], stacked along n -> L PackedWeights (see `pack`).

  One kernel call on the CPU reads the stacked weights in place: no
  per-layer slice or concatenated copy. `pack_layers_xla` elsewhere.
  """
  L, _, k = parts[0].shape
  n = sum(w.shape[1] for w in parts)

  def cpu(*parts):
    out = jax.ShapeDtypeStruct((-(-n // PANEL), k, PANEL), jnp.float32)
    return [PackedWeight(x, n)
            for x in jax.ffi.ffi_call(_PACK, [out] * L, vmap_method="sequential")(*parts)]

  parts = [jnp.asarray(w, jnp.float32) for w in parts]
  return jax.lax.platform_dependent(*parts, cpu=cpu, default=pack_layers_xla)


def pack_layers_xla(*parts: jax.Array) -> list[PackedWeight]:
  """`pack_layers` as XLA ops (a concatenate, pad and transpose): any platform."""
  L, _, k = parts[0].shape
  n = sum(w.shape[1] for w in parts)
  p = -(-n // PANEL)
  w = jnp.pad(jnp.concatenate(parts, axis=1), ((0, 0), (0, p * PANEL - n), (0, 0)))
  return [PackedWeight(x, n) for x in w.reshape(L, p, PANEL, k).transpose(0, 1, 3, 2)]


def dense(x: jax.Array, w: PackedWeight) -> jax.Array:
  """x [M, K] float32 @ w.T -> [M, N] float32; CPU only (see `available`).

  Each output element is one float32 sum over k in order, whatever the
  number of threads. `dense_xla` elsewhere.
  """
  return jax.ffi.ffi_call(_DENSE, jax.ShapeDtypeStruct((x.shape[0], w.features), jnp.float32),
                          vmap_method="sequential")(x, w.panels)


def dense_xla(x: jax.Array, w: PackedWeight) -> jax.Array:
  """`dense` as one XLA product over the panels: any platform."""
  return jnp.einsum("mk,pkc->mpc", x, w.panels).reshape(x.shape[0], -1)[:, :w.features]
