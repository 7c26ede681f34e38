"""The "cpu" backend of grpojax.ops: native kernels (XLA FFI) and CPU-measured variants.

The native kernels are built by `load()` (grpojax.ops.resolve calls it at
startup, never inside a trace) with the system's C++ compiler (`$CXX`,
default g++) against the XLA FFI headers that ship with jaxlib, for this
machine's CPU, into a per-user cache (`$GRPOJAX_CACHE_DIR`, default
~/.cache/grpojax). Each op is lowered through `jax.lax.platform_dependent`, so
a program traced for the CPU backend still runs the XLA path if it is lowered
for another platform.

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
import logging
import math
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

from grpojax.ops import xla

_SOURCE = Path(__file__).with_name("cpu_kernels.cc")
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


def load() -> bool:
  """Builds (once per machine) and registers the kernels; True when they are usable.

  False off Linux/macOS, or (with one warning saying why) when the compiler
  is missing or fails. Call it outside any trace: a first build runs g++.
  """
  if sys.platform not in ("linux", "darwin"):
    return False
  return _load()


def loaded() -> bool:
  """Whether `load` has already succeeded in this process (never builds)."""
  return _load.cache_info().currsize > 0 and _load()


@functools.cache
def _load() -> bool:
  path = _library_path()
  try:
    if not path.exists():
      # About half a minute of g++ once per machine: said, so the wait is not silent.
      logging.getLogger(__name__).info("building grpojax's CPU decode kernels (g++, once per "
                                       "machine, ~30 s) into %s ...", path)
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
  """Attention of one decode step's queries over cache segments; CPU only (see `load`).

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
  """x [M, K] float32 @ w.T -> [M, N] float32; CPU only (see `load`).

  Each output element is one float32 sum over k in order, whatever the
  number of threads. `dense_xla` elsewhere.
  """
  return jax.ffi.ffi_call(_DENSE, jax.ShapeDtypeStruct((x.shape[0], w.features), jnp.float32),
                          vmap_method="sequential")(x, w.panels)


def dense_xla(x: jax.Array, w: PackedWeight) -> jax.Array:
  """`dense` as one XLA product over the panels: any platform."""
  return jnp.einsum("mk,pkc->mpc", x, w.panels).reshape(x.shape[0], -1)[:, :w.features]


# ---------------------------------------------------------------- ops as the backend runs them


def linear(x: jax.Array, w) -> jax.Array:
  """x [..., I] times w: a PackedWeight (the native kernel) or a plain [O, I] weight (XLA)."""
  if not isinstance(w, PackedWeight):
    return xla.linear(x, w)
  y = jax.lax.platform_dependent(x.reshape(-1, x.shape[-1]), w, cpu=dense, default=dense_xla)
  return y.reshape(*x.shape[:-1], w.features)


def segment_attention(q: jax.Array, segments, T: int) -> jax.Array:
  """xla.segment_attention, through the native kernel for float32 decode steps (T = 1)."""
  fallback = functools.partial(xla.segment_attention, segments=segments, T=T)
  if not (T == 1 and supports(q.dtype, q.shape[-1]) and _rows_nest(segments)
          and all(x.dtype == jnp.float32 for s in segments for x in s[:2])):
    return fallback(q)

  def kernel(q):
    N = q.shape[0]
    parts = []
    for k, v, visible, _ in segments:
      S = k.shape[-1]
      visible = (jnp.ones((N, S), bool) if visible is None
                 else jnp.broadcast_to(visible, (N, 1, S)).reshape(N, S))
      parts.append((k, v, visible))
    return attend(q, parts)

  return jax.lax.platform_dependent(q, cpu=kernel, default=fallback)


def _rows_nest(segments) -> bool:
  """Every segment's row count is a multiple of the smallest (the kernel's grouping)."""
  fewest = min(k.shape[0] for k, *_ in segments)
  return all(k.shape[0] % fewest == 0 for k, *_ in segments)


@jax.custom_vjp
def wide_linear(x, w):
  """xla.wide_linear (x [B, T, D] @ w [F, D].T, F > D) with a backward XLA:CPU runs faster.

  A custom VJP: reverse mode only (jax.jvp through the MLP is not defined).
  """
  return xla.wide_linear(x, w)


def _wide_linear_fwd(x, w):
  return wide_linear(x, w), (x, w)


def _wide_linear_bwd(res, g):
  x, w = res
  # dw = g^T x written as (x^T g)^T: XLA:CPU then transposes the narrow x [BT, D]
  # and the [D, F] result, not the wide gradient g [BT, F] (a slow strided copy).
  dw = jnp.einsum("btd,btf->df", x, g).T
  return jnp.einsum("btf,fd->btd", g, w.astype(g.dtype)), dw.astype(w.dtype)


wide_linear.defvjp(_wide_linear_fwd, _wide_linear_bwd)


def categorical(rng: jax.Array, logits: jax.Array) -> jax.Array:
  """One draw per row from softmax(logits) by inverting its CDF: [B, V] -> [B] int32.

  -inf logits are excluded exactly (their CDF interval is empty). One uniform
  per row instead of jax.random.categorical's Gumbel noise on every vocabulary
  entry (V uniforms and two logs per row; timings in bench/RESULTS.md,
  sampler item 4). The float32 prefix sums move each token's interval
  by ~1e-7 of the total mass: the inverse-transform method GPU samplers such as
  FlashInfer's also run in float32.
  """
  return _inverse_cdf(rng, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))


def _inverse_cdf(rng: jax.Array, weights: jax.Array) -> jax.Array:
  """The token whose CDF interval holds a uniform draw; weights [B, V] >= 0 -> [B] int32.

  Two levels of ~sqrt(V) each: a prefix sum over block totals picks the block,
  then one over that block's weights picks the token. A flat [B, V] cumsum is
  a log(V)-deep scan on CPU (timings in bench/RESULTS.md, sampler item 7).
  """
  B, V = weights.shape
  bs = 1 << max(0, math.ceil(math.log2(V) / 2))  # block size: a power of two >= sqrt(V)
  nb = -(-V // bs)
  blocks = jnp.pad(weights, ((0, 0), (0, nb * bs - V))).reshape(B, nb, bs)
  block_mass = jnp.sum(blocks, axis=-1)  # [B, nb]
  cdf = jnp.cumsum(block_mass, axis=-1)
  u = jax.random.uniform(rng, (B, 1)) * cdf[:, -1:]
  # Zero-mass blocks have empty intervals and are skipped by the count; a u
  # that rounds up to the total falls back to the last block with mass.
  j = jnp.minimum(jnp.sum(cdf <= u, axis=-1), _last(block_mass > 0))
  rows = jnp.arange(B)
  w = blocks[rows, j]  # [B, bs]
  u_in = u[:, 0] - (cdf[rows, j] - block_mass[rows, j])
  i = jnp.sum(jnp.cumsum(w, axis=-1) <= u_in[:, None], axis=-1)
  # The two levels round differently, so u_in may fall just outside the
  # block's own prefix sums: clamp to its first and last token with mass.
  has = w > 0
  i = jnp.clip(i, jnp.argmax(has, axis=-1), _last(has))
  return (j * bs + i).astype(jnp.int32)


def _last(x: jax.Array) -> jax.Array:
  """Index of the last True along the last axis (0 if none): [..., n] -> [...]."""
  n = x.shape[-1]
  return n - 1 - jnp.argmax(x[..., ::-1], axis=-1)
