"""The KV cache: an explicit pytree passed into and returned by the model.

Axes: L layers, B rows, S cache slots, K kv heads, H head dim, T new tokens.

All rows write the same slot at each step (prompts are left-padded to one
length), so a single scalar `index` says where the next tokens go; `valid`
marks which slots hold real tokens (False for left padding), and `next_pos`
holds each row's RoPE position for its next token, which differs per row when
prompts have different real lengths.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from grpojax.models.config import ModelConfig

# Logical axis names of k and v, for sharding rules (see grpojax/models/sharding.py).
CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, H] keys after RoPE (and q/k norm)
  v: jax.Array  # [L, B, S, K, H]
  valid: jax.Array  # [B, S] bool: slot holds a real token
  index: jax.Array  # [] int32: next slot to write, shared by all rows
  next_pos: jax.Array  # [B] int32: position of each row's next token

  @property
  def max_len(self) -> int:
    """S, the number of slots (static)."""
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache of `max_len` slots: size it for prompt + all new tokens.

  Writes past `max_len` are not detected inside jit (the update slice would
  clamp), so the caller owns the budget: prompt length + max_new_tokens <= max_len.
  """
  if config.sliding_window is not None and max_len > config.sliding_window:
    raise ValueError(f"cache of {max_len} slots exceeds sliding_window={config.sliding_window}; "
                     "sliding-window attention is not supported, keep sequences within the window")
  shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
  dtype = jnp.dtype(dtype or config.dtype)
  return KVCache(
      k=jnp.zeros(shape, dtype),
      v=jnp.zeros(shape, dtype),
      valid=jnp.zeros((batch_size, max_len), bool),
      index=jnp.zeros((), jnp.int32),
      next_pos=jnp.zeros((batch_size,), jnp.int32),
  )


def repeat_rows(cache: KVCache, n: int) -> KVCache:
  """Each row repeated n times, contiguously: row b becomes rows b*n .. b*n+n-1.

  This is the group broadcast of GRPO: prefill B prompts once, then decode B*n rows.
  """
  return KVCache(
      k=jnp.repeat(cache.k, n, axis=1),
      v=jnp.repeat(cache.v, n, axis=1),
      valid=jnp.repeat(cache.valid, n, axis=0),
      index=cache.index,
      next_pos=jnp.repeat(cache.next_pos, n, axis=0),
  )


def write(kv: jax.Array, new: jax.Array, layer: jax.Array, index: jax.Array) -> jax.Array:
  """All layers' keys or values [L, B, S, K, H] with `new` [B, T, K, H] at (layer, slot index).

  Writing into the whole stacked array (a scan carry) lets XLA update it in place.
  """
  zero = jnp.zeros((), jnp.int32)
  start = (jnp.asarray(layer, jnp.int32), zero, jnp.asarray(index, jnp.int32), zero, zero)
  return jax.lax.dynamic_update_slice(kv, new[None].astype(kv.dtype), start)


def write_valid(valid: jax.Array, mask: jax.Array, index: jax.Array) -> jax.Array:
  """valid [B, S] with mask [B, T] written at slot `index`."""
  zero = jnp.zeros((), jnp.int32)
  return jax.lax.dynamic_update_slice(valid, mask.astype(bool), (zero, index.astype(jnp.int32)))


def attention_mask(kv_valid: jax.Array, q_slot: jax.Array, kv_slot: jax.Array) -> jax.Array:
  """Causal + padding mask [B, 1, T, S] for queries at slots q_slot [T] over keys at kv_slot [S].

  A query always sees its own slot, even when that slot is padding: padded queries
  then produce finite garbage (later masked out by the caller) instead of a softmax
  over nothing, which would be NaN on some backends and poison gradients.
  """
  causal = kv_slot[None, :] <= q_slot[:, None]  # [T, S]
  own = kv_slot[None, :] == q_slot[:, None]
  visible = causal[None] & (kv_valid[:, None, :] | own[None])  # [B, T, S]
  return visible[:, None]
