"""The engine's decode loop and the programs that run it (`generate`).

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, S decode slots, M pages of p tokens, V vocabulary.

One `lax.while_loop` of static shapes: each step admits pending rows to idle
slots, gives pages to the slots whose next token starts one (pages.py), runs
one decode step over the S slots, draws each slot's token with its row's key,
and frees the slots of the rows that ended. A row-event hook (hooks.py) is
called at fixed points of each step; the loop itself knows no hook.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from grpojax import ops
from grpojax.models import cache as cache_lib
from grpojax.models import lora as lora_lib
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import contract, strategies
from grpojax.sampling.contract import SampleOutput
from grpojax.sampling.engine import pages
from grpojax.sampling.engine.hooks import Drawn, RowHook, Rows
from grpojax.sampling.engine.pages import DONE, PENDING, RUNNING, EngineConfig, EngineStats

Array = jax.Array
NO_HOOK = RowHook()


@flax.struct.dataclass
class State:
  """The loop's carry. tokens [N, T] int32, logps [N, T] float32, length [N] tokens
  drawn, status [N] PENDING / RUNNING / DONE, eos [N] bool (ended with an EOS),
  cache (PagedCache), stats (EngineStats), trained [N, T] bool (the tokens the
  policy drew, not a hook's; [N, 0] when the hook puts none) and hook (the
  hook's own state)."""

  tokens: Array
  logps: Array
  length: Array
  status: Array
  eos: Array
  cache: cache_lib.PagedCache
  stats: EngineStats
  trained: Array
  hook: object

  def rows(self) -> Rows:
    return Rows(tokens=self.tokens, length=self.length, status=self.status, eos=self.eos,
                slot_row=self.cache.slot_row, step=self.stats.steps)


def generate(cfg: ModelConfig, weights, prompt_tokens: Array, prompt_mask: Array, *, rng: Array,
             num_samples: int, max_new_tokens: int, sampling: strategies.SamplingParams,
             eos_ids, pad_id: int, engine: EngineConfig = EngineConfig(), mesh=None,
             with_stats: bool = False, stop_at: Array | None = None, hook: RowHook = NO_HOOK):
  """`sampler.generate_from_params` through the engine; the same arguments and SampleOutput.

  Args as `sampler.generate_from_params`, plus engine: the slots and pool
  (EngineConfig). With with_stats, returns (SampleOutput, EngineStats).
  stop_at: a benchmark and test hook, [N] int32: row n draws eos_ids[0] as its
  token stop_at[n] - 1 (its own EOS may end it sooner).
  hook: a row-event hook (hooks.RowHook); one that puts tokens of its own fills
  SampleOutput.loss_mask.
  mesh: where its batch axes ("data", "fsdp") split the B prompts evenly, each of
  their devices runs an engine of its own over its prompts' rows, with its share
  of the slots and pages (`sharded_program`); the rows keep their keys, so the
  samples are the unsharded engine's. Else one engine runs the whole batch.
  """
  eos, prompt_tokens, prompt_mask = contract.checked_inputs(
      prompt_tokens, prompt_mask, eos_ids=eos_ids, num_samples=num_samples,
      max_new_tokens=max_new_tokens)
  shards = row_shards(mesh, prompt_tokens.shape[0])
  # Checked before tracing: each shard's pool must hold one of its rows.
  engine.per_shard(shards, max_new_tokens).sizes(prompt_tokens.shape[0] * num_samples // shards,
                                                 max_new_tokens)
  kw = dict(sampling=sampling, num_samples=num_samples, max_new_tokens=max_new_tokens, eos=eos,
            pad_id=int(pad_id), stop_at=stop_at, hook=hook)
  if shards > 1:
    out, stats = sharded_program(cfg, weights, prompt_tokens, prompt_mask, rng, mesh=mesh,
                                 engine=engine, **kw)
  else:
    out, stats = generate_program(cfg, weights, prompt_tokens, prompt_mask, rng, engine=engine,
                                  **kw)
  return (out, stats) if with_stats else out


def program_for(engine: EngineConfig, mesh, prompts: int):
  """(the jitted program `generate` runs for `prompts` prompts on `mesh`, its keyword
  arguments beyond the sampler's): for lowering it (grpojax.plan)."""
  if row_shards(mesh, prompts) > 1:
    return sharded_program, dict(engine=engine, mesh=mesh)
  return generate_program, dict(engine=engine)


def row_shards(mesh, prompts: int) -> int:
  """How many row shards the engine runs on `mesh` for `prompts` prompts: the devices
  of its batch axes where they divide the prompts, else 1."""
  if mesh is None:
    return 1
  shards = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES if a in mesh.shape)
  return shards if prompts % shards == 0 else 1


def shard_index(mesh, axes) -> Array:
  """Inside shard_map: this device's row shard over the mesh's batch `axes`."""
  shard = 0
  for a in axes:
    shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
  return shard


_STATIC = ("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id", "engine", "hook")


@functools.partial(jax.jit, static_argnames=_STATIC + ("mesh",))
def sharded_program(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, mesh, sampling,
                    num_samples, max_new_tokens, eos, pad_id, engine: EngineConfig,
                    stop_at=None, hook: RowHook = NO_HOOK):
  """`generate_program` on each device of the mesh's batch axes, over its B / d prompts
  (in order: device i holds rows i*N/d ..), with engine.per_shard(d). Weights are
  replicated into it (gathered where sharded); the "tensor" axis repeats the work.
  Returns the rows split over the batch axes and EngineStats over all shards: steps
  the most any shard took, pages_peak the sum of the shards' peaks, the rest summed."""
  from jax.sharding import PartitionSpec as P

  axes = tuple(a for a in mesh_lib.BATCH_AXES if a in mesh.shape)
  shards = math.prod(mesh.shape[a] for a in axes)
  local_engine = engine.per_shard(shards, max_new_tokens)
  rows = P(axes)
  weights = compute_dtype_matmuls(cfg, weights)

  def local(weights, tokens, mask, rng, stop_at):
    out, stats = generate_program(
        cfg, weights, tokens, mask, rng, sampling=sampling, num_samples=num_samples,
        max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id, engine=local_engine,
        stop_at=stop_at, row_offset=shard_index(mesh, axes) * tokens.shape[0] * num_samples,
        hook=hook)
    return out, jax.tree.map(lambda x: x[None], stats)

  stop_spec = None if stop_at is None else rows
  out, stats = jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows, P(), stop_spec),
                             out_specs=(rows, rows), check_vma=False)(
                                 weights, prompt_tokens, prompt_mask, rng, stop_at)
  return out, EngineStats.of_shards(stats)


# The weights every use casts to the compute dtype (ops.linear, unembedding): the
# layers' seven projections (LoRA's targets) and the untied output matrix.
_MATMULS = frozenset(lora_lib.TARGETS.values()) | {"lm_head"}


def compute_dtype_matmuls(cfg: ModelConfig, weights: dict) -> dict:
  """`weights` with its dense matmul weights in cfg.dtype, where that is narrower: the
  same values every matmul reads (each casts its weight on use), so the samples do
  not change. Done where the weights are still sharded: a float32 7B model's
  replicas are 28 GiB, its bfloat16 ones 14. Norms and embeddings stay as they are
  (an architecture may compute with them in float32), as does a model with LoRA
  adapters (merging them into narrowed weights would round differently) or a
  quantised base (already narrow)."""
  dt = jnp.dtype(cfg.dtype)
  if any(lora_lib.is_adapter(n) or isinstance(w, ops.quant.QuantizedWeight)
         for n, w in weights.items()):
    return weights
  narrow = lambda n, w: (n in _MATMULS and jnp.issubdtype(w.dtype, jnp.floating)  # noqa: E731
                         and w.dtype.itemsize > dt.itemsize)
  return {n: w.astype(dt) if narrow(n, w) else w for n, w in weights.items()}


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate_program(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, sampling,
                     num_samples, max_new_tokens, eos, pad_id, engine: EngineConfig,
                     stop_at=None, row_offset=0, hook: RowHook = NO_HOOK):
  """The engine's jitted program: `generate` after its checks, returning (SampleOutput,
  EngineStats); eos a tuple, sampling SamplingParams. Public for lowering (grpojax.plan).
  row_offset: the number of the first row (a shard's, in `sharded_program`)."""
  state = run(cfg, weights, prompt_tokens, prompt_mask, rng, sampling=sampling,
              num_samples=num_samples, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id,
              engine=engine, stop_at=stop_at, row_offset=row_offset, hook=hook)
  return output(state, pad_id), state.stats


def row_keys(rng: Array, rows: Array, position: Array) -> Array:
  """The key that draws token `position` [N] of row `rows` [N]: independent of slots and steps.
  rng: one key, or [N] keys (a row's round's, in `stream_program`)."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if rng.ndim == (0 if typed else 1):
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(rows, position)
  return jax.vmap(lambda k, r, t: jax.random.fold_in(jax.random.fold_in(k, r), t))(
      rng, rows, position)


def output(state: State, pad_id: int, rows=None) -> SampleOutput:
  """The SampleOutput of `rows` [n] (default all) of a finished run."""
  pick = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731
  tokens, logps, length, eos = map(pick, (state.tokens, state.logps, state.length, state.eos))
  mask = (jnp.arange(tokens.shape[1])[None, :] < length[:, None]).astype(jnp.int32)
  loss_mask = None
  if state.trained.shape[1]:
    loss_mask = mask * pick(state.trained).astype(jnp.int32)
  return SampleOutput(tokens=jnp.where(mask > 0, tokens, pad_id), mask=mask,
                      logps=jnp.where(mask > 0, logps, 0.0), lengths=length, truncated=~eos,
                      loss_mask=loss_mask)


def run(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, sampling, num_samples,
        max_new_tokens, eos, pad_id, engine: EngineConfig, stop_at=None, row_offset=0,
        hook: RowHook = NO_HOOK, hook_state=None, rows_per_key: int = 0, start=None,
        budget=None, skip=None, prefill_rows: int = 0, resume=None) -> State:
  """The engine's loop over every row of the prompts [B, P]; its final State.

  hook: the row-event hook, with hook_state its initial state (default
  hook.init(B, G)). rng: one key, or [B*G / rows_per_key] keys: row r draws with
  rng[r // rows_per_key] as row r % rows_per_key (its round's key and row).
  rows_per_key=-1: rng is [N] keys, each row's own, and row r draws its token t
  with fold_in(rng[r], start[r] + t) (a row resumed past start[r] tokens that
  its prompt now holds: carry.py).
  budget: [N] int32 the tokens each row may draw (default T; a row that draws
  them all ends truncated). skip: [N] bool rows that have ended already: they
  draw nothing (length 0) and are DONE from the start.
  prefill_rows: the prompts are prefilled this many at a time, one chunk after
  another (the activations of a chunk at a time); 0: all at once.
  resume: (State, fresh [N] bool): go on with a run's state (its rows, slots and
  pages, carried through a weight update: carry.py's "keep") instead of a new one.
  The prompts' keys and values are prefilled again (the same shapes) and only the
  fresh rows draw a first token and start; the others go on from where they are.
  """
  B, _ = prompt_tokens.shape
  G, T = num_samples, max_new_tokens
  N = B * G
  S, M = engine.sizes(N, T)
  p = engine.page_size
  eos_arr = jnp.asarray(eos, jnp.int32)
  rows = jnp.arange(N, dtype=jnp.int32)
  if not rows_per_key:
    rng_of = lambda r, t: row_keys(rng, r + row_offset, t)  # noqa: E731  the rows' global keys
  elif rows_per_key < 0:
    offset = jnp.zeros((N,), jnp.int32) if start is None else start
    rng_of = lambda r, t: jax.vmap(jax.random.fold_in)(rng[r], offset[r] + t)  # noqa: E731
  else:
    rng_of = lambda r, t: row_keys(rng[r // rows_per_key], r % rows_per_key + row_offset, t)  # noqa: E731
  budget = jnp.full((N,), T, jnp.int32) if budget is None else budget.astype(jnp.int32)
  skip = jnp.zeros((N,), bool) if skip is None else skip

  last, prefilled = _prefill(cfg, weights, prompt_tokens, prompt_mask, G, prefill_rows)
  heads = (cfg.kernels, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
  cache = cache_lib.PagedCache.after_prefill(
      prefilled, jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), slots=S, pages=M, page_size=p,
      prompt_multiple=ops.paged_prompt_multiple(*heads, p))
  weights = transformer.decode_params(cfg, weights)
  stats = EngineStats(*(jnp.zeros((), jnp.int32) for _ in range(3)),
                      *(jnp.zeros((), jnp.float32) for _ in range(2)),
                      *(jnp.zeros((), jnp.int32) for _ in range(2)))
  if hook_state is None:
    hook_state = hook.placed(hook.init(B, G), row_offset)
  if resume is None:
    state = State(
        tokens=jnp.full((N, T), pad_id, jnp.int32), logps=jnp.zeros((N, T), jnp.float32),
        length=jnp.where(skip, 0, 1).astype(jnp.int32),
        status=jnp.full((N,), PENDING, jnp.int32), eos=jnp.zeros((N,), bool), cache=cache,
        stats=stats, trained=jnp.ones((N, T if hook.forces else 0), bool),
        hook=hook_state)
  else:  # the fresh prompts' keys and values; the pages and slots as they were
    state, fresh = resume
    old = state.cache
    state = state.replace(
        cache=old.replace(prompt_k=cache.prompt_k, prompt_v=cache.prompt_v,
                          prompt_valid=cache.prompt_valid, prompt_length=cache.prompt_length),
        stats=stats, hook=hook_state)
    skip = skip | ~fresh

  def draw(state: State, logits, row, t, active) -> tuple[State, Array]:
    """Draws row[x]'s token t[x] and keeps those of active entries; [X] whether it ended."""
    tok, logp = strategies.sample_rows(rng_of(row, t), logits, sampling)
    if stop_at is not None:
      tok = jnp.where(t + 1 == stop_at[row], eos[0], tok)
    put = jnp.where(active, row, N)  # idle slots write nowhere
    drawn = Drawn(put, t, tok, active)
    hs, tok, forced = hook.draw(state.hook, state.rows(), drawn)
    ended = jnp.isin(tok, eos_arr) & ~forced & ~hook.goes_on(hs, drawn.replace(token=tok))
    state = state.replace(
        tokens=state.tokens.at[put, t].set(tok, mode="drop"),
        logps=state.logps.at[put, t].set(jnp.where(forced, 0.0, logp), mode="drop"),
        length=state.length.at[put].set(t + 1, mode="drop"),
        eos=state.eos.at[put].set(ended, mode="drop"),
        trained=state.trained.at[put, t].set(~forced, mode="drop") if hook.forces
        else state.trained,
        hook=hs)
    return state, ended

  # Every row's first token, from its prompt's last hidden state (left padding ends it at P - 1).
  logits = jnp.repeat(transformer.unembed(cfg, weights, last), G, axis=0)
  state, ended = draw(state, logits, rows, jnp.zeros_like(rows), ~skip)
  first = jnp.where(ended | (budget <= 1) | skip, DONE, PENDING).astype(jnp.int32)
  state = state.replace(status=first if resume is None else jnp.where(skip, state.status, first))

  def body(state: State) -> State:
    state = state.replace(hook=hook.begin_step(state.hook, state.rows()))
    held = end = jnp.zeros((N,), bool)
    if hook.holds:
      hs, held, end = hook.held(state.hook, state.rows())
      state = state.replace(hook=hs)
    was = state.status
    state = pages.admit(state, p, held=held)
    state = pages.allocate(state, p, held=held)
    restarted = (was == RUNNING) & (state.status == PENDING)
    state = state.replace(hook=hook.restart(state.hook, restarted))
    c = state.cache
    running = c.slot_row >= 0
    row = jnp.maximum(c.slot_row, 0)
    # A held slot feeds its last token again and draws nothing; an ending one draws nothing.
    waits, stops = running & held[row], running & end[row]
    drawing = running & ~waits & ~stops
    keys = sum(ops.paged_keys_read(
        *heads, slot_row=c.slot_row, slot_position=c.slot_position, group=G,
        full_pages=jnp.sum(c.page_full()), prompt_length=c.prompt_valid.shape[1], num_prompts=B,
        page_size=p, num_pages=M))
    live = jnp.sum(jnp.where(running, c.prompt_length[row // G] + c.slot_position + 1, 0))
    fed = jnp.take_along_axis(state.tokens[row], c.slot_position[:, None], axis=1)[:, 0]
    logits, c = transformer.paged_decode_step(cfg, weights, fed, c)
    t = c.slot_position + 1  # the position drawn now
    state, ended = draw(state.replace(cache=c), logits, row, t, drawing)
    finished = (drawing & (ended | (t + 1 >= budget[row]))) | stops
    state = state.replace(
        status=state.status.at[jnp.where(finished, c.slot_row, N)].set(DONE, mode="drop"),
        eos=state.eos.at[jnp.where(stops, c.slot_row, N)].set(True, mode="drop"),
        cache=c.replace(slot_position=jnp.where(drawing, t, c.slot_position)),
        stats=state.stats.replace(steps=state.stats.steps + 1,
                                  full_steps=state.stats.full_steps
                                  + (jnp.sum(drawing) == S).astype(jnp.int32),
                                  keys_read=state.stats.keys_read + keys.astype(jnp.float32),
                                  live_keys=state.stats.live_keys + live.astype(jnp.float32)),
    )
    return pages.release(state, finished)

  def more(state: State) -> Array:
    wants = hook.more(state.hook, state.rows())
    return jnp.any(state.status != DONE) if wants is None else wants

  # The tail: each loop runs until its run is over or the next, narrower one can take it.
  widths = (S,) + engine.tail(S)
  for i, width in enumerate(widths):
    if i:
      state = state.replace(cache=state.cache.compact(width))
    until = more if i + 1 == len(widths) else (
        lambda state, n=widths[i + 1]: more(state) & ~_fits(state, n))
    state = jax.lax.while_loop(until, body, state)
    if i == 0:
      wide = state.stats.steps
  return state.replace(stats=state.stats.replace(tail_steps=state.stats.steps - wide))


def _prefill(cfg: ModelConfig, weights, tokens, mask, group: int, rows: int):
  """(the prompts' last hidden states [B, D], their KVCache), `rows` prompts [B, P] at a
  time (0: all at once)."""
  B = tokens.shape[0]
  if not rows or rows >= B:
    hidden, cache = transformer.prefill(cfg, weights, tokens, mask, group=group,
                                        max_new_tokens=1)
    return hidden[:, -1], cache
  if B % rows:
    raise ValueError(f"prefill_rows={rows} must divide the {B} prompts")

  def chunk(args):
    hidden, cache = transformer.prefill(cfg, weights, *args, group=group, max_new_tokens=1)
    return hidden[:, -1], cache

  split = lambda x: x.reshape(B // rows, rows, *x.shape[1:])  # noqa: E731
  out = jax.lax.map(chunk, (split(tokens), split(mask)))
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)  # chunks in order


def _fits(state: State, slots: int) -> Array:
  """Whether `slots` slots can take the rest of the run: no row pending, at most that
  many running."""
  return ~jnp.any(state.status == PENDING) & (jnp.sum(state.cache.slot_row >= 0) <= slots)
