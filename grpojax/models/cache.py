"""The decoding cache: an explicit pytree passed into and returned by `decode_step`.

Axes: L layers, B prompts, g rows per prompt (a group), N = B * g rows,
K kv heads, P prompt slots, T completion slots, H head dim.

GRPO decodes g samples of every prompt, so the prompts' keys and values are
stored once per prompt and read by each group's g rows (never repeated to N
rows: g times less memory and reading). Completion tokens go to their own
slots; all rows write the same slot at each step, so one scalar `length` says
where the next token goes.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  # One array per layer, not one stacked [L, ...] array: the decode step runs
  # its layers unrolled and updates each layer's buffer in place, where a layer
  # scan would copy every layer's slice per decode step. Keys [H, S] and values
  # [S, H] make both attention products plain batched matmuls over (rows, K),
  # with no per-step transpose (bench/RESULTS.md, sampler items 1 and 3).
  prompt_k: tuple[jax.Array, ...]  # L x [B, K, H, P] keys after RoPE (and q/k norm)
  prompt_v: tuple[jax.Array, ...]  # L x [B, K, P, H]
  prompt_valid: jax.Array  # [B, P] bool: slot holds a real prompt token (not left padding)
  k: tuple[jax.Array, ...]  # L x [N, K, H, T] completion keys
  v: tuple[jax.Array, ...]  # L x [N, K, T, H]
  length: jax.Array  # [] int32: completion slots written, the next one to write
  # RoPE (cos, sin) [N, T, 1, H/2] of every completion slot, computed once: inside
  # the loop XLA would fuse sin/cos into each layer's q and k and evaluate them per head.
  rope: tuple[jax.Array, jax.Array]
  group: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def max_new_tokens(self) -> int:
    """T, the completion slots (static)."""
    return self.v[0].shape[2]

  @property
  def rows(self) -> int:
    """N = B * group, the rows decoded."""
    return self.k[0].shape[0]

  @classmethod
  def after_prefill(cls, ks: jax.Array, vs: jax.Array, prompt_valid: jax.Array, *, group: int,
                    max_new_tokens: int, rope) -> KVCache:
    """The cache from a prefill's stacked keys and values ks, vs [L, B, P, K, H]."""
    L, B, _, K, H = ks.shape
    N, dt = B * group, ks.dtype
    return cls(
        prompt_k=tuple(ks[i].transpose(0, 2, 3, 1) for i in range(L)),
        prompt_v=tuple(vs[i].transpose(0, 2, 1, 3) for i in range(L)),
        prompt_valid=prompt_valid.astype(bool),
        k=tuple(jnp.zeros((N, K, H, max_new_tokens), dt) for _ in range(L)),
        v=tuple(jnp.zeros((N, K, max_new_tokens, H), dt) for _ in range(L)),
        length=jnp.zeros((), jnp.int32),
        rope=rope,
        group=group,
    )


def write(k: jax.Array, v: jax.Array, new_k: jax.Array, new_v: jax.Array, index: jax.Array):
  """One layer's (k [B, K, H, S], v [B, K, S, H]) with new_k, new_v [B, T, K, H] at slot `index`."""
  zero = jnp.zeros((), jnp.int32)
  index = jnp.asarray(index, jnp.int32)
  k = jax.lax.dynamic_update_slice(k, new_k.transpose(0, 2, 3, 1).astype(k.dtype), (zero, zero, zero, index))
  v = jax.lax.dynamic_update_slice(v, new_v.transpose(0, 2, 1, 3).astype(v.dtype), (zero, zero, index, zero))
  return k, v


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
