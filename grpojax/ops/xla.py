"""The "xla" backend of grpojax.ops: plain JAX, the reference on every platform.

Axes: N query rows, K kv heads, m queries per kv head and row, H head dim,
S cache slots, R rows of a cache segment (N = g * R), V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.core.logprobs import soft_cap

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


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                    softcap: float | None = None) -> jax.Array:
  """jax.nn.dot_product_attention's job with soft-capped scores: q [B, T, Nq, H] over
  k, v [B, S, K, H] (K divides Nq) where mask [B, 1, T, S] is True; scores and softmax
  in float32. Returns [B, T, Nq, H] in q's dtype."""
  B, T, Nq, H = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, Nq // K, H)
  s = jnp.einsum("btkmh,bskh->bkmts", qg, k, preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask[:, :, None], soft_cap(s, softcap), MASKED)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("bkmts,bskh->btkmh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(B, T, Nq, H).astype(q.dtype)


def segment_attention(q: jax.Array, segments, T: int, softcap: float | None = None) -> jax.Array:
  """Attention of q [N, K, m, H] (scaled; m = T * queries per kv head) -> [N, K, m, H] float32.

  segments: (k [R, K, H, S], v [R, K, S, H], visible, g) tuples as
  grpojax.ops.decode_attention takes them. Each product is a batched matmul
  over (R, K) of the cache as stored; the softmax is taken segment by segment
  against the global max and divided by the total once at the end. softcap: the
  scores capped before masking (Gemma 2).
  """
  N, K, m, _ = q.shape
  f32 = jnp.float32

  def by_segment(x, g):  # [N, K, m, X] -> [N/g, K, g*m, X]
    return x.reshape(N // g, g, K, m, -1).transpose(0, 2, 1, 3, 4).reshape(N // g, K, g * m, -1)

  def by_row(x, g):  # the inverse
    return x.reshape(N // g, K, g, m, -1).transpose(0, 2, 1, 3, 4).reshape(N, K, m, -1)

  scores, top = [], None
  for k, v, visible, g in segments:
    s = soft_cap(jnp.einsum("rkmh,rkhs->rkms", by_segment(q, g), k, preferred_element_type=f32),
                 softcap)
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


# Tokens of keys read per trip of paged_attention's loops: few trips (each a
# kernel launch per layer), and at most a chunk less one page read past the
# live pages.
PAGED_CHUNK_TOKENS = 2048


def paged_keys_read(pages: jax.Array, page_size: int, num_pages: int, prompts: jax.Array,
                    prompt_length: int, num_prompts: int, slots: int) -> jax.Array:
  """Keys (each with its value) one layer's `paged_attention` reads: `pages` full
  pages and `prompts` prompts with a decoding row, in whole chunks of its loops,
  and every slot's page in progress."""
  chunk = min(num_pages, max(1, PAGED_CHUNK_TOKENS // page_size))
  p_chunk = min(num_prompts, max(1, PAGED_CHUNK_TOKENS // prompt_length))
  return (-(-pages // chunk) * chunk * page_size + slots * page_size
          + -(-prompts // p_chunk) * p_chunk * prompt_length)


def paged_attention(q: jax.Array, prompt, pool, own, slot_row: jax.Array, *, window=None,
                    softcap: float | None = None) -> jax.Array:
  """One decode query per slot over its row's prompt, full pages and page in progress
  -> [S, K, m, H] float32.

  q: [S, K, m, H] scaled. prompt: (k [B, K, H, P], v [B, K, P, H], visible [B, P],
  g): the B prompts stored once, row r reading prompt r // g. pool: (k_pages,
  v_pages [K, M, H, p], owner [M]: the slot a page belongs to, -1 free, full [M]
  bool: the page's p tokens are all written and seen by its owner). own:
  (k, v [S, K, H, p], visible [S, p]): each slot's page in progress. slot_row:
  [S] the row each slot decodes (-1 idle: finite garbage out).

  Only live keys are read: the prompts that have a decoding row, each once for
  all its rows; the full pages, each scored by its owner's query alone; and
  each slot's own page. Prompts and full pages are listed (compacted) and read
  in chunks of about PAGED_CHUNK_TOKENS keys, in loops of as many trips as the
  live keys need: the bytes read follow the live tokens, not the pool's size or
  slots x the longest row. The softmax is online across chunks (float32).
  window: None, or (w, position [S] int32: each slot's completion position,
  page_start [M] int32: each page's first completion position): a key w or more
  positions before its query is not seen (a prompt key at slot i of P is P + t - i
  before completion position t). softcap: the scores capped before masking.
  """
  return _paged_finish(_paged_pool(q, pool, _paged_local(q, prompt, own, slot_row, window, softcap),
                                   window, softcap))


def _paged_finish(acc) -> jax.Array:
  """The attention [S, K, m, H] float32 from a partial softmax (top, total, out)."""
  _, total, out = acc
  # A running slot always sees its newest token (in its own page): total >= 1.
  return out / jnp.maximum(total, 1e-30)[..., None]


def _paged_merge(a, b):
  """Two partial softmaxes (top [S, K, m], total [S, K, m], out [S, K, m, H]) over
  disjoint keys -> theirs over the union."""
  top = jnp.maximum(a[0], b[0])
  fa, fb = jnp.exp(a[0] - top), jnp.exp(b[0] - top)
  return top, fa * a[1] + fb * b[1], fa[..., None] * a[2] + fb[..., None] * b[2]


def page_lists(owner: jax.Array, full: jax.Array, slots: int):
  """The full pages of each slot as one list: (order [M] int32, the pages grouped by
  owner slot, then the rest; start [S], count [S] int32: slot s's pages are
  order[start[s]:start[s] + count[s]]), the layout the paged kernels read."""
  key = jnp.where(full & (owner >= 0), owner, slots)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  count = jnp.zeros((slots + 1,), jnp.int32).at[key].add(1)[:slots]
  return order, jnp.cumsum(count) - count, count


def slot_prompts(slot_row: jax.Array, group: int) -> jax.Array:
  """[S] int32: the prompt each slot reads, row // group; an idle slot repeats the
  last running slot's before it (0 before any), so that a kernel's prompt block
  index does not change over it and no prompt is fetched for it."""
  running = slot_row >= 0
  last = jax.lax.cummax(jnp.where(running, jnp.arange(slot_row.shape[0]), -1))
  return jnp.where(last >= 0, jnp.maximum(slot_row[jnp.maximum(last, 0)], 0) // group,
                   0).astype(jnp.int32)


def _paged_local(q: jax.Array, prompt, own, slot_row: jax.Array, window=None, softcap=None):
  """The partial softmax (top, total, out) of `paged_attention` over each slot's
  page in progress and its row's prompt: everything but the pool's full pages."""
  S, K, m, H = q.shape
  pk, pv, p_visible, g = prompt
  B, P = p_visible.shape
  N = B * g
  f32 = jnp.float32

  # The page in progress: every slot reads its own, dense.
  ok, ov, o_visible = own
  s = soft_cap(jnp.einsum("skqh,skhp->skqp", q, ok, preferred_element_type=f32), softcap)
  if window is not None:  # the page in progress starts at its slot's position less its offset
    w, position, _ = window
    p_own = ok.shape[-1]
    o_visible = o_visible & (position[:, None] % p_own - jnp.arange(p_own)[None] < w)
  s = jnp.where(o_visible[:, None, None, :], s, MASKED)
  top = jnp.max(s, axis=-1)
  e = jnp.exp(s - top[..., None])
  acc = (top, jnp.sum(e, axis=-1),
         jnp.einsum("skqp,skhp->skqh", e.astype(ov.dtype), ov, preferred_element_type=f32))

  # The prompts: per prompt (max, sum, out) over its g rows' queries.
  idle = slot_row < 0
  slot_of_row = jnp.full((N,), S, jnp.int32).at[jnp.where(idle, N, slot_row)].set(
      jnp.arange(S, dtype=jnp.int32), mode="drop")
  q_rows = jnp.take(q, slot_of_row, axis=0, mode="fill", fill_value=0)  # [N, K, m, H]
  q_rows = q_rows.reshape(B, g, K, m, H).transpose(0, 2, 1, 3, 4).reshape(B, K, g * m, H)
  live = jnp.any((slot_of_row < S).reshape(B, g), axis=1)
  chunk = min(B, max(1, PAGED_CHUNK_TOKENS // P))
  ids = jnp.nonzero(live, size=B + chunk, fill_value=B)[0]
  if window is not None:  # each query's distance to prompt slot i: P + t - i
    t_rows = jnp.take(window[1], slot_of_row, mode="fill", fill_value=0)  # [N]
    t_rows = jnp.broadcast_to(t_rows.reshape(B, g, 1), (B, g, m)).reshape(B, 1, g * m)

  def prompt_chunk(i, acc):
    b = jax.lax.dynamic_slice_in_dim(ids, i * chunk, chunk)  # B: past the live ones
    take = lambda x: jnp.take(x, b, axis=0, mode="fill", fill_value=0)  # noqa: E731
    s = soft_cap(jnp.einsum("bkqh,bkhp->bkqp", take(q_rows), take(pk),
                            preferred_element_type=f32), softcap)
    visible = take(p_visible)[:, None, None, :]
    if window is not None:
      visible = visible & (P + take(t_rows)[..., None] - jnp.arange(P) < window[0])
    s = jnp.where(visible, s, MASKED)
    top = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - top)
    out = jnp.einsum("bkqp,bkph->bkqh", e.astype(pv.dtype), take(pv), preferred_element_type=f32)
    put = lambda a, x: a.at[b].set(x, mode="drop")  # noqa: E731
    return tuple(map(put, acc, (top, jnp.sum(e, axis=-1, keepdims=True), out)))

  p_acc = (jnp.full((B, K, g * m, 1), MASKED, f32), jnp.zeros((B, K, g * m, 1), f32),
           jnp.zeros((B, K, g * m, H), f32))
  p_acc = jax.lax.fori_loop(0, -(-jnp.sum(live) // chunk), prompt_chunk, p_acc)
  per_slot = lambda x: jnp.take(  # noqa: E731  [B, K, g*m, X] -> [S, K, m, X]
      x.reshape(B, K, g, m, -1).transpose(0, 2, 1, 3, 4).reshape(N, K, m, -1),
      jnp.maximum(slot_row, 0), axis=0)
  p_top, p_total, p_out = (per_slot(a) for a in p_acc)
  return _paged_merge(acc, (p_top[..., 0], p_total[..., 0], p_out))


def _paged_pool(q: jax.Array, pool, acc, window=None, softcap=None):
  """`acc`, a partial softmax over each slot's other keys, merged with the pool's
  full pages, each scored by its owner's query, in chunks of compacted pages."""
  S = q.shape[0]
  f32 = jnp.float32
  kp, vp, owner, full = pool
  M, p = full.shape[0], kp.shape[3]
  chunk = min(M, max(1, PAGED_CHUNK_TOKENS // p))
  ids = jnp.nonzero(full, size=M + chunk, fill_value=M)[0]

  def page_chunk(i, acc):
    top, total, out = acc
    n = jax.lax.dynamic_slice_in_dim(ids, i * chunk, chunk)  # M: past the full ones
    o = jnp.take(jnp.where(full, owner, -1), n, mode="fill", fill_value=-1)
    seg = jnp.where(o < 0, S, o)  # a dropped segment
    k = jnp.take(kp, n, axis=1, mode="fill", fill_value=0)  # [K, C, H, p]
    v = jnp.take(vp, n, axis=1, mode="fill", fill_value=0)
    q_seg = jnp.take(q, seg, axis=0, mode="fill", fill_value=0)
    s = soft_cap(jnp.einsum("nkqh,knhp->nkqp", q_seg, k, preferred_element_type=f32), softcap)
    visible = (o >= 0)[:, None, None, None]
    if window is not None:  # the owner's position less the page's key positions
      w, position, page_start = window
      t = jnp.take(position, seg, mode="fill", fill_value=0)
      start = jnp.take(page_start, n, mode="fill", fill_value=0)
      visible = visible & ((t - start)[:, None] - jnp.arange(p)[None] < w)[:, None, None, :]
    s = jnp.where(visible, s, MASKED)
    new_top = jnp.maximum(top, jax.ops.segment_max(jnp.max(s, axis=-1), seg,
                                                   num_segments=S + 1)[:S])
    rescale = jnp.exp(top - new_top)
    e = jnp.exp(s - jnp.take(new_top, seg, axis=0, mode="fill", fill_value=0)[..., None])
    total = total * rescale + jax.ops.segment_sum(jnp.sum(e, axis=-1), seg, num_segments=S + 1)[:S]
    out = out * rescale[..., None] + jax.ops.segment_sum(
        jnp.einsum("nkqp,knhp->nkqh", e.astype(v.dtype), v, preferred_element_type=f32),
        seg, num_segments=S + 1)[:S]
    return new_top, total, out

  trips = -(-jnp.sum(full) // chunk)
  return jax.lax.fori_loop(0, trips, page_chunk, acc)


# ------------------------------------------------- full-sequence attention


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array,
                        scale: float, block: int, *, window=None,
                        softcap: float | None = None) -> jax.Array:
  """Causal attention in blocks of `block` queries x `block` keys with an online
  softmax: memory O(block² + S) per row and head, forward and backward.

  q [B, T, Nq, H]; k, v [B, S, K, H] (K divides Nq: grouped-query heads);
  kv_valid [B, S] bool; the queries are the last T key positions: query t sees
  key s <= S - T + t when kv_valid[s] or s is its own position, the mask of
  `models.cache.attention_mask`. Scores and softmax statistics in float32; the
  backward recomputes each block's scores (custom VJP) instead of storing any
  [T, S] matrix. window (int or int32 scalar): query t also sees no key window or
  more slots before it; softcap: scores capped to softcap * tanh(s / softcap) before
  masking (its derivative in the backward). Neither: the program is the plain one.
  Returns [B, T, Nq, H] in q's dtype.
  """
  B, T, Nq, H = q.shape
  S, K = k.shape[1], k.shape[2]
  q_slot, kv_slot = jnp.arange(S - T, S), jnp.arange(S)
  never = jnp.iinfo(jnp.int32).max
  pad_k, pad_q = -S % block, -T % block
  if pad_k:  # padded keys: past every query's slot, never visible
    k = jnp.pad(k, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
    kv_valid = jnp.pad(kv_valid, ((0, 0), (0, pad_k)))
    kv_slot = jnp.pad(kv_slot, (0, pad_k), constant_values=never)
  if pad_q:  # padded queries: see only themselves (a padded key's slot), dropped below
    q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0)))
    q_slot = jnp.pad(q_slot, (0, pad_q), constant_values=never)
  n, nq, m = (S + pad_k) // block, (T + pad_q) // block, Nq // K
  qb = q.reshape(B, nq, block, K, m, H).transpose(1, 0, 3, 4, 2, 5)  # [nq, B, K, m, bq, H]
  kb = lambda x: x.reshape(B, n, block, K, H).transpose(1, 0, 3, 2, 4)  # noqa: E731
  if window is not None:
    window = jnp.asarray(window, jnp.int32)
  out = _flash(float(scale), softcap, qb, kb(k), kb(v),
               kv_valid.reshape(B, n, block).transpose(1, 0, 2),
               kv_slot.astype(jnp.int32).reshape(n, block),
               q_slot.astype(jnp.int32).reshape(nq, block), window)
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * block, Nq, H)
  return out[:, :T].astype(q.dtype)


def _scores(scale, cap, q, k_b, valid_b, slot_b, q_slot, window):
  """(masked scores [B, K, m, bq, bk] of a query block over a key block, float32; the
  softcap's derivative d capped / d score, None without a cap)."""
  s = jnp.einsum("bkmth,bksh->bkmts", q, k_b, preferred_element_type=jnp.float32) * scale
  # Tied to the scores: the mask depends on nothing the model's layers change, so
  # JAX would hoist every block's out of the layer scan, [T, S] of them at once.
  s, valid_b, slot_b, q_slot = jax.lax.optimization_barrier((s, valid_b, slot_b, q_slot))
  causal = slot_b[None, :] <= q_slot[:, None]
  if window is not None:
    causal = causal & (q_slot[:, None] - slot_b[None, :] < window)
  own = slot_b[None, :] == q_slot[:, None]
  visible = causal[None] & (valid_b[:, None, :] | own[None])
  d_cap = None
  if cap is not None:
    t = jnp.tanh(s / cap)
    s, d_cap = cap * t, 1 - t * t
  return jnp.where(visible[:, None, None], s, MASKED), d_cap


def _flash_block(scale, cap, q, k, v, valid, slot, q_slot, window):
  """One query block over every key block: (out, log-sum-exp of its rows)."""
  B, K, m, T, H = q.shape
  init = (jnp.full((B, K, m, T), MASKED, jnp.float32), jnp.zeros((B, K, m, T), jnp.float32),
          jnp.zeros((B, K, m, T, H), jnp.float32))

  def step(carry, blk):
    mx, l, acc = carry
    k_b, v_b, valid_b, slot_b = blk
    s, _ = _scores(scale, cap, q, k_b, valid_b, slot_b, q_slot, window)
    new = jnp.maximum(mx, s.max(-1))
    p = jnp.exp(s - new[..., None])
    fix = jnp.exp(mx - new)
    acc = acc * fix[..., None] + jnp.einsum("bkmts,bksh->bkmth", p.astype(v_b.dtype), v_b,
                                            preferred_element_type=jnp.float32)
    return (new, l * fix + p.sum(-1), acc), None

  (mx, l, acc), _ = jax.lax.scan(step, init, (k, v, valid, slot))
  return (acc / l[..., None]).astype(q.dtype), mx + jnp.log(l)


def _flash_forward(scale, cap, q, k, v, valid, slot, q_slot, window):
  return jax.lax.map(lambda a: _flash_block(scale, cap, a[0], k, v, valid, slot, a[1], window),
                     (q, q_slot))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(scale, cap, q, k, v, valid, slot, q_slot, window):
  return _flash_forward(scale, cap, q, k, v, valid, slot, q_slot, window)[0]


def _flash_fwd(scale, cap, q, k, v, valid, slot, q_slot, window):
  out, lse = _flash_forward(scale, cap, q, k, v, valid, slot, q_slot, window)
  return out, (q, k, v, valid, slot, q_slot, window, out, lse)


def _flash_bwd(scale, cap, res, d_out):
  """Per query block, every key block again: dq of the block, dk and dv summed
  over the query blocks."""
  q, k, v, valid, slot, q_slot, window, out, lse = res
  kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

  def per_query_block(dkv, a):
    q_b, qs_b, out_b, lse_b, d_b = a
    d_b = d_b.astype(jnp.float32)
    delta = jnp.sum(d_b * out_b.astype(jnp.float32), axis=-1)  # [B, K, m, bq]
    qf = q_b.astype(jnp.float32)

    def per_key_block(dq, blk):
      k_b, v_b, valid_b, slot_b = blk
      s, d_cap = _scores(scale, cap, q_b, k_b.astype(q_b.dtype), valid_b, slot_b, qs_b, window)
      p = jnp.exp(s - lse_b[..., None])
      dv = jnp.einsum("bkmts,bkmth->bksh", p, d_b)
      ds = p * (jnp.einsum("bkmth,bksh->bkmts", d_b, v_b) - delta[..., None]) * scale
      if d_cap is not None:  # through the cap: d(c tanh(s / c)) = (1 - tanh^2) ds
        ds = ds * d_cap
      return dq + jnp.einsum("bkmts,bksh->bkmth", ds, k_b), (
          jnp.einsum("bkmts,bkmth->bksh", ds, qf), dv)

    dq, (dk, dv) = jax.lax.scan(per_key_block, jnp.zeros(q_b.shape, jnp.float32),
                                (kf, vf, valid, slot))
    return (dkv[0] + dk, dkv[1] + dv), dq.astype(q_b.dtype)

  zeros = jnp.zeros(k.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(per_query_block, (zeros, zeros), (q, q_slot, out, lse, d_out))
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def write_token(slot_k: jax.Array, slot_v: jax.Array, new_k: jax.Array, new_v: jax.Array,
                offset: jax.Array):
  """One layer's pages in progress [S, K, H, p] with new_k, new_v [S, K, H] at offset [S]."""
  s = jnp.arange(slot_k.shape[0])
  # Indices split by a slice: the indexed [S] axis comes first, [S, K, H] as given.
  return (slot_k.at[s, :, :, offset].set(new_k.astype(slot_k.dtype)),
          slot_v.at[s, :, :, offset].set(new_v.astype(slot_v.dtype)))


def flush_pages(k_pages: jax.Array, v_pages: jax.Array, slot_k: jax.Array, slot_v: jax.Array,
                page: jax.Array):
  """One layer's pools [K, M, H, p] with each slot's page in progress [S, K, H, p]
  copied whole to its page [S] (M: not this slot's, written nowhere)."""
  return (k_pages.at[:, page].set(slot_k.transpose(1, 0, 2, 3), mode="drop"),
          v_pages.at[:, page].set(slot_v.transpose(1, 0, 2, 3), mode="drop"))
