"""generate(): one jitted program that samples G completions for each of B prompts.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, V vocabulary.

The B prompts are prefilled once and their KV cache is never repeated: decode
attention reads it as a segment shared by each group's G rows (row order:
prompt b's samples are rows b*G .. b*G+G-1, the layout every other module
assumes). The completions' keys and values go to chunks of the cache, each
decoded by a `lax.while_loop` that attends to the chunks written so far and
stops as soon as every row has emitted an EOS, or after T tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from grpojax.models import cache as cache_lib
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import strategies

Array = jax.Array


@flax.struct.dataclass
class SampleOutput:
  """What `generate` returns; every array has N = B*G rows, groups contiguous.

  tokens: [N, T] int32 completion tokens, the first EOS included, pad_id after it.
  mask: [N, T] int32, 1 on completion tokens (through the first EOS), else 0.
  logps: [N, T] float32 log-prob of each token under softmax(logits / temperature)
    over the full vocabulary (0 where mask is 0).
  lengths: [N] int32 tokens per completion (= mask.sum(-1)).
  truncated: [N] bool, rows that reached T tokens without an EOS.
  """

  tokens: Array
  mask: Array
  logps: Array
  lengths: Array
  truncated: Array


@flax.struct.dataclass
class _LoopState:
  step: Array  # [] int32: index of the next token to sample
  tokens: Array  # [N, T]
  logps: Array  # [N, T]
  done: Array  # [N] bool
  chunk: tuple  # per layer, the (k, v) of the completion chunk being written


def _chunk_len(writes: int) -> int:
  """Completion slots per cache chunk, for `writes` decode steps: at most 4 chunks of >= 16.

  Attention reads only the chunks written so far (each chunk is a separate
  while loop, so its shapes are static), and the strided key writes land in a
  small buffer that stays in cache. More chunks read less but compile more loops.
  """
  return max(16, -(-writes // 4))


def bucket_length(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= n: pad to a few static lengths so jit compiles a few programs."""
  for b in sorted(buckets):
    if b >= n:
      return b
  raise ValueError(f"length {n} exceeds the largest bucket {max(buckets)}")


def generate(
    model,
    prompt_tokens: Array,
    prompt_mask: Array,
    *,
    rng: Array,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    eos_ids: int | Sequence[int],
    pad_id: int,
    mesh: jax.sharding.Mesh | None = None,
) -> SampleOutput:
  """Samples `num_samples` completions for each left-padded prompt.

  Args:
    model: a grpojax.models Transformer.
    prompt_tokens: [B, P] int, left-padded (pad to a bucketed P: see `bucket_length`).
    prompt_mask: [B, P], 1 on real prompt tokens.
    rng: PRNG key; the same key gives the same samples.
    num_samples: G completions per prompt.
    max_new_tokens: T, the completion budget (static).
    temperature: 0 is greedy; top_k / top_p / min_p truncate (see strategies.py).
    eos_ids: one or several token ids that end a completion.
    pad_id: written after a row's EOS.
    mesh: optional; rows are then sharded over ("data", "fsdp") and cache heads
      over "tensor" where the sizes divide.

  Returns:
    SampleOutput with N = B * num_samples rows.
  """
  return generate_from_params(
      model.config, model.param_dict(), prompt_tokens, prompt_mask, rng=rng,
      num_samples=num_samples, max_new_tokens=max_new_tokens,
      sampling=strategies.SamplingParams(temperature, top_k, top_p, min_p),
      eos_ids=eos_ids, pad_id=pad_id, mesh=mesh)


def generate_from_params(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, *, rng,
                         num_samples: int, max_new_tokens: int,
                         sampling: strategies.SamplingParams, eos_ids, pad_id: int,
                         mesh=None) -> SampleOutput:
  """`generate` for a model given as (ModelConfig, {name: array}): what jitted
  training code holds instead of a Transformer object. Arguments as `generate`."""
  eos = (eos_ids,) if isinstance(eos_ids, int) else tuple(int(e) for e in eos_ids)
  if not eos:
    raise ValueError("eos_ids is empty: give at least one end-of-sequence id")
  if num_samples < 1 or max_new_tokens < 1:
    raise ValueError(f"num_samples={num_samples} and max_new_tokens={max_new_tokens} must be >= 1")
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  if prompt_tokens.ndim != 2 or prompt_mask.shape != prompt_tokens.shape:
    raise ValueError(
        f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} must both be [B, P]"
    )
  return _generate(
      cfg, weights, prompt_tokens, jnp.asarray(prompt_mask), rng,
      params=sampling, num_samples=num_samples, max_new_tokens=max_new_tokens,
      eos=eos, pad_id=int(pad_id), mesh=mesh,
  )


def _constrain_rows(x: Array, axis: int, mesh, head_axis: int | None = None) -> Array:
  if mesh is None:
    return x
  spec = [None] * x.ndim
  rows = [a for a in mesh_lib.BATCH_AXES if a in mesh.shape]
  if rows and x.shape[axis] % math.prod(mesh.shape[a] for a in rows) == 0:
    spec[axis] = tuple(rows)
  if head_axis is not None and "tensor" in mesh.shape and x.shape[head_axis] % mesh.shape["tensor"] == 0:
    spec[head_axis] = "tensor"
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "params", "num_samples", "max_new_tokens", "eos", "pad_id", "mesh"),
)
def _generate(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, params,
              num_samples, max_new_tokens, eos, pad_id, mesh) -> SampleOutput:
  B, P = prompt_tokens.shape
  G, T = num_samples, max_new_tokens
  N = B * G
  eos_arr = jnp.asarray(eos, jnp.int32)

  weights = transformer.decode_params(cfg, weights)
  # The B prompts are prefilled once and their cache is never copied per sample:
  # decode attention reads it as a segment shared by each group's G rows.
  cache = cache_lib.init_cache(cfg, B, P)
  hidden, cache = transformer.forward(cfg, weights, prompt_tokens, None, prompt_mask, cache)
  # Left padding puts every prompt's last real token at P - 1.
  logits_BV = transformer.unembed(cfg, weights, hidden[:, -1])
  prompt_kv = [(_constrain_rows(k, 0, mesh, head_axis=1), _constrain_rows(v, 0, mesh, head_axis=1))
               for k, v in zip(cache.k, cache.v)]
  prompt_visible = jnp.repeat(cache.valid, G, axis=0)[:, None, :]  # [N, 1, P]
  first_pos = jnp.repeat(cache.next_pos, G)  # [N] position of each row's first completion token
  # RoPE tables for every completion slot, computed once: inside the loop XLA
  # fuses sin/cos into each layer's q and k and evaluates them per head.
  rope_all = transformer.rope_tables(cfg, first_pos[:, None] + jnp.arange(max(T - 1, 1)))
  logits_NV = _constrain_rows(jnp.repeat(logits_BV, G, axis=0), 0, mesh)

  def sample_at(state: _LoopState, logits_NV) -> _LoopState:
    tok, logp = strategies.sample(jax.random.fold_in(rng, state.step), logits_NV, params)
    tok = jnp.where(state.done, pad_id, tok)
    logp = jnp.where(state.done, 0.0, logp)
    return state.replace(
        step=state.step + 1,
        tokens=jax.lax.dynamic_update_slice(state.tokens, tok[:, None], (0, state.step)),
        logps=jax.lax.dynamic_update_slice(state.logps, logp[:, None], (0, state.step)),
        done=state.done | jnp.isin(tok, eos_arr),
    )

  state = _LoopState(
      step=jnp.zeros((), jnp.int32),
      tokens=jnp.full((N, T), pad_id, jnp.int32),
      logps=jnp.zeros((N, T), jnp.float32),
      done=jnp.zeros((N,), bool),
      chunk=(),
  )
  state = sample_at(state, logits_NV)

  # Step s feeds token s-1 and writes its keys and values to completion slot
  # s-1; slots are split into chunks, each decoded by its own while loop that
  # attends to the prompt, the finished chunks (loop constants) and its own.
  writes = T - 1
  C = _chunk_len(writes)
  K, H, dt = cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype)
  scale = H**-0.5
  finished = []  # per chunk, per layer (k [N, K, H, C], v [N, K, C, H])
  for c in range(-(-writes // C)):
    end = min((c + 1) * C, writes) + 1  # first step past this chunk

    def cond(state: _LoopState, end=end):
      return (state.step < end) & ~jnp.all(state.done)

    def body(state: _LoopState, c=c):
      slot = state.step - 1 - c * C
      last = jax.lax.dynamic_slice(state.tokens, (0, state.step - 1), (N, 1))
      rope = tuple(jax.lax.dynamic_slice_in_dim(t, state.step - 1, 1, axis=1) for t in rope_all)
      own_visible = (jnp.arange(C) <= slot)[None, None, :]

      def attend_fn(i):
        def attend(q, k, v):
          k, v = cache_lib.write(*state.chunk[i], k, v, slot)
          segments = [(*prompt_kv[i], prompt_visible, G)]
          segments += [(*chunk[i], None, 1) for chunk in finished]
          segments.append((k, v, own_visible, 1))
          return transformer.segment_attention(q, segments, scale), (k, v)
        return attend

      x = jnp.take(weights["embed"], last, axis=0).astype(dt)
      x, chunk = transformer.unrolled_layers(cfg, weights, x, rope, attend_fn)
      hidden = transformer.rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
      logits_NV = transformer.unembed(cfg, weights, hidden[:, 0])
      return sample_at(state.replace(chunk=tuple(chunk)), logits_NV)

    chunk = tuple((_constrain_rows(jnp.zeros((N, K, H, C), dt), 0, mesh, head_axis=1),
                   _constrain_rows(jnp.zeros((N, K, C, H), dt), 0, mesh, head_axis=1))
                  for _ in range(cfg.num_layers))
    state = jax.lax.while_loop(cond, body, state.replace(chunk=chunk))
    finished.append(state.chunk)

  # A row's tokens are real up to and including its first EOS.
  is_eos = jnp.isin(state.tokens, eos_arr)
  eos_before = jnp.cumsum(is_eos.astype(jnp.int32), axis=1) - is_eos.astype(jnp.int32)
  written = jnp.arange(T)[None, :] < state.step
  mask = ((eos_before == 0) & written).astype(jnp.int32)
  return SampleOutput(
      tokens=jnp.where(mask > 0, state.tokens, pad_id),
      mask=mask,
      logps=jnp.where(mask > 0, state.logps, 0.0),
      lengths=jnp.sum(mask, axis=1),
      truncated=~state.done,
  )
