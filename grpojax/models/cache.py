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


def attention_mask(kv_valid: jax.Array, q_slot: jax.Array, kv_slot: jax.Array,
                   window=None) -> jax.Array:
  """Causal + padding mask [B, 1, T, S] for queries at slots q_slot [T] over keys at kv_slot [S];
  with a sliding window (an int or int32 scalar), only keys q - window < k <= q (HF's bound).

  A query always sees its own slot, even when that slot is padding: padded queries
  then produce finite garbage (later masked out by the caller) instead of a softmax
  over nothing, which would be NaN on some backends and poison gradients.
  """
  causal = kv_slot[None, :] <= q_slot[:, None]  # [T, S]
  own = kv_slot[None, :] == q_slot[:, None]
  if window is not None:
    causal = causal & (q_slot[:, None] - kv_slot[None, :] < window)
  visible = causal[None] & (kv_valid[:, None, :] | own[None])  # [B, T, S]
  return visible[:, None]


@flax.struct.dataclass
class PagedCache:
  """The rollout engine's cache (sampling/engine/): prompts stored once, completions in pages.

  Axes as above, plus S decode slots, M pages of p tokens. A slot decodes one
  row at a time; a row's completion keys and values live in pages of a pool
  shared by all slots, taken as it grows and returned when it ends, so the
  pool holds the live tokens, not every row at full length. The page a slot
  is filling lives in the slot's own buffer, copied whole into its pool page
  when full: the pool is written a page at a time, never a token (a token's
  scatter into the pool makes a TPU keep the pool in a layout its reads then
  copy, the whole pool, every step).
  """

  prompt_k: tuple[jax.Array, ...]  # L x [B, K, H, P], as KVCache
  prompt_v: tuple[jax.Array, ...]  # L x [B, K, P, H]
  prompt_valid: jax.Array  # [B, P] bool
  prompt_length: jax.Array  # [B] int32: real prompt tokens, the first completion position
  # Keys and values alike [H, p] per page: the page's tokens minor, so a TPU stores
  # a page of p >= 128 tokens unpadded whatever H is (H = 64 minor is padded to 128
  # lanes, twice the bytes), and both products are plain matmuls per (page, K).
  k_pages: tuple[jax.Array, ...]  # L x [K, M, H, p]
  v_pages: tuple[jax.Array, ...]  # L x [K, M, H, p]
  slot_k: tuple[jax.Array, ...]  # L x [S, K, H, p]: each slot's page in progress
  slot_v: tuple[jax.Array, ...]  # L x [S, K, H, p]
  page_owner: jax.Array  # [M] int32: the slot holding the page, -1 when free
  page_start: jax.Array  # [M] int32: completion position of the page's first token
  slot_row: jax.Array  # [S] int32: the row a slot decodes, -1 when idle
  slot_position: jax.Array  # [S] int32: completion position of the token fed this step
  slot_page: jax.Array  # [S] int32: the pool page of the slot's page in progress (M: none)
  group: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def page_size(self) -> int:
    return self.k_pages[0].shape[3]

  @property
  def num_pages(self) -> int:
    return self.k_pages[0].shape[1]

  @property
  def slots(self) -> int:
    return self.slot_row.shape[0]

  @classmethod
  def after_prefill(cls, cache: KVCache, prompt_length: jax.Array, *, slots: int, pages: int,
                    page_size: int, prompt_multiple: int = 1) -> PagedCache:
    """An empty pool beside a prefill's prompts (cache: `transformer.prefill`'s; its
    completion buffers are left unused, so XLA never allocates them). The prompts are
    padded at their end to a multiple of prompt_multiple positions, never visible
    (ops.paged_prompt_multiple: a kernel's chunk)."""
    K, H = cache.prompt_v[0].shape[1], cache.prompt_v[0].shape[3]
    dt = cache.prompt_v[0].dtype
    zeros = lambda *shape: tuple(jnp.zeros(shape, dt) for _ in cache.prompt_k)  # noqa: E731
    pad = -cache.prompt_valid.shape[1] % prompt_multiple
    return cls(
        prompt_k=tuple(jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, pad))) for k in cache.prompt_k),
        prompt_v=tuple(jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0))) for v in cache.prompt_v),
        prompt_valid=jnp.pad(cache.prompt_valid, ((0, 0), (0, pad))),
        prompt_length=prompt_length.astype(jnp.int32),
        k_pages=zeros(K, pages, H, page_size), v_pages=zeros(K, pages, H, page_size),
        slot_k=zeros(slots, K, H, page_size), slot_v=zeros(slots, K, H, page_size),
        page_owner=jnp.full((pages,), -1, jnp.int32), page_start=jnp.zeros((pages,), jnp.int32),
        slot_row=jnp.full((slots,), -1, jnp.int32), slot_position=jnp.zeros((slots,), jnp.int32),
        slot_page=jnp.full((slots,), pages, jnp.int32), group=cache.group)

  def compact(self, slots: int) -> PagedCache:
    """The cache with its running slots, in order, gathered into the first of `slots`
    slots; the pages they own follow them. The caller ensures at most `slots` run:
    the pages of a running slot left out would be freed under it."""
    order = jnp.argsort(self.slot_row < 0, stable=True)[:slots]  # running first
    renamed = jnp.full((self.slots,), -1, jnp.int32).at[order].set(
        jnp.arange(slots, dtype=jnp.int32))
    owner = jnp.where(self.page_owner >= 0, renamed[jnp.maximum(self.page_owner, 0)], -1)
    return self.replace(slot_k=tuple(k[order] for k in self.slot_k),
                        slot_v=tuple(v[order] for v in self.slot_v), page_owner=owner,
                        slot_row=self.slot_row[order], slot_position=self.slot_position[order],
                        slot_page=self.slot_page[order])

  def page_full(self) -> jax.Array:
    """[M] bool: pages in the pool whose p tokens are all written, before this step's."""
    owner = jnp.maximum(self.page_owner, 0)
    return (self.page_owner >= 0) & (self.page_start + self.page_size <= self.slot_position[owner])

  def own_visible(self) -> jax.Array:
    """[S, p] bool: the tokens of its page in progress a slot's query sees (through
    the fed token's; the rest are another row's or not yet written)."""
    return jnp.arange(self.page_size)[None, :] <= (self.slot_position % self.page_size)[:, None]
