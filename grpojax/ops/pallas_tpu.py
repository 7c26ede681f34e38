"""The "tpu" backend of grpojax.ops.attention: jax's Pallas TPU splash-attention kernel.

Why splash (jax.experimental.pallas.ops.tpu.splash_attention), not flash_attention:
- It expresses our mask exactly: a CausalMask with an offset (q_len != kv_len,
  the shared-prompt layout, queries at P = S - T .. S - 1) and-ed with segment
  ids; flash_attention's causal mask is square (q_len == kv_len), so T < S would
  need P dummy queries per row (S/T times the query work and memory).
- It skips the fully masked blocks (above the diagonal: half a causal mask's
  work) in the forward and in both backward kernels, without fetching their data.
- Grouped-query attention is native: query head j reads kv head j // (Nq // K)
  from k, v [K, S, H]; no kv head is repeated in memory.
- Its backward (custom VJP: a dK/dV kernel and a separate dQ kernel) recomputes
  each block's scores; nothing of size [T, S] is stored. The fused backward
  (`use_fused_bwd_kernel`) is not used: it holds a dQ per kv block,
  [S / block, Nq, T, H], quadratic in the sequence.

The mask. Query t (position P + t) sees key s <= P + t when kv_valid[s] or
s == P + t. As splash sees it: CausalMask((T', S'), offset=P) and segment ids
q: kv_valid[P + t], kv: kv_valid[s] (1 valid, 0 not). A valid query sees
exactly the valid keys up to its own; an invalid one sees the invalid keys up to
its own, itself among them, so no row is empty (splash's softmax needs one
visible key). Invalid queries' outputs are thus not the reference's, nor are the
gradients they send (to invalid keys only, where the reference's go to valid
ones); callers mask those outputs, so their cotangents are zero and every
gradient agrees (grpojax.ops.attention allows the difference).

Padding. The kernel's blocks must divide both lengths: T is padded to T' and S
to S' with invalid (id 0) entries at the end, past every real query's position
so never seen by one; the padded queries are dropped. Where S' == S and every
key is valid a padded query sees nothing: splash then averages the keys it ran
(finite; its mask value is finite), and it is dropped. Cost: at most a block
(and at most ~1/8 of the length beyond the 128-rounded one, see Blocks) of
extra queries and keys; the padded keys lie above every real query's diagonal,
so their blocks are skipped for all but the padded queries.

Blocks. Multiples of 128 (a TPU vreg's lanes: splash's kv blocks, segment ids
and mask rows are laid out 128 lanes wide and it refuses other sizes), at most
512 and at most `block` rounded down to 128 (at least 128): 512 x 512 f32 scores
are 1 MiB, the whole working set a few MiB of VMEM (compiled for a v5e at S up to
8192: bench/HISTORY.md); larger blocks would pad more and skip less of
the causal triangle, smaller ones take more grid steps. Of those, the largest
that pads a length by at most an eighth of it more than 128 would (S = 1100:
384, to 1152, not 512, to 1536). The same sizes serve the forward and both
backward kernels.

Rows one at a time (lax.map over B, not vmap): splash's forward writes its
log-sum-exp 128 lanes wide, [Nq, T', 128] f32 (7 KiB a position at Nq = 14)
before keeping one lane; vmapped, every row's at once (v5e, B = 16, S = 8192,
forward + backward: 2.8 GiB of temporaries against 1.0 GiB row by row).

Several devices. XLA cannot partition a Mosaic kernel (its lowering refuses
under a multi-device jit, and custom_partitioning does not reach TPUs:
jax-ml/jax#38196), so under a mesh in context (jax.set_mesh, or `with mesh:`)
`attention` runs in shard_map: each device its rows (the batch axes of
grpojax.parallel.mesh) and, where "tensor" divides K, its kv heads with their
query heads; an axis that does not divide is replicated over (correct,
redundant). Without a mesh in context a jit over several devices cannot lower
it: the caller traces under jax.set_mesh(mesh).

Scale: splash has none; q is multiplied by `scale` before the kernel, in q's
dtype (exact for H = 64 and 256, scale a power of two; one bf16 rounding of q
otherwise).

Importing this module needs no TPU: the Pallas modules are imported when
`attention` is first traced, and import on any platform. `interpret=True` runs
the same kernels through Pallas' interpreter on any backend (tests on a CPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

LANES = 128  # a TPU vector register's lanes: blocks are multiples of it
MAX_BLOCK = 512


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def block_size(length: int, hint: int) -> int:
  """The kernel block for a sequence of `length`: a multiple of 128, at most
  min(hint, 512) (rounded down to 128, at least 128) and the 128-rounded length;
  the largest that pads `length` by at most an eighth of it more than 128 does."""
  least = _round_up(length, LANES)
  cap = max(LANES, min(MAX_BLOCK, hint // LANES * LANES, least))
  for b in range(cap, LANES, -LANES):
    if _round_up(length, b) <= least + length // 8:
      return b
  return LANES


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What a kernel is built for (hashable): T queries, the last of S keys, in
  blocks of bq queries and bkv keys. Not the heads: one mask serves them all."""

  T: int
  S: int
  bq: int
  bkv: int
  interpret: bool

  @property
  def Tp(self) -> int:
    return _round_up(self.T, self.bq)

  @property
  def Sp(self) -> int:
    return _round_up(self.S, self.bkv)


@functools.lru_cache(maxsize=64)
def _kernel(layout: _Layout):
  """The splash kernel of one row: q [Nq, T', H] over k, v [K, S', H] for any
  heads (one mask for all: splash keeps one block table, whatever their number,
  so a device's share of the heads runs it too); its tables numpy arrays."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  causal = sa.CausalMask((layout.Tp, layout.Sp), offset=layout.S - layout.T)
  b, c = layout.bq, layout.bkv
  blocks = sa.BlockSizes(block_q=b, block_kv=c, block_kv_compute=c,
                         block_q_dkv=b, block_kv_dkv=c, block_kv_dkv_compute=c,
                         block_q_dq=b, block_kv_dq=c, use_fused_bwd_kernel=False)
  # Its tables (jnp.array inside) must be values to outlive the trace that asks:
  # built in a thread of its own, outside that trace and any mesh (both are
  # thread-local; a compile-only mesh has no device to hold them), kept as numpy.
  build = functools.partial(sa.make_splash_mha, sa.MultiHeadMask([causal]), block_sizes=blocks,
                            head_shards=1, q_seq_shards=1, interpret=layout.interpret)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    kernel = pool.submit(build).result()
  return jax.tree.map(np.asarray, kernel)


def _mesh():
  """The mesh in context (jax.set_mesh, or the older `with mesh:`) to split the
  kernel's work over; None if none, one device, or inside a shard_map already
  (its manual axes: the arrays are that device's)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    from jax._src import mesh as mesh_lib  # `with mesh:`: no public getter

    mesh = mesh_lib.thread_resources.env.physical_mesh
  if mesh.empty or mesh.size == 1 or getattr(mesh, "manual_axes", ()):
    return None
  return mesh


def _rows(layout: _Layout, q, k, v, kv_valid):
  """The kernel over every row, one at a time, on one device's arrays."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  T, S, Tp, Sp = layout.T, layout.S, layout.Tp, layout.Sp
  kernel = _kernel(layout)
  valid = kv_valid.astype(jnp.int32)
  q_ids = jnp.pad(valid[:, S - T:], ((0, 0), (0, Tp - T)))
  kv_ids = jnp.pad(valid, ((0, 0), (0, Sp - S)))
  qh = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  kh, vh = (jnp.pad(x, ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
            for x in (k, v))
  out = jax.lax.map(lambda a: kernel(a[0], a[1], a[2], sa.SegmentIds(a[3], a[4])),
                    (qh, kh, vh, q_ids, kv_ids))
  return out[:, :, :T].transpose(0, 2, 1, 3)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array, scale: float, *,
              block: int, interpret: bool = False) -> jax.Array:
  """grpojax.ops.attention through splash attention: q [B, T, Nq, H] over k, v
  [B, S, K, H], the queries the last T key positions, kv_valid [B, S] bool.
  Returns [B, T, Nq, H] in q's dtype; see the module docstring for the mask.
  interpret: run the kernels in Pallas' interpreter (any backend; slow)."""
  B, T, Nq, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  if T > S or Nq % K or k.shape != v.shape or kv_valid.shape != (B, S):
    raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}, "
                     f"kv_valid {kv_valid.shape}")
  layout = _Layout(T, S, block_size(T, block), block_size(S, block), bool(interpret))
  args = ((q * scale).astype(q.dtype), k, v.astype(k.dtype), kv_valid)
  mesh = _mesh()
  if mesh is None:
    return _rows(layout, *args).astype(q.dtype)
  # A Mosaic kernel cannot be partitioned by XLA: each device runs it on its own
  # rows (the batch axes) and kv heads with their query heads ("tensor"), where
  # those divide; an axis that does not is replicated over (correct, redundant).
  from jax.sharding import PartitionSpec as P

  from grpojax.parallel.mesh import BATCH_AXES

  def keep(axes, n):  # the longest prefix of `axes` in the mesh that splits n evenly
    axes = [a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1]
    while axes and n % int(np.prod([mesh.shape[a] for a in axes])):
      axes.pop()
    return tuple(axes) or None

  rows, heads = keep(BATCH_AXES, B), keep(("tensor",), K)
  qs, valid = P(rows, None, heads, None), P(rows, None)
  out = jax.shard_map(functools.partial(_rows, layout), mesh=mesh, in_specs=(qs, qs, qs, valid),
                      out_specs=qs, check_vma=False)(*args)
  return out.astype(q.dtype)


# ------------------------------------------------------------- paged decode

PAGES_PER_BLOCK = 4  # pages fetched per DMA round: 512 keys at p = 128


def paged_keys_read(slot_row: jax.Array, group: int, full_pages: jax.Array, prompt_length: int,
                    page_size: int) -> jax.Array:
  """Keys (each with its value) one layer's `paged_attention` fetches: a prompt each
  time the slots' prompt changes from one slot to the next (ops.xla.slot_prompts), every
  slot's page in progress, and the full pages in use, each once."""
  from grpojax.ops.xla import slot_prompts

  b = slot_prompts(slot_row, group)
  fetches = 1 + jnp.sum(b[1:] != b[:-1])
  return (fetches * prompt_length + slot_row.shape[0] * page_size
          + full_pages * page_size)


def paged_attention(q: jax.Array, prompt, pool, own, slot_row: jax.Array, *,
                    pages_per_block: int = PAGES_PER_BLOCK, interpret=False) -> jax.Array:
  """grpojax.ops.paged_attention as one Mosaic kernel: each slot's query over its
  row's prompt, its page in progress and its full pages -> [S, K, m, H] float32.

  Arguments as ops.xla.paged_attention (q [S, K, m, H] scaled; prompt (k
  [B, K, H, P], v [B, K, P, H], visible [B, P], g); pool (k_pages, v_pages
  [K, M, H, p], owner [M], full [M]); own (k, v [S, K, H, p], visible [S, p])).

  One grid step per (slot, kv head), in slot order. The prompt and the page in
  progress are blocks Pallas fetches by index (ops.xla.slot_prompts, from
  scalar memory): the slots of one group are consecutive, so their prompt is
  fetched once for all of them. The full pages stay in HBM: ops.xla.page_lists lists
  each slot's, prefetched to scalar memory, and the kernel copies them in by
  DMA, `pages_per_block` at a time into one of two VMEM buffers while it scores
  the other's. So the keys read are the live ones (`paged_keys_read`), not the
  pool. A block's missing pages (past the slot's count) are zeros, masked. The
  pools are pinned to HBM (compiled, not interpreted): else XLA, which sees the
  kernel take its whole operand, copies a pool that fits into VMEM first (a
  v5e at M = 1024, 32 MiB a layer: the whole pool read, every layer and step).
  An idle slot's output is finite garbage. interpret: Pallas' TPU interpreter
  (any backend; slow).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  from grpojax.ops.xla import MASKED, page_lists, slot_prompts

  S, K, m, H = q.shape
  pk, pv, p_visible, g = prompt
  k_pages, v_pages, owner, full = pool
  ok, ov, o_visible = own
  B, P = p_visible.shape
  M, p = k_pages.shape[1], k_pages.shape[3]
  b = max(1, min(pages_per_block, M))
  mp = _round_up(m, 8)  # a vreg's sublanes
  q = jnp.pad(q, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
  order, start, count = page_lists(owner, full, S)
  f32 = jnp.float32

  def kernel(order_ref, start_ref, count_ref, prompt_ref, q_ref, pk_ref, pv_ref, pvis_ref, ok_ref,
             ov_ref, ovis_ref, k_hbm, v_hbm, out_ref, k_buf, v_buf, sems):
    s, h = pl.program_id(0), pl.program_id(1)
    n, first = count_ref[s], start_ref[s]
    qs = q_ref[0, 0]  # [mp, H]

    def softmax_part(scores, visible, values, contract):
      scores = jnp.where(visible, scores, MASKED)
      top = jnp.max(scores, axis=-1, keepdims=True)
      e = jnp.exp(scores - top)
      out = jax.lax.dot_general(e.astype(values.dtype), values, ((((1,), (contract,))), ((), ())),
                                preferred_element_type=f32)
      return top, jnp.sum(e, axis=-1, keepdims=True), out

    def merge(a, c):
      top = jnp.maximum(a[0], c[0])
      fa, fc = jnp.exp(a[0] - top), jnp.exp(c[0] - top)
      return top, fa * a[1] + fc * c[1], fa * a[2] + fc * c[2]

    # The row's prompt [H, P] and its page in progress [H, p].
    acc = softmax_part(jnp.dot(qs, pk_ref[0, 0], preferred_element_type=f32),
                       pvis_ref[0] != 0, pv_ref[0, 0], 0)
    acc = merge(acc, softmax_part(jnp.dot(qs, ok_ref[0, 0], preferred_element_type=f32),
                                  ovis_ref[0] != 0, ov_ref[0, 0], 1))

    def dma(block, slot, j):
      page = order_ref[first + block * b + j]
      return (pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, j], sems.at[0, slot]),
              pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, j], sems.at[1, slot]))

    def fetch(block, slot):
      for j in range(b):
        @pl.when(block * b + j < n)
        def _():
          for c in dma(block, slot, j):
            c.start()

    def wait(block, slot):
      for j in range(b):
        @pl.when(block * b + j < n)
        def _():
          for c in dma(block, slot, j):
            c.wait()

        @pl.when(block * b + j >= n)
        def _():  # never read: stale or uninitialised bytes must not reach the sum
          k_buf[slot, j] = jnp.zeros((H, p), k_buf.dtype)
          v_buf[slot, j] = jnp.zeros((H, p), v_buf.dtype)

    # lax's division: jnp's floor division lowers through sign(), which Mosaic
    # resolves from the host's device kind (none when compiling for a TPU elsewhere).
    blocks = jax.lax.div(n + b - 1, b)

    @pl.when(blocks > 0)
    def _():
      fetch(0, 0)

    def body(block, acc):
      slot = jax.lax.rem(block, 2)

      @pl.when(block + 1 < blocks)
      def _():
        fetch(block + 1, 1 - slot)

      wait(block, slot)
      for j in range(b):
        part = softmax_part(jnp.dot(qs, k_buf[slot, j], preferred_element_type=f32),
                            block * b + j < n, v_buf[slot, j], 1)
        acc = merge(acc, part)
      return acc

    _, total, out = jax.lax.fori_loop(0, blocks, body, acc)
    # A running slot sees its newest token (in its own page): total >= 1.
    out_ref[0, 0] = out / jnp.maximum(total, 1e-30)

  slot_block = lambda s, h, *_: (s, h, 0, 0)  # noqa: E731
  prompt_block = lambda s, h, order, start, count, prompt: (prompt[s], h, 0, 0)  # noqa: E731
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4, grid=(S, K),
      in_specs=[pl.BlockSpec((1, 1, mp, H), slot_block),
                pl.BlockSpec((1, 1, H, P), prompt_block),
                pl.BlockSpec((1, 1, P, H), prompt_block),
                pl.BlockSpec((1, 1, P), lambda s, h, o, st, c, prompt: (prompt[s], 0, 0)),
                pl.BlockSpec((1, 1, H, p), slot_block), pl.BlockSpec((1, 1, H, p), slot_block),
                pl.BlockSpec((1, 1, p), lambda s, h, *_: (s, 0, 0)),
                pl.BlockSpec(memory_space=pltpu.HBM), pl.BlockSpec(memory_space=pltpu.HBM)],
      out_specs=pl.BlockSpec((1, 1, mp, H), slot_block),
      scratch_shapes=[pltpu.VMEM((2, b, H, p), k_pages.dtype),
                      pltpu.VMEM((2, b, H, p), v_pages.dtype),
                      pltpu.SemaphoreType.DMA((2, 2))])
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((S, K, mp, H), f32),
      # "arbitrary": slots in order, so that a group's slots share one prompt fetch
      # (Mosaic takes parallel dimensions only as a prefix of the grid).
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="paged_attention",
  )(order, start, count, slot_prompts(slot_row, g), q, pk, pv.astype(pk.dtype),
    p_visible.astype(jnp.int32)[:, None], ok, ov,
    o_visible.astype(jnp.int32)[:, None],
    *(x if interpret else pltpu.with_memory_space_constraint(x, pltpu.HBM)
      for x in (k_pages, v_pages)))
  return out[:, :, :m]
