"""The KV cache: an explicit pytree passed into and returned by the model.

Axes: L layers, B rows, K kv heads, S cache slots, H head dim, T new tokens.

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

@flax.struct.dataclass
class KVCache:
  # One array per layer, not one stacked [L, ...] array: the cached forward runs
  # its layers unrolled and updates each layer's buffer in place, where a layer
  # scan would copy every layer's slice per decode step. Keys [H, S] and values
  # [S, H] make both attention products plain batched matmuls over (B, K), with
  # no per-step transpose (timings in bench/RESULTS.md, sampler items 1 and 3).
  k: tuple[jax.Array, ...]  # L x [B, K, H, S] keys after RoPE (and q/k norm)
  v: tuple[jax.Array, ...]  # L x [B, K, S, H]
  valid: jax.Array  # [B, S] bool: slot holds a real token
  index: jax.Array  # [] int32: next slot to write, shared by all rows
  next_pos: jax.Array  # [B] int32: position of each row's next token

  @property
  def max_len(self) -> int:
    """S, the number of slots (static)."""
    return self.v[0].shape[2]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache of `max_len` slots: size it for prompt + all new tokens.

  Writes past `max_len` are not detected inside jit (the update slice would
  clamp), so the caller owns the budget: prompt length + max_new_tokens <= max_len.
  """
  if config.sliding_window is not None and max_len > config.sliding_window:
    raise ValueError(f"cache of {max_len} slots exceeds sliding_window={config.sliding_window}; "
                     "sliding-window attention is not supported, keep sequences within the window")
  B, K, S, H = batch_size, config.num_kv_heads, max_len, config.head_dim
  dtype = jnp.dtype(dtype or config.dtype)
  zeros = lambda *shape: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
  return KVCache(
      k=zeros(B, K, H, S),
      v=zeros(B, K, S, H),
      valid=jnp.zeros((batch_size, max_len), bool),
      index=jnp.zeros((), jnp.int32),
      next_pos=jnp.zeros((batch_size,), jnp.int32),
  )


def repeat_rows(cache: KVCache, n: int) -> KVCache:
  """Each row repeated n times, contiguously: row b becomes rows b*n .. b*n+n-1.

  This is the group broadcast of GRPO: prefill B prompts once, then decode B*n rows.
  """
  return KVCache(
      k=tuple(jnp.repeat(x, n, axis=0) for x in cache.k),
      v=tuple(jnp.repeat(x, n, axis=0) for x in cache.v),
      valid=jnp.repeat(cache.valid, n, axis=0),
      index=cache.index,
      next_pos=jnp.repeat(cache.next_pos, n, axis=0),
  )


def write(k: jax.Array, v: jax.Array, new_k: jax.Array, new_v: jax.Array, index: jax.Array):
  """One layer's (k [B, K, H, S], v [B, K, S, H]) with new_k, new_v [B, T, K, H] at slot `index`."""
  zero = jnp.zeros((), jnp.int32)
  index = jnp.asarray(index, jnp.int32)
  k = jax.lax.dynamic_update_slice(k, new_k.transpose(0, 2, 3, 1).astype(k.dtype), (zero, zero, zero, index))
  v = jax.lax.dynamic_update_slice(v, new_v.transpose(0, 2, 1, 3).astype(v.dtype), (zero, zero, index, zero))
  return k, v


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
