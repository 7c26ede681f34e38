"""Frozen weights stored quantised (QLoRA's base): int8 or nf4 codes with float32 scales.

A QuantizedWeight stands wherever a dense weight [..., O, *, I] does (the
model's stacked [L, ...] matrices included: `lax.scan` slices its codes and
scales like any array). `ops.linear` and `ops.wide_linear` dequantise it to
the compute dtype at the matmul, so the full-precision weight exists only for
the one layer being computed, and no gradient ever flows to it.

- "int8": symmetric, one scale per row of the last (input) axis: w ≈ code * absmax / 127.
  The error of each weight is at most half a step, absmax / 254.
- "nf4": QLoRA's 4-bit NormalFloat (Dettmers et al., 2023), blocks of 64 inputs,
  each scaled by its absmax; two codes per byte. The 16 levels are quantiles of a
  standard normal, so normally distributed weights use them about equally. A
  weight's error is at most half the widest gap between levels times its block's absmax.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

KINDS = ("int8", "nf4")
NF4_BLOCK = 64


def _nf4_levels() -> np.ndarray:
  """The 16 NF4 levels in [-1, 1], ascending: 8 positive and 7 negative normal quantiles
  (each side from an offset of (1 - 1/(2*15) + 1 - 1/(2*16)) / 2 to 1/2, as QLoRA
  builds them), normalised by the largest, plus an exact zero."""
  offset = 0.5 * (1 - 1 / 30 + 1 - 1 / 32)
  ppf = statistics.NormalDist().inv_cdf
  pos = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
  neg = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
  levels = np.sort(np.array(pos + neg + [0.0]))
  return (levels / np.max(np.abs(levels))).astype(np.float32)


NF4_LEVELS = _nf4_levels()


def max_relative_error(kind: str) -> float:
  """The largest |w - dequantise(quantise(w))| / absmax of w's block or row (round to nearest)."""
  if kind == "int8":
    return 0.5 / 127
  return float(np.max(np.diff(NF4_LEVELS))) / 2


@struct.dataclass
class QuantizedWeight:
  """A weight [..., I] as codes and per-block scales.

  codes: int8 [..., I] ("int8") or uint8 [..., I / 2] ("nf4": input 2j in the low
  nibble, 2j + 1 in the high one). scales: float32 [..., I / block].
  """

  codes: jax.Array
  scales: jax.Array
  kind: str = struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    """The weight's shape."""
    last = self.codes.shape[-1] * (2 if self.kind == "nf4" else 1)
    return (*self.codes.shape[:-1], last)

  def dequantize(self, dtype) -> jax.Array:
    """The weight in `dtype`, its shape."""
    return dequantize(self, dtype)


def block_size(kind: str, inputs: int) -> int:
  """Inputs per scale: the whole row for int8; 64 for nf4 (or the row, if 64 does not divide it)."""
  if kind == "int8":
    return inputs
  return NF4_BLOCK if inputs % NF4_BLOCK == 0 else inputs


def quantize(w: jax.Array, kind: str) -> QuantizedWeight:
  """w [..., I] -> QuantizedWeight, rounding each weight to its nearest level."""
  if kind not in KINDS:
    raise ValueError(f"quantize kind={kind!r}; valid: {', '.join(KINDS)}")
  inputs = w.shape[-1]
  if kind == "nf4" and inputs % 2:
    raise ValueError(f"nf4 packs two inputs per byte: the input axis ({inputs}) must be even")
  block = block_size(kind, inputs)
  x = w.astype(jnp.float32).reshape(*w.shape[:-1], inputs // block, block)
  absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  safe = jnp.where(absmax > 0, absmax, 1.0)  # an all-zero block: any scale, codes 0
  if kind == "int8":
    codes = jnp.round(x / safe * 127).astype(jnp.int8).reshape(w.shape)
    return QuantizedWeight(codes, (safe / 127)[..., 0], kind)
  levels = jnp.asarray(NF4_LEVELS)
  # The nearest level: count the midpoints below x.
  idx = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, x / safe).astype(jnp.uint8)
  idx = idx.reshape(*w.shape[:-1], inputs // 2, 2)
  codes = idx[..., 0] | (idx[..., 1] << 4)
  return QuantizedWeight(codes, safe[..., 0], kind)


def dequantize(q: QuantizedWeight, dtype) -> jax.Array:
  """q's weight [..., I] in `dtype`, computed in `dtype`: no float32 copy of a bf16 weight
  (levels and scales rounded to bf16 add 2^-9 relative to a quantisation error of 2^-8
  (int8) or 0.15 (nf4) of the block's absmax)."""
  if q.kind == "int8":
    values = q.codes.astype(dtype)
  else:
    idx = jnp.stack([q.codes & 0xF, q.codes >> 4], axis=-1).reshape(q.shape)
    # A chain of 16 selects, not a table lookup: elementwise, it fuses into the
    # dequantising kernel, where a gather from the 16 levels is a kernel of its own
    # (on a TPU, the decode step's costliest by the compiler's count).
    values = jnp.zeros(q.shape, dtype)
    for code, level in enumerate(NF4_LEVELS):
      values = jnp.where(idx == code, jnp.asarray(level, dtype), values)
  blocks = q.scales.shape[-1]
  values = values.reshape(*q.shape[:-1], blocks, -1) * q.scales[..., None].astype(dtype)
  return values.reshape(q.shape)


def maybe_dequantize(w, dtype):
  """w itself, or its dequantised values where it is a QuantizedWeight."""
  return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w


def abstract(w: jax.ShapeDtypeStruct, kind: str, sharding=None, scale_sharding=None
             ) -> QuantizedWeight:
  """QuantizedWeight of ShapeDtypeStructs for a weight of w's shape (plans, restores)."""
  inputs = w.shape[-1]
  lead = tuple(w.shape[:-1])
  codes = jax.ShapeDtypeStruct(lead + (inputs // 2 if kind == "nf4" else inputs,),
                               jnp.uint8 if kind == "nf4" else jnp.int8, sharding=sharding)
  scales = jax.ShapeDtypeStruct(lead + (inputs // block_size(kind, inputs),), jnp.float32,
                                sharding=scale_sharding)
  return QuantizedWeight(codes, scales, kind)
