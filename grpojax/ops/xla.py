"""The "xla" backend of grpojax.ops: plain JAX, the reference on every platform.

Axes: N query rows, K kv heads, m queries per kv head and row, H head dim,
S cache slots, R rows of a cache segment (N = g * R), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Masked scores: finite (as jax.nn.dot_product_attention's), so that no backend's
# fused max/exp/sum ever meets -inf - (-inf).
MASKED = -0.7 * float(np.finfo(np.float32).max)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., I] times a weight stored [O, I] (or [O, *, *] flattening to it) -> [..., O]."""
  return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype).reshape(-1, x.shape[-1]))


def wide_linear(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [B, T, D] @ w [F, D].T -> [B, T, F]: the MLP's input projections."""
  return jnp.einsum("btd,fd->btf", x, w.astype(x.dtype))


def categorical(rng: jax.Array, logits: jax.Array) -> jax.Array:
  """One draw per row from softmax(logits) [B, V] -> [B] int32 (-inf logits never drawn)."""
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def segment_attention(q: jax.Array, segments, T: int) -> jax.Array:
  """Attention of q [N, K, m, H] (scaled; m = T * queries per kv head) -> [N, K, m, H] float32.

  segments: (k [R, K, H, S], v [R, K, S, H], visible, g) tuples as
  grpojax.ops.decode_attention takes them. Each product is a batched matmul
  over (R, K) of the cache as stored; the softmax is taken segment by segment
  against the global max and divided by the total once at the end.
  """
  N, K, m, _ = q.shape
  f32 = jnp.float32

  def by_segment(x, g):  # [N, K, m, X] -> [N/g, K, g*m, X]
    return x.reshape(N // g, g, K, m, -1).transpose(0, 2, 1, 3, 4).reshape(N // g, K, g * m, -1)

  def by_row(x, g):  # the inverse
    return x.reshape(N // g, K, g, m, -1).transpose(0, 2, 1, 3, 4).reshape(N, K, m, -1)

  scores, top = [], None
  for k, v, visible, g in segments:
    s = jnp.einsum("rkmh,rkhs->rkms", by_segment(q, g), k, preferred_element_type=f32)
    if visible is not None:
      S = k.shape[-1]
      visible = jnp.broadcast_to(visible, (N, T, S)).reshape(N // g, g, 1, T, 1, S)
      visible = jnp.broadcast_to(visible, (N // g, g, 1, T, m // T, S))
      s = jnp.where(visible.reshape(N // g, 1, g * m, S), s, MASKED)
    scores.append(s)
    s_max = by_row(jnp.max(s, axis=-1, keepdims=True), g)
    top = s_max if top is None else jnp.maximum(top, s_max)
  # A query always sees at least its own slot (the caller's masks ensure it); were
  # one to see none, the finite mask value would give it finite garbage, never NaN.
  out, total = 0.0, 0.0
  for (k, v, _, g), s in zip(segments, scores):
    p = jnp.exp(s - by_segment(top, g))
    total = total + by_row(jnp.sum(p, axis=-1, keepdims=True), g)
    out = out + by_row(jnp.einsum("rkms,rksh->rkmh", p.astype(v.dtype), v,
                                  preferred_element_type=f32), g)
  return out / total
