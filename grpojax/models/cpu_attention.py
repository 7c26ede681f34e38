"""Decode attention over a segmented KV cache as a native CPU kernel (XLA FFI).

Axes: N query rows, R cache rows (N = g * R: a segment row is shared by g
consecutive query rows), K kv heads, M queries per kv head, H head dim,
S cache slots.

On XLA:CPU the decode step's attention products, [M, H] x [H, S] per (row, kv
head), run as hundreds of tiny batched matmuls at ~1/3 of memory speed: ~13 ms
of a ~60 ms decode step of the benchmark model. `cpu_attention.cc` streams
each row's keys and values once, on two threads, with one online softmax
over all segments. It is built on first use with the system's C++ compiler
(`$CXX`, default g++) against the XLA FFI headers that ship with jaxlib, for
this machine's CPU, into a per-user cache (`$GRPOJAX_CACHE_DIR`, default
~/.cache/grpojax).
Without a compiler, or with GRPOJAX_CPU_KERNELS=0, `available()` is False and
`transformer.segment_attention` keeps its XLA path, which is also the path on
every other platform.
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

_SOURCE = Path(__file__).with_suffix(".cc")
_TARGET = "grpojax_decode_attention"
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
  return cache / f"cpu_attention-{key.hexdigest()[:16]}.so"


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
  """True once the kernel is built and registered with XLA for the CPU platform.

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
    warnings.warn(f"grpojax: CPU decode-attention kernel unavailable, using XLA's "
                  f"(slower on CPU): {detail.strip()[-2000:]}", stacklevel=3)
    return False
  global _registered
  if not _registered:  # XLA keeps one handler per name for the process's lifetime
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.GrpojaxDecodeAttention),
                                platform="cpu")
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
  return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")(*args)
