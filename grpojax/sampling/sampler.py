"""generate(): one jitted program that samples G completions for each of B prompts.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, V vocabulary.

The sampler knows nothing of layers, norms or attention: the model's
`prefill` runs the B prompts once (their keys and values are shared by each
group's G rows, never repeated; row order: prompt b's samples are rows
b*G .. b*G+G-1, the layout every other module assumes), and its
`decode_step` is the body of one `lax.while_loop` that stops as soon as every
row has emitted an EOS, or after T tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from grpojax import ops
from grpojax.models import cache as cache_lib
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import contract, strategies
from grpojax.sampling.contract import SampleOutput

Array = jax.Array


@flax.struct.dataclass
class _LoopState:
  step: Array  # [] int32: index of the next token to sample
  tokens: Array  # [N, T]
  logps: Array  # [N, T]
  done: Array  # [N] bool
  cache: cache_lib.KVCache


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
      ops.resolve(model.config), model.param_dict(), prompt_tokens, prompt_mask, rng=rng,
      num_samples=num_samples, max_new_tokens=max_new_tokens,
      sampling=strategies.SamplingParams(temperature, top_k, top_p, min_p),
      eos_ids=eos_ids, pad_id=pad_id, mesh=mesh)


def generate_from_params(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, *, rng,
                         num_samples: int, max_new_tokens: int,
                         sampling: strategies.SamplingParams, eos_ids, pad_id: int,
                         mesh=None, engine=None, stop_at=None, hook=None) -> SampleOutput:
  """`generate` for a model given as (ModelConfig, {name: array}): what jitted
  training code holds instead of a Transformer object. Arguments as `generate`;
  cfg.kernels should be resolved (grpojax.ops.resolve) before any trace.

  engine: None decodes all rows in lockstep (this module); an
  engine.EngineConfig runs the paged, slot-refilling engine (sampling/engine/).
  stop_at: a benchmark and test hook, [N] int32: row n draws eos_ids[0] as its
  token stop_at[n] - 1 (its own EOS may end it sooner).
  hook: the engine's row-event hook (engine.RowHook; a tool turn loop), or None.
  """
  if hook is not None and engine is None:
    raise ValueError("a row-event hook runs on the paged engine: give engine too")
  if engine is not None:
    from grpojax.sampling import engine as engine_lib
    return engine_lib.generate(cfg, weights, prompt_tokens, prompt_mask, rng=rng,
                               num_samples=num_samples, max_new_tokens=max_new_tokens,
                               sampling=sampling, eos_ids=eos_ids, pad_id=pad_id, engine=engine,
                               mesh=mesh, stop_at=stop_at,
                               **({} if hook is None else {"hook": hook}))
  eos, prompt_tokens, prompt_mask = contract.checked_inputs(
      prompt_tokens, prompt_mask, eos_ids=eos_ids, num_samples=num_samples,
      max_new_tokens=max_new_tokens)
  return generate_program(
      cfg, weights, prompt_tokens, prompt_mask, rng,
      sampling=sampling, num_samples=num_samples, max_new_tokens=max_new_tokens,
      eos=eos, pad_id=int(pad_id), mesh=mesh, stop_at=stop_at,
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
    static_argnames=("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id", "mesh"),
)
def generate_program(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, sampling,
                     num_samples, max_new_tokens, eos, pad_id, mesh,
                     stop_at=None) -> SampleOutput:
  """The lockstep sampler's jitted program: `generate_from_params` after its checks;
  eos a tuple, sampling SamplingParams. Public for lowering (grpojax.plan, bench/)."""
  B, P = prompt_tokens.shape
  G, T = num_samples, max_new_tokens
  N = B * G
  eos_arr = jnp.asarray(eos, jnp.int32)

  # The B prompts are prefilled once; the cache shares each prompt with its G rows.
  hidden, cache = transformer.prefill(cfg, weights, prompt_tokens, prompt_mask, group=G,
                                      max_new_tokens=max(T - 1, 1))
  # Left padding puts every prompt's last real token at P - 1.
  logits_NV = jnp.repeat(transformer.unembed(cfg, weights, hidden[:, -1]), G, axis=0)
  weights = transformer.decode_params(cfg, weights)  # once, outside the loop

  def sample_at(state: _LoopState, logits_NV) -> _LoopState:
    tok, logp = strategies.sample(jax.random.fold_in(rng, state.step), logits_NV, sampling,
                                  kernels=cfg.kernels)
    if stop_at is not None:
      tok = jnp.where(state.step + 1 == stop_at, eos[0], tok)
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
      cache=_constrain_cache(cache, mesh),
  )
  state = sample_at(state, _constrain_rows(logits_NV, 0, mesh))

  # Step s feeds token s-1, whose keys and values go to completion slot s-1.
  def cond(state: _LoopState):
    return (state.step < T) & ~jnp.all(state.done)

  def body(state: _LoopState):
    last = jax.lax.dynamic_slice(state.tokens, (0, state.step - 1), (N, 1))[:, 0]
    logits_NV, cache = transformer.decode_step(cfg, weights, last, state.cache)
    return sample_at(state.replace(cache=cache), logits_NV)

  state = jax.lax.while_loop(cond, body, state)

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


def _constrain_cache(cache: cache_lib.KVCache, mesh) -> cache_lib.KVCache:
  """The cache's rows over the batch axes and its kv heads over "tensor" (where they divide)."""
  if mesh is None:
    return cache
  heads = lambda xs: tuple(_constrain_rows(x, 0, mesh, head_axis=1) for x in xs)  # noqa: E731
  return cache.replace(prompt_k=heads(cache.prompt_k), prompt_v=heads(cache.prompt_v),
                       k=heads(cache.k), v=heads(cache.v),
                       rope=tuple(_constrain_rows(x, 0, mesh) for x in cache.rope))
