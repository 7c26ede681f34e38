"""The "gpu" backend of grpojax.ops.attention: flash attention as Pallas Triton kernels.

Causal attention of q [B, T, Nq, H] over k, v [B, S, K, H], the queries being
the last T of the S key positions, with `models.cache.attention_mask`'s mask:
query t (position S - T + t) sees key s <= S - T + t when kv_valid[b, s] or s
is its own position. Three kernels, none holding a [T, S] matrix: a forward
(online softmax; saves the output and each row's log-sum-exp) and a backward
that recomputes each tile's scores, one kernel for dq (a program per query
tile) and one for dk, dv (a program per key tile and kv head). Memory: the
inputs, the outputs and [B, Nq, T] float32 statistics; everything else lives
in registers and shared memory, forward and backward.

Why these kernels, of the candidates:

- cuDNN flash attention (`jax.nn.dot_product_attention(implementation=
  "cudnn")`) takes a mask only as a `mask`/`bias` array [B, 1, T, S] (the
  quadratic object this op exists to avoid); its sequence lengths
  (`query_seq_lengths`, `key_value_seq_lengths`) mark RIGHT padding, and our
  prompts are LEFT-padded; its `is_causal` is aligned top-left (query i sees
  keys <= i: its XLA path builds jnp.tril(ones(T, S))), so T < S, where the
  queries are the LAST T keys, is not expressible. cuDNN's packed layouts
  (per-segment offsets) are private API (jax._src.cudnn).
- jax's Pallas Triton kernel (`jax.experimental.pallas.ops.gpu.attention.mha`)
  has a backward but: one segment-id array shared by queries and keys (so
  q_len == kv_len), a causal mask without offset (top-left), no GQA (kv heads
  would be repeated Nq/K times, dk and dv summed back), lengths a multiple of
  its tiles, and a fused backward that needs as many query as key tiles. And
  it is deprecated in jax 0.11 (it warns, pointing to tokamax).
- The Mosaic GPU kernel (`attention_mgpu`, Hopper only) takes no mask but
  causal, has no causal backward ("not supported in the backwards pass yet"),
  only f16/bf16, head dims a multiple of 64; it cannot run in interpret mode
  on a CPU either.

So this module holds its own kernels, written against Pallas' Triton API
(`pl.pallas_call`, `jax.experimental.pallas.triton`: load/store through refs,
`dot`, `CompilerParams`), the same in jax 0.10 and 0.11, with jax's `mha` as
the model. They express the mask exactly as the reference does (causal offset
S - T, kv_valid, a query's own slot), so the shared-prompt layout costs
nothing extra (no dummy queries over the prompt) and the outputs equal the
reference's at every position, valid or not.

GQA is native: query head h reads kv head h // (Nq // K) through the kv
BlockSpec's index map, and the dk/dv kernel's program for a kv head loops
over the Nq // K query heads of its group, so no kv head is repeated and
dk, dv need no sum afterwards. (Folding the group into the query axis would
give tiles mixing positions of several heads; one head per tile keeps the
causal tile bounds exact.)

Padding: T and S are padded to the tiles (powers of two, 16 to 128): padded
keys lie past every real query's position (causally masked), padded queries
are sliced off, and their zero cotangents add nothing to dk, dv. The head
dimension is padded with zeros to a power of two (64 and 128 are already).
Scores, softmax statistics and accumulators are float32 (exp2 with log2(e)
folded into the scale); a float32 dot is IEEE (Triton's input precision for
f32 unless told TF32), bf16 dots accumulate in float32. Masked scores are
ops.xla.MASKED (finite), so no row ever meets -inf - (-inf).

Tiles and warps are untuned guesses (forward: 128 query rows x 64 keys; dq:
64 x 32; dk/dv: 64 keys x 32 query rows; 4 warps, 8 for H > 64; 2 pipeline
stages): XLA's compile for an H100 on a CPU host (grpojax.targets; Triton to
PTX to ptxas' cubin where ptxas is installed) checks they fit its shared
memory at bf16 and f32, but their speed has not been measured on a GPU.

Several devices: XLA cannot partition a Triton custom call (it would gather
the operands and run the whole batch on every GPU), so each half of the VJP is
a custom_partitioning call: each device runs the kernels on its own rows, and
on its own kv heads with their query heads where k's heads are sharded (whole
groups only); the sequence and head dims are gathered.

Limits: fully masked tiles (left padding, an ended completion's tail) are
still computed, only the causal upper triangle is skipped; the dk/dv kernel
has B x K x S/64 programs (each walks its group's query heads in turn), few
for one row at short S. Lowering needs a GPU as the default device: on a
CPU host compiling for a GPU (grpojax.targets), run the lowering and the
compile under `jax.default_device(that GPU's device)` (jax 0.11 reads the
target GPU from it; 0.10 assumed compute capability 9.0).

`interpret=True` runs the same kernels through Pallas' interpreter: how the
tests check them on a CPU. The module imports on a CPU-only machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from grpojax.ops.xla import MASKED

LOG2E = math.log2(math.e)
# (rows, keys) per program: forward, dq (rows of queries) and dk/dv (keys first).
FORWARD_TILES = (128, 64)
DQ_TILES = (64, 32)
DKV_TILES = (64, 32)  # (keys, query rows)
MIN_TILE = 16  # Triton's dot needs each side >= 16


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array, scale: float, *,
              block: int, interpret: bool = False) -> jax.Array:
  """ops.attention's contract (see there) as Pallas Triton kernels: [B, T, Nq, H] in q's dtype.

  block: the caller's attention block (model.attention_block); it only caps
  the kernels' tiles (to its power of two, at least 16), which are otherwise
  the GPU's own. interpret: run the kernels in Pallas' interpreter (any host).
  """
  T, Nq, H = q.shape[1:]
  S, K = k.shape[1], k.shape[2]
  if T > S:
    raise ValueError(f"{T} queries over {S} keys: queries must be the last keys")
  if Nq % K:
    raise ValueError(f"{Nq} query heads over {K} kv heads: K must divide Nq")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    k, v = k.astype(q.dtype), v.astype(q.dtype)
  cap = max(MIN_TILE, 1 << (max(int(block), 1).bit_length() - 1))
  tiles = _Tiles(*(min(t, cap) for t in (*FORWARD_TILES, *DQ_TILES, *DKV_TILES)))
  q_tile, k_tile = tiles.q_multiple, tiles.k_multiple
  Tp, Sp, Hp = -(-T // q_tile) * q_tile, -(-S // k_tile) * k_tile, pl.next_power_of_2(H)
  q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, Hp - H)))
  k, v = (jnp.pad(x, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H))) for x in (k, v))
  valid = jnp.pad(kv_valid.astype(jnp.int32), ((0, 0), (0, Sp - S)))
  config = _Config(scale=float(scale), offset=S - T, tiles=tiles, interpret=bool(interpret))
  out = _flash(config, q, k, v, valid)
  return out[:, :T, :, :H]


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """Tile sizes of the three kernels (powers of two): (query rows, keys) of the
  forward and of dq, (keys, query rows) of dk/dv."""

  fwd_q: int
  fwd_k: int
  dq_q: int
  dq_k: int
  dkv_k: int
  dkv_q: int

  @property
  def q_multiple(self) -> int:
    return max(self.fwd_q, self.dq_q, self.dkv_q)

  @property
  def k_multiple(self) -> int:
    return max(self.fwd_k, self.dq_k, self.dkv_k)


@dataclasses.dataclass(frozen=True)
class _Config:
  """The kernels' static arguments (hashable: custom_vjp's nondiff argument).
  offset: S - T, the first query's position."""

  scale: float
  offset: int
  tiles: _Tiles
  interpret: bool


def _params(H: int) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=4 if H <= 64 else 8, num_stages=2)


def _cdiv(a, b: int):
  """ceil(a / b) of a traced int32 a >= 0 (pl.cdiv wants static or same-typed ints)."""
  return lax.div(a + (b - 1), jnp.int32(b))


def _visible(q_pos, k_pos, valid):
  """[rows, keys] bool: causal, and the key valid or the query's own slot."""
  return (k_pos[None, :] <= q_pos[:, None]) & ((valid[None, :] != 0)
                                               | (k_pos[None, :] == q_pos[:, None]))


def _scores(q, k, q_pos, k_pos, valid, scale):
  """Masked scores [rows, keys] of a q tile over a k tile, float32, in base 2."""
  s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2E)
  return jnp.where(_visible(q_pos, k_pos, valid), s, MASKED)


# ------------------------------------------------------------------- forward


def _forward_kernel(q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref, *, config: _Config):
  bq, bk = config.tiles.fwd_q, config.tiles.fwd_k
  n_keys = k_ref.shape[0] // bk
  i = pl.program_id(0)
  q = q_ref[...]
  q_pos = config.offset + i * bq + jnp.arange(bq, dtype=jnp.int32)

  def body(j, carry):
    acc, m, l = carry
    keys = pl.ds(j * bk, bk)
    k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
    s = _scores(q, k_ref[keys, :], q_pos, k_pos, valid_ref[keys], config.scale)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp2(s - m_new[:, None])
    fix = jnp.exp2(m - m_new)
    v = v_ref[keys, :]
    acc = acc * fix[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l * fix + p.sum(axis=-1)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  last = jnp.minimum(_cdiv(config.offset + (i + 1) * bq, bk), n_keys)
  acc, m, l = lax.fori_loop(0, last, body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _forward_local(config: _Config, q, k, v, valid):
  """The forward kernel on this device's arrays: (out, lse [B, Nq, Tp] base-2)."""
  B, Tp, Nq, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  m, bq = Nq // K, config.tiles.fwd_q
  return pl.pallas_call(
      functools.partial(_forward_kernel, config=config),
      grid=(Tp // bq, B, Nq),
      in_specs=[
          pl.BlockSpec((None, bq, None, H), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, Sp, None, H), lambda i, b, h: (b, 0, h // m, 0)),
          pl.BlockSpec((None, Sp, None, H), lambda i, b, h: (b, 0, h // m, 0)),
          pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, bq, None, H), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
      ],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, Nq, Tp), jnp.float32)],
      compiler_params=_params(H),
      interpret=config.interpret,
      name="grpojax_attention_forward",
  )(q, k, v, valid)


# ------------------------------------------------------------------ backward


def _dq_kernel(q_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               config: _Config):
  bq, bk = config.tiles.dq_q, config.tiles.dq_k
  n_keys = k_ref.shape[0] // bk
  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_pos = config.offset + i * bq + jnp.arange(bq, dtype=jnp.int32)

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
    k, v = k_ref[keys, :], v_ref[keys, :]
    p = jnp.exp2(_scores(q, k, q_pos, k_pos, valid_ref[keys], config.scale) - lse[:, None])
    ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  last = jnp.minimum(_cdiv(config.offset + (i + 1) * bq, bk), n_keys)
  dq = lax.fori_loop(0, last, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * config.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                config: _Config):
  bk, bq = config.tiles.dkv_k, config.tiles.dkv_q
  Tp, m = q_ref.shape[0], q_ref.shape[1]
  j = pl.program_id(0)
  k, v, valid = k_ref[...], v_ref[...], valid_ref[...]
  k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
  # The first query tile with a row at or after this key tile's first position.
  first = lax.div(jnp.maximum(j * bk - config.offset, 0), jnp.int32(bq))

  def per_head(h, carry):
    def per_query_tile(i, carry):
      dk, dv = carry
      rows = pl.ds(i * bq, bq)
      q, do = q_ref[rows, h, :], do_ref[rows, h, :]
      q_pos = config.offset + i * bq + jnp.arange(bq, dtype=jnp.int32)
      p = jnp.exp2(_scores(q, k, q_pos, k_pos, valid, config.scale) - lse_ref[h, rows][:, None])
      dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
      ds = p * (plgpu.dot(do, v, trans_b=True) - delta_ref[h, rows][:, None])
      return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    return lax.fori_loop(first, Tp // bq, per_query_tile, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, m, per_head, (zeros, zeros))
  dk_ref[...] = (dk * config.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_local(config: _Config, q, k, v, valid, out, lse, d_out):
  """The dq and dk/dv kernels on this device's arrays: (dq, dk, dv)."""
  B, Tp, Nq, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  m = Nq // K
  # delta_t = Σ_h dO·O: the softmax backward's row term, [B, Nq, Tp] (elementwise, linear).
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
  bq = config.tiles.dq_q
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, config=config),
      grid=(Tp // bq, B, Nq),
      in_specs=[
          pl.BlockSpec((None, bq, None, H), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, Sp, None, H), lambda i, b, h: (b, 0, h // m, 0)),
          pl.BlockSpec((None, Sp, None, H), lambda i, b, h: (b, 0, h // m, 0)),
          pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
          pl.BlockSpec((None, bq, None, H), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
      ],
      out_specs=pl.BlockSpec((None, bq, None, H), lambda i, b, h: (b, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(H),
      interpret=config.interpret,
      name="grpojax_attention_dq",
  )(q, k, v, valid, d_out, lse, delta)
  bk = config.tiles.dkv_k
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, config=config),
      grid=(Sp // bk, B, K),
      in_specs=[
          pl.BlockSpec((None, Tp, m, H), lambda j, b, g: (b, 0, g, 0)),
          pl.BlockSpec((None, bk, None, H), lambda j, b, g: (b, j, g, 0)),
          pl.BlockSpec((None, bk, None, H), lambda j, b, g: (b, j, g, 0)),
          pl.BlockSpec((None, bk), lambda j, b, g: (b, j)),
          pl.BlockSpec((None, Tp, m, H), lambda j, b, g: (b, 0, g, 0)),
          pl.BlockSpec((None, m, Tp), lambda j, b, g: (b, g, 0)),
          pl.BlockSpec((None, m, Tp), lambda j, b, g: (b, g, 0)),
      ],
      out_specs=[pl.BlockSpec((None, bk, None, H), lambda j, b, g: (b, j, g, 0)),
                 pl.BlockSpec((None, bk, None, H), lambda j, b, g: (b, j, g, 0))],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(H),
      interpret=config.interpret,
      name="grpojax_attention_dkv",
  )(q, k, v, valid, d_out, lse, delta)
  return dq, dk, dv


# ---------------------------------------------------------------- partitioning
#
# XLA cannot partition a Triton custom call: under a jit over several GPUs it
# gathers the operands and runs the whole batch on every device. Each half of
# the VJP is therefore a custom_partitioning call whose shards run the kernels
# on their own rows (and on their own kv heads, with those heads' query heads,
# where the heads are split as whole groups); the sequence and head dims are
# gathered. On one device the call is inlined.


def _split(mesh, q_spec, k_spec, Nq: int, K: int):
  """(batch axes, kv-head axes) of q's and k's specs that the shards keep."""
  batch = q_spec[0] if len(q_spec) else None
  heads = k_spec[2] if len(k_spec) > 2 else None
  if heads is not None:
    axes = (heads,) if isinstance(heads, str) else tuple(heads)
    n = math.prod(mesh.shape[a] for a in axes)
    if K % n or Nq % n:
      heads = None
  return batch, heads


def _shardings(mesh, batch, heads, backward: bool):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  rows = NamedSharding(mesh, P(batch, None, heads, None))  # q, k, v, out, d_out
  valid = NamedSharding(mesh, P(batch, None))
  lse = NamedSharding(mesh, P(batch, heads, None))
  if backward:
    return (rows, rows, rows, valid, rows, lse, rows), (rows, rows, rows)
  return (rows, rows, rows, valid), (rows, lse)


def _partitioned(local, backward: bool):
  from jax.experimental.custom_partitioning import custom_partitioning

  fn = custom_partitioning(local, static_argnums=(0,))

  def plan(mesh, arg_shapes):
    specs = [getattr(a.sharding, "spec", ()) for a in arg_shapes[:2]]
    Nq, K = arg_shapes[0].shape[2], arg_shapes[1].shape[2]
    return _shardings(mesh, *_split(mesh, *specs, Nq, K), backward)

  def partition(config, mesh, arg_shapes, result_shape):
    mesh = arg_shapes[0].sharding.mesh
    args, results = plan(mesh, arg_shapes)
    return mesh, functools.partial(local, config), results, args

  def infer(config, mesh, arg_shapes, result_shape):  # GSPMD's propagation (Shardy: `rule`)
    return plan(arg_shapes[0].sharding.mesh, arg_shapes)[1]

  def rule(config, mesh, value_types, result_types):
    from jax._src.lib.mlir import ir

    Nq, K = (ir.ShapedType(t).shape[2] for t in value_types[:2])
    g = Nq // K
    heads = "(kv g)" if g > 1 else "kv"
    q, kv, lse = f"b t {heads} h", "b s kv h", f"b {heads} t"
    operands = [q, kv, kv, "b s", q, lse, q] if backward else [q, kv, kv, "b s"]
    results = [q, kv, kv] if backward else [q, lse]
    text = f"{', '.join(operands)} -> {', '.join(results)}"
    # Gathered: the sequences, the head dim and a group's query heads. Shardy
    # wants them in the order the factors first appear.
    order = re.findall(r"\w+", text)
    whole = sorted({"t", "s", "h", "g"} & set(order), key=order.index)
    return text, dict(need_replication_factors=tuple(whole), **({"g": g} if g > 1 else {}))

  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return fn


_forward = _partitioned(_forward_local, backward=False)
_backward = _partitioned(_backward_local, backward=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(config: _Config, q, k, v, valid):
  return _forward(config, q, k, v, valid)[0]


def _flash_fwd(config: _Config, q, k, v, valid):
  out, lse = _forward(config, q, k, v, valid)
  return out, (q, k, v, valid, out, lse)


def _flash_bwd(config: _Config, res, d_out):
  q, k, v, valid, out, lse = res
  dq, dk, dv = _backward(config, q, k, v, valid, out, lse, d_out.astype(out.dtype))
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------- paged decode

PROMPT_CHUNK = 64  # prompt keys a step of the kernel's loop: the engine pads prompts to it
OWN_CHUNK = 16  # keys of a page in progress a step of its loop: Triton's least dot


def paged_supported(m: int, H: int, p: int) -> bool:
  """Whether `paged_attention` takes these sizes: Triton tiles are powers of two of at
  least 16 (the queries are padded to one; heads and pages are not)."""
  pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
  return pow2(H) and pow2(p) and m <= 128


def paged_attention(q: jax.Array, prompt, pool, own, slot_row: jax.Array, *, write=None,
                    interpret: bool = False):
  """grpojax.ops.paged_attention as one Triton kernel: each slot's query over its
  row's prompt, its page in progress and its full pages -> [S, K, m, H] float32.

  Arguments as ops.xla.paged_attention (q [S, K, m, H] scaled; prompt (k
  [B, K, H, P], v [B, K, P, H], visible [B, P], g) with P a multiple of
  PROMPT_CHUNK; pool (k_pages, v_pages [K, M, H, p], owner [M], full [M]); own
  (k, v [S, K, H, p], visible [S, p])).

  A program per (slot, kv head) reads, from global memory by index: its row's
  prompt in chunks of PROMPT_CHUNK, its page in progress through its visible
  prefix in chunks of OWN_CHUNK, then its full pages as ops.xla.page_lists lists
  them, with one online softmax. It reads those and nothing else, so the bytes
  follow the live tokens (each row its prompt: a group's rows each read it; an
  idle slot none). Its m query heads are one tile, padded to a
  power of two >= 16 (Triton's least dot). Sizes: `paged_supported`. Untuned:
  4 warps, 2 stages (no GPU measured it). An idle slot's output is finite
  garbage.

  write: (new_k, new_v [S, K, H], offset [S], flush [S]) makes it the whole of a
  layer's cache work in the step (ops.paged_decode_attention): each program
  puts its slot's new key and value at `offset` in the page in progress it
  attends over and stores that page back, and where flush < M also into pool
  page flush, in place (the buffers are aliased to the outputs). That saves
  XLA's four scatters a layer, kernels that cost a step more than their bytes
  (bench/RESULTS.md: an H200's step is ~7 us a kernel). The page flushed is
  in no slot's list this step (it fills with this token), so no program reads
  what another writes. Returns (out, slot_k, slot_v, k_pages, v_pages) then.
  """
  from grpojax.ops.xla import page_lists, slot_prompts

  S, K, m, H = q.shape
  pk, pv, p_visible, g = prompt
  k_pages, v_pages, owner, full = pool
  ok, ov, o_visible = own
  B, P = p_visible.shape
  M, p = k_pages.shape[1], k_pages.shape[3]
  if not paged_supported(m, H, p) or P % PROMPT_CHUNK:
    raise ValueError(f"paged_attention: m={m}, H={H}, p={p}, P={P}: H and p powers of two "
                     f">= 16, P a multiple of {PROMPT_CHUNK}")
  mp = max(16, 1 << (m - 1).bit_length())
  q = jnp.pad(q, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
  if write is not None:
    # The queries, padded, and the new key and value in one array: XLA makes it in one
    # fusion (the QKV matmul's epilogue, RoPE, the padding), not one for q and one for
    # k and v. The kernel reads it twice, as q's rows and as k and v's.
    q = jnp.concatenate([q, jnp.stack(write[:2], axis=2).astype(q.dtype)], axis=2)
  c = PROMPT_CHUNK

  def kernel(order_ref, start_ref, count_ref, prompt_ref, chunks_ref, q_ref, pk_ref, pv_ref,
             pvis_ref, ok_ref, ov_ref, seen_ref, k_ref, v_ref, *rest):
    s = pl.program_id(0)
    n, first, b = count_ref[s], start_ref[s], prompt_ref[s]
    qs = q_ref[...]  # [mp, H]
    seen = seen_ref[s]  # the page in progress's visible prefix; 0 for an idle slot
    oc = OWN_CHUNK

    def with_new(i, k, v):
      """Chunk i's keys and values [H, oc] (or the page's, i = 0 and oc = p) with
      this step's token at its offset: where, not a reload after the store, so no
      thread reads what another has just written."""
      if write is None:
        return k, v
      at = lax.broadcasted_iota(jnp.int32, k.shape, 1) + i * k.shape[1] == offset_ref[s]
      new_k, new_v = (new_ref[j, :].astype(k.dtype)[:, None] for j in (0, 1))
      return jnp.where(at, new_k, k), jnp.where(at, new_v, v)

    if write is None:
      (out_ref,) = rest
    else:
      new_ref, offset_ref, flush_ref, out_ref, sk_ref, sv_ref, kp_ref, vp_ref = rest
      # The token goes in with its chunk (the page in progress is aliased to sk, sv).
      j = offset_ref[s] // oc
      cols = pl.ds(j * oc, oc)
      k, v = with_new(j, ok_ref[:, cols], ov_ref[:, cols])
      sk_ref[:, cols] = k
      sv_ref[:, cols] = v
      page = flush_ref[s]

      @pl.when(page < M)  # the page is full with this token: copied whole to the pool
      def _():
        k, v = with_new(0, ok_ref[...], ov_ref[...])
        kp_ref[page] = k
        vp_ref[page] = v

    def update(acc, scores, visible, values, keys_minor):
      top, total, out = acc
      scores = jnp.where(visible, scores, MASKED)
      new = jnp.maximum(top, scores.max(axis=-1))
      e = jnp.exp(scores - new[:, None])
      fix = jnp.exp(top - new)
      pv = plgpu.dot(e.astype(values.dtype), values, trans_b=keys_minor)
      return new, fix * total + e.sum(axis=-1), fix[:, None] * out + pv

    def prompt_chunk(i, acc):
      cols = pl.ds(i * c, c)
      return update(acc, plgpu.dot(qs, pk_ref[b, :, cols]), pvis_ref[b, cols][None, :] != 0,
                    pv_ref[b, cols, :], False)

    def page(j, acc):
      at = order_ref[first + j]
      return update(acc, plgpu.dot(qs, k_ref[at]), True, v_ref[at], True)

    acc = (jnp.full((mp,), MASKED, jnp.float32), jnp.zeros((mp,), jnp.float32),
           jnp.zeros((mp, H), jnp.float32))
    acc = lax.fori_loop(0, chunks_ref[s], prompt_chunk, acc)  # none for an idle slot

    def own_chunk(i, acc):
      cols = pl.ds(i * oc, oc)
      k, v = with_new(i, ok_ref[:, cols], ov_ref[:, cols])
      visible = lax.broadcasted_iota(jnp.int32, (1, oc), 1) + i * oc < seen
      return update(acc, plgpu.dot(qs, k), visible, v, True)

    acc = lax.fori_loop(0, _cdiv(seen, oc), own_chunk, acc)
    _, total, out = lax.fori_loop(0, n, page, acc)
    # A running slot sees its newest token (in its own page): total >= 1.
    out_ref[...] = out / jnp.maximum(total, 1e-30)[:, None]

  whole = lambda *shape: pl.BlockSpec(shape, lambda s, h: (0,) * len(shape))  # noqa: E731
  per_slot = pl.BlockSpec((None, None, H, p), lambda s, h: (s, h, 0, 0))
  pool_spec = pl.BlockSpec((None, M, H, p), lambda s, h: (h, 0, 0, 0))
  order, start, count = page_lists(owner, full, S)
  in_specs = [whole(M), whole(S), whole(S), whole(S), whole(S),
              pl.BlockSpec((None, None, mp, H), lambda s, h: (s, h, 0, 0)),
              pl.BlockSpec((B, None, H, P), lambda s, h: (0, h, 0, 0)),
              pl.BlockSpec((B, None, P, H), lambda s, h: (0, h, 0, 0)), whole(B, P),
              per_slot, per_slot, whole(S), pool_spec, pool_spec]
  args = [order, start, count, slot_prompts(slot_row, g),
          jnp.where(slot_row >= 0, P // c, 0).astype(jnp.int32), q, pk, pv.astype(pk.dtype),
          p_visible.astype(jnp.int32), ok, ov,
          jnp.where(slot_row >= 0, jnp.sum(o_visible, axis=1), 0).astype(jnp.int32),
          k_pages, v_pages]
  out_specs = [pl.BlockSpec((None, None, mp, H), lambda s, h: (s, h, 0, 0))]
  out_shape = [jax.ShapeDtypeStruct((S, K, mp, H), jnp.float32)]
  aliases = {}
  if write is not None:
    _, _, offset, flush = write
    # Rows mp and mp + 1 of q's array (a block of 2 rows: block index mp / 2).
    in_specs += [pl.BlockSpec((None, None, 2, H), lambda s, h: (s, h, mp // 2, 0)), whole(S),
                 whole(S)]
    args += [q, offset.astype(jnp.int32), flush.astype(jnp.int32)]
    out_specs += [per_slot, per_slot, pool_spec, pool_spec]
    out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (ok, ov, k_pages, v_pages)]
    aliases = {9: 1, 10: 2, 12: 3, 13: 4}  # own pages and pools, written in place
  out, *written = pl.pallas_call(
      kernel, grid=(S, K), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=_params(H),
      interpret=interpret,
      name="grpojax_paged_attention",
  )(*args)
  out = out[:, :, :m]
  return (out, *written) if write is not None else out
