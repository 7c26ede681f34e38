"""Carried rollouts: the engine's rows kept from one rollout to the next, so that a
rollout never drains to its longest row.

Axes: B groups a rollout returns, G samples per prompt, Q groups in the pool
(Q - B carried between rollouts, B fresh a rollout), R = Q*G rows, P prompt
length, T = max_new_tokens, W the prefix width a resumed row's prompt holds.

A rollout (`resume_program`) takes the carried pool and one fresh batch of B
prompts, decodes every unfinished row on the engine until B groups have all
their rows ended, returns those B groups and keeps the rest (their tokens so
far, each token's log-prob and the policy version that drew it) for the next
rollout, under the weights the update makes in between:

- A row is resumed by recomputing it (AReaL's "recompute"): its prompt and its
  tokens so far are prefilled together under the new weights, and it draws on
  from there. Its row of the prompt store holds [prompt, tokens so far],
  left-padded to P + W (W: the longest carried prefix, bucketed: `prefix_width`).
- Rows whose first token was drawn more than max_staleness versions ago start
  again from their prompt, with a new key (their tokens are thrown away); so do
  all carried rows with partial="restart".
- Groups come back oldest first: the pool is kept in the order its groups came
  in, the engine admits the lowest rows first, and the B returned are the first B
  complete ones in that order. The rest stay, in order, and the next batch joins
  behind them.
- On a mesh whose batch axes split the prompts (`resume_sharded`) each row shard
  runs its own engine over its share of the pool and the batch, and returns its
  share of the B groups, oldest first within the shard; its kept rows stay on it.

Row r of a batch drawn with key k draws its token t with fold_in(fold_in(k, r), t)
wherever it is resumed (and `loop.run`'s rows_per_key=-1 keeps it so): with no
carried rows, a rollout is `engine.generate`'s, token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling.contract import SampleOutput
from grpojax.sampling.engine import loop, pages
from grpojax.sampling.engine.hooks import RowHook, Rows
from grpojax.sampling.engine.pages import DONE, PENDING, EngineConfig, EngineStats

Array = jax.Array


@flax.struct.dataclass
class Pool:
  """The rows carried between rollouts: C groups of G rows (C*G rows), groups in the
  order they came in.

  prompt_tokens, prompt_mask: [C, P] each group's (left-padded) prompt; example_ids [C].
  tokens: [C*G, T] int32 drawn so far (pad_id past length); logps [C*G, T] float32
    the behaviour log-prob of each (under the version that drew it); versions
    [C*G, T] int32 that version (the number of updates before it was drawn).
  length: [C*G] int32 tokens so far; ended [C*G] bool, the row has ended (its group
    waits for the others); eos [C*G] bool, it ended with an EOS.
  keys: [C*G] each row's key (typed PRNG keys).
  """

  prompt_tokens: Array
  prompt_mask: Array
  example_ids: Array
  tokens: Array
  logps: Array
  versions: Array
  length: Array
  ended: Array
  eos: Array
  keys: Array

  @property
  def groups(self) -> int:
    return self.prompt_tokens.shape[0]


def fresh(prompt_tokens: Array, prompt_mask: Array, example_ids: Array, rng: Array, *,
          num_samples: int, max_new_tokens: int, pad_id: int) -> Pool:
  """The pool of B new prompts [B, P] (nothing drawn yet); row r's key fold_in(rng, r),
  as `engine.generate` keys the rows of a batch drawn with rng."""
  B = prompt_tokens.shape[0]
  N, T = B * num_samples, max_new_tokens
  return Pool(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask,
              example_ids=example_ids.astype(jnp.int32),
              tokens=jnp.full((N, T), pad_id, jnp.int32), logps=jnp.zeros((N, T), jnp.float32),
              versions=jnp.zeros((N, T), jnp.int32), length=jnp.zeros((N,), jnp.int32),
              ended=jnp.zeros((N,), bool), eos=jnp.zeros((N,), bool),
              keys=jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(N)))


def join(a: Pool, b: Pool) -> Pool:
  """The pool of a's groups, then b's."""
  return jax.tree.map(lambda x, y: jnp.concatenate([x, y]), a, b)


def take(pool: Pool, groups: Array, G: int) -> Pool:
  """The pool of `groups` [n] of `pool`, in that order."""
  rows = (groups[:, None] * G + jnp.arange(G)).reshape(-1)
  per_group = ("prompt_tokens", "prompt_mask", "example_ids")
  return pool.replace(**{f.name: getattr(pool, f.name)[groups if f.name in per_group else rows]
                         for f in dataclasses.fields(pool)})


def prefix_width(longest: int, max_new_tokens: int) -> int:
  """W for a pool whose longest unfinished prefix is `longest` tokens: 0 for none, else
  the next multiple of max(T / 4, 1024) tokens, at most T - 1. Each W is a program
  compiled: one for T <= 1024 (where a wider prefill costs little), at most four."""
  if longest <= 0:
    return 0
  step = max(-(-max_new_tokens // 4), 1024)
  return min(-(-longest // step) * step, max_new_tokens - 1)


# Tokens a prefill chunk holds at most: its activations stay far below the pool's.
PREFILL_TOKENS = 32768


def prefill_rows(rows: int, width: int) -> int:
  """The rows of [rows, width] prompts a prefill takes at a time: the most that divide
  them in at most PREFILL_TOKENS tokens (at least one); 0: all of them fit."""
  if rows * width <= PREFILL_TOKENS:
    return 0
  return max([d for d in range(1, rows + 1) if rows % d == 0 and d * width <= PREFILL_TOKENS],
             default=1)


@flax.struct.dataclass
class CarryStats:
  """What a rollout did to its pool: restarted [] rows started again (stale, or
  partial="restart"), wasted [] their tokens thrown away, carried [] rows kept for the
  next rollout that hold tokens, ended [] rows that ended in this rollout and
  ended_tokens [] their lengths summed (the generated lengths, against the returned)."""

  restarted: Array
  wasted: Array
  carried: Array
  ended: Array
  ended_tokens: Array


@dataclasses.dataclass(frozen=True)
class _UntilGroups(RowHook):
  """Runs until `groups` groups of `group` rows have all their rows ended."""

  groups: int
  group: int

  def more(self, state, rows: Rows) -> Array:
    complete = jnp.all(rows.status.reshape(-1, self.group) == DONE, axis=1)
    return jnp.any(rows.status != DONE) & (jnp.sum(complete) < self.groups)


def _prompts(pool: Pool, G: int, W: int, pad_id: int) -> tuple[Array, Array]:
  """([R, P + W] tokens, mask): each row's prompt and then its first W tokens so far (its
  whole prefix: W is at least the longest unfinished one), left-padded."""
  P = pool.prompt_tokens.shape[1]
  tokens = jnp.repeat(pool.prompt_tokens, G, axis=0)
  mask = jnp.repeat(pool.prompt_mask, G, axis=0).astype(jnp.int32)
  if W == 0:
    return tokens, mask
  prefix = jnp.arange(W)[None, :] < jnp.minimum(pool.length, W)[:, None]
  tokens = jnp.concatenate([tokens, jnp.where(prefix, pool.tokens[:, :W], pad_id)], axis=1)
  mask = jnp.concatenate([mask, prefix.astype(jnp.int32)], axis=1)
  # Left-padded again: each row moved right by its unused prefix columns.
  shift = W - jnp.minimum(pool.length, W)
  index = (jnp.arange(P + W)[None, :] - shift[:, None]) % (P + W)
  return (jnp.take_along_axis(tokens, index, axis=1), jnp.take_along_axis(mask, index, axis=1))


def _restart(pool: Pool, which: Array, version: Array, pad_id: int) -> tuple[Pool, Array, Array]:
  """(pool with rows `which` [R] emptied and rekeyed with `version`, rows restarted,
  tokens thrown away)."""
  which = which & (pool.length > 0)
  return pool.replace(
      tokens=jnp.where(which[:, None], pad_id, pool.tokens),
      logps=jnp.where(which[:, None], 0.0, pool.logps),
      versions=jnp.where(which[:, None], 0, pool.versions),
      length=jnp.where(which, 0, pool.length), ended=pool.ended & ~which,
      eos=pool.eos & ~which,
      keys=jnp.where(which, jax.vmap(lambda k: jax.random.fold_in(k, version))(pool.keys),
                     pool.keys)), jnp.sum(which), jnp.sum(jnp.where(which, pool.length, 0))


_STATIC = ("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id", "engine",
           "groups", "width")


@functools.partial(jax.jit, static_argnames=_STATIC)
def resume_program(cfg, weights, pool: Pool, version, *, sampling, num_samples: int,
                   max_new_tokens: int, eos: tuple, pad_id: int, engine: EngineConfig,
                   groups: int, max_staleness, restart, width: int, stop_at=None):
  """One carried rollout over `pool` (Q groups: the carried ones, then the fresh batch).

  version: [] int32 the policy version now (the updates so far). groups: B, the groups
  returned. max_staleness: [] the staleness bound; restart: [] bool, every carried row
  starts again (partial="restart"); both traced (one program for every setting).
  width: W, the prefix width (`prefix_width` of the pool's longest unfinished row,
  or more). stop_at: [R] int32, the test and benchmark hook: row r
  draws eos[0] as its token stop_at[r] - 1 (counted from its first token).

  Returns (SampleOutput of the B groups' B*G rows, their Pool (prompts, example
  ids, versions), the Pool of the Q - B groups kept, EngineStats, CarryStats).
  """
  G, T = num_samples, max_new_tokens
  Q = pool.groups
  R = Q * G
  if not 0 < groups <= Q:
    raise ValueError(f"a carried rollout returns 0 < {groups} <= {Q} (its pool's) groups")
  stale = (version - pool.versions[:, 0] > max_staleness) | restart
  pool, restarted, wasted = _restart(pool, stale & (pool.length > 0), version, pad_id)
  # Only unfinished rows are resumed; an ended row waits, untouched, for its group.
  live = ~pool.ended
  tokens, mask = _prompts(pool, G, width, pad_id)
  start = jnp.where(live, pool.length, 0)
  state = loop.run(
      cfg, weights, tokens, mask, pool.keys, sampling=sampling, num_samples=1,
      max_new_tokens=T, eos=eos, pad_id=pad_id, engine=engine,
      stop_at=None if stop_at is None else stop_at - start,
      hook=_UntilGroups(groups, G), rows_per_key=-1, start=start, budget=T - start,
      skip=pool.ended, prefill_rows=prefill_rows(R, tokens.shape[1]))
  # The rows' new tokens go after their prefixes.
  drawn = jnp.where(live, state.length, 0)
  column = start[:, None] + jnp.arange(T)[None, :]
  put = jnp.where(jnp.arange(T)[None, :] < drawn[:, None], column, T)
  rows = jnp.arange(R)[:, None]
  ended_now = live & (state.status == DONE)
  pool = pool.replace(
      tokens=pool.tokens.at[rows, put].set(state.tokens, mode="drop"),
      logps=pool.logps.at[rows, put].set(state.logps, mode="drop"),
      versions=pool.versions.at[rows, put].set(version, mode="drop"),
      length=pool.length + drawn, ended=pool.ended | ended_now,
      eos=pool.eos | (ended_now & state.eos))
  complete = jnp.all(pool.ended.reshape(Q, G), axis=1)
  order = jnp.arange(Q)
  chosen = jnp.argsort(jnp.where(complete, order, Q + order))[:groups]  # the oldest complete
  picked = jnp.zeros((Q,), bool).at[chosen].set(True)
  kept = jnp.argsort(jnp.where(picked, Q + order, order))[:Q - groups]  # the rest, in order
  out_pool, kept_pool = take(pool, chosen, G), take(pool, kept, G)
  out = output(out_pool, pad_id)
  stats = CarryStats(restarted=restarted, wasted=wasted,
                     carried=jnp.sum(kept_pool.length > 0),
                     ended=jnp.sum(ended_now),
                     ended_tokens=jnp.sum(jnp.where(ended_now, pool.length, 0)))
  return out, out_pool, kept_pool, state.stats, stats


def resume_sharded(cfg, weights, pool: Pool | None, new: Pool, version, *, mesh, groups: int,
                   engine: EngineConfig, max_new_tokens: int, **kw):
  """`resume_program` on each row shard of `mesh`'s batch axes (d of them, dividing
  the groups): shard i joins its share of the carried pool (None: none) and of the
  new groups `new`, and returns its groups / d oldest complete groups, its rows
  staying on it for the next rollout. Weights are replicated in (gathered where
  sharded), as `engine.sharded_program` does; kw: resume_program's.

  Returns resume_program's five, rows split over the batch axes: EngineStats over
  all shards (EngineStats.of_shards), CarryStats summed."""
  from jax.sharding import PartitionSpec as P

  axes = tuple(a for a in mesh_lib.BATCH_AXES if a in mesh.shape)
  shards = math.prod(mesh.shape[a] for a in axes)
  if groups % shards:
    raise ValueError(f"{groups} groups do not split over {shards} row shards")
  local_engine = engine.per_shard(shards, max_new_tokens)

  def local(weights, pool, new, version):
    pool = new if pool is None else join(pool, new)
    out, got, kept, engine_stats, stats = resume_program(
        cfg, weights, pool, version, groups=groups // shards, engine=local_engine,
        max_new_tokens=max_new_tokens, **kw)
    stack = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
    return out, got, kept, stack(engine_stats), stack(stats)

  rows = P(axes)
  out, got, kept, engine_stats, stats = jax.shard_map(
      local, mesh=mesh, in_specs=(P(), rows, rows, P()), out_specs=rows, check_vma=False)(
          loop.compute_dtype_matmuls(cfg, weights), pool, new, version)
  return (out, got, kept, EngineStats.of_shards(engine_stats),
          jax.tree.map(lambda x: jnp.sum(x, axis=0), stats))


def output(pool: Pool, pad_id: int) -> SampleOutput:
  """The SampleOutput of a pool's rows (as they stand)."""
  T = pool.tokens.shape[1]
  mask = (jnp.arange(T)[None, :] < pool.length[:, None]).astype(jnp.int32)
  return SampleOutput(tokens=jnp.where(mask > 0, pool.tokens, pad_id), mask=mask,
                      logps=jnp.where(mask > 0, pool.logps, 0.0), lengths=pool.length,
                      truncated=~pool.eos)


def staleness_metrics(versions: Array, mask: Array, version: Array, max_staleness: int) -> dict:
  """carry/staleness/mean and /max over the trained tokens (mask [N, T]) of versions
  [N, T] at `version`, and /k (k = 0 .. max_staleness, at most 8) the fraction k
  versions old."""
  age = jnp.where(mask > 0, version - versions, 0).astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  out = {"carry/staleness/mean": jnp.sum(age) / count, "carry/staleness/max": jnp.max(age)}
  for k in range(min(max_staleness, 8) + 1):
    out[f"carry/staleness/{k}"] = jnp.sum((age == k) & (mask > 0)) / count
  return out


def stats_metrics(stats: CarryStats, engine_stats: EngineStats, trained_lengths: Array) -> dict:
  """carry/*: the rows restarted, their tokens wasted, the rows carried on, the slots'
  occupancy (decode steps with every slot busy) and the generated rows' mean length
  beside the returned ones' (trained_lengths [N]): carry/length_bias, their ratio - 1."""
  generated = stats.ended_tokens / jnp.maximum(stats.ended, 1)
  trained = jnp.mean(trained_lengths.astype(jnp.float32))
  return {"carry/restarted_rows": stats.restarted, "carry/wasted_tokens": stats.wasted,
          "carry/carried_rows": stats.carried,
          "carry/occupancy": engine_stats.full_steps / jnp.maximum(engine_stats.steps, 1),
          "carry/generated_mean_length": generated,
          "carry/length_bias": jnp.where(stats.ended > 0, trained / jnp.maximum(generated, 1e-9)
                                         - 1.0, 0.0)}


# ---------------------------------------------------------------- keep


@flax.struct.dataclass
class Kept:
  """partial="keep": the engine's whole state carried through the update (PipelineRL's
  in-flight update): its rows, slots and pages, the keys and values of the tokens
  drawn so far kept as the old weights wrote them. Q groups of G rows, R = Q*G.

  engine: the decode loop's loop.State (rows, PagedCache with the pool, stats).
  prompt_tokens, prompt_mask: [Q, P]; example_ids [Q]; versions [R, T] int32 the
  version that drew each token; keys [R] each row's key. The last B groups are
  the ones the last rollout returned: the next one puts its new batch there.
  """

  engine: loop.State
  prompt_tokens: Array
  prompt_mask: Array
  example_ids: Array
  versions: Array
  keys: Array


def _run_kept(cfg, weights, kept: Kept, start: Array, *, sampling, num_samples, max_new_tokens,
              eos, pad_id, engine, groups, stop_at, resume: bool) -> loop.State:
  """The engine over kept's groups: rows `start` [R] draw their first token now, the
  others go on (resume) or, for a first rollout, every row starts."""
  return loop.run(
      cfg, weights, kept.prompt_tokens, kept.prompt_mask, kept.keys, sampling=sampling,
      num_samples=num_samples, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id,
      engine=dataclasses.replace(engine, tail_slots=()),  # all S slots go on next time
      stop_at=stop_at, hook=_UntilGroups(groups, num_samples), rows_per_key=-1,
      prefill_rows=prefill_rows(*kept.prompt_tokens.shape),
      resume=(kept.engine, start) if resume else None)


def _pick(kept: Kept, state: loop.State, before: Array, start: Array, version, groups: int,
          pad_id: int, restarted, wasted):
  """keep_program's returns from the run's final `state`; before [R] the rows' lengths
  before it, start [R] the rows that began in it."""
  G, B = kept.keys.shape[0] // kept.prompt_tokens.shape[0], groups
  Q = kept.prompt_tokens.shape[0]
  R = Q * G
  T = state.tokens.shape[1]
  position = jnp.arange(T)[None, :]
  versions = jnp.where((position >= before[:, None]) & (position < state.length[:, None]),
                       version, jnp.where(start[:, None], 0, kept.versions))
  ended_now = (state.status == DONE) & (start | (kept.engine.status != DONE))
  complete = jnp.all(state.status.reshape(Q, G) == DONE, axis=1)
  order = jnp.arange(Q)
  chosen = jnp.argsort(jnp.where(complete, order, Q + order))[:B]
  picked = jnp.zeros((Q,), bool).at[chosen].set(True)
  # The rest first, in order; the returned groups last, where the next batch goes.
  perm = jnp.argsort(jnp.where(picked, Q + order, order))
  rows = (perm[:, None] * G + jnp.arange(G)).reshape(-1)
  inverse = jnp.zeros((R,), jnp.int32).at[rows].set(jnp.arange(R, dtype=jnp.int32))
  c = state.cache
  moved = state.replace(
      tokens=state.tokens[rows], logps=state.logps[rows], length=state.length[rows],
      status=state.status[rows], eos=state.eos[rows], trained=state.trained[rows],
      cache=c.replace(slot_row=jnp.where(c.slot_row >= 0,
                                         inverse[jnp.maximum(c.slot_row, 0)], -1)))
  out_rows = rows[R - B * G:]
  pool = Pool(prompt_tokens=kept.prompt_tokens[chosen], prompt_mask=kept.prompt_mask[chosen],
              example_ids=kept.example_ids[chosen], tokens=state.tokens[out_rows],
              logps=state.logps[out_rows], versions=versions[out_rows],
              length=state.length[out_rows], ended=jnp.ones((B * G,), bool),
              eos=state.eos[out_rows], keys=kept.keys[out_rows])
  following = Kept(engine=moved, prompt_tokens=kept.prompt_tokens[perm],
                   prompt_mask=kept.prompt_mask[perm], example_ids=kept.example_ids[perm],
                   versions=versions[rows], keys=kept.keys[rows])
  left = jnp.arange(R) < R - B * G
  stats = CarryStats(restarted=restarted, wasted=wasted,
                     carried=jnp.sum(left & (moved.length > 0)), ended=jnp.sum(ended_now),
                     ended_tokens=jnp.sum(jnp.where(ended_now, state.length, 0)))
  return output(pool, pad_id), pool, following, state.stats, stats


@functools.partial(jax.jit, static_argnames=_STATIC + ("fresh_from",))
def keep_program(cfg, weights, kept: Kept, version, *, sampling, num_samples: int,
                 max_new_tokens: int, eos: tuple, pad_id: int, engine: EngineConfig,
                 groups: int, max_staleness, restart, width: int = 0, stop_at=None,
                 fresh_from: int = 0):
  """One rollout of a kept engine (partial="keep"): `resume_program`'s contract over a
  Kept instead of a Pool. kept's groups from fresh_from on are new (nothing drawn:
  their rows start now, keyed by kept.keys); the others go on in their slots with the
  keys and values they hold. A row whose first token is more than max_staleness
  versions old (or, with restart, any row not new) starts again, rekeyed. Every
  prompt is prefilled again under `weights` (Q x P tokens, no prefix). stop_at: [R]
  int32 as resume_program's. width: unused (resume_program's signature).

  Returns (SampleOutput of the B groups returned, their Pool, the Kept for the next
  rollout (its last B groups the returned ones, to be replaced: `kept_with`),
  EngineStats, CarryStats).
  """
  del width
  G, Q = num_samples, kept.prompt_tokens.shape[0]
  R = Q * G
  state = kept.engine
  new = jnp.arange(R) >= fresh_from * G
  stale = ((version - kept.versions[:, 0] > max_staleness) | restart) & ~new & (state.length > 0)
  c = state.cache
  state = pages.release(state, (c.slot_row >= 0) & stale[jnp.maximum(c.slot_row, 0)])
  start = new | stale
  restarted, wasted = jnp.sum(stale), jnp.sum(jnp.where(stale, state.length, 0))
  keys = jnp.where(stale, jax.vmap(lambda k: jax.random.fold_in(k, version))(kept.keys),
                   kept.keys)
  state = state.replace(
      tokens=jnp.where(start[:, None], pad_id, state.tokens),
      logps=jnp.where(start[:, None], 0.0, state.logps),
      length=jnp.where(start, 0, state.length), eos=state.eos & ~start,
      status=jnp.where(start, PENDING, state.status))
  kept = kept.replace(engine=state, keys=keys)
  final = _run_kept(cfg, weights, kept, start, sampling=sampling, num_samples=G,
                    max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id, engine=engine,
                    groups=groups, stop_at=stop_at, resume=True)
  return _pick(kept, final, state.length, start, version, groups, pad_id, restarted, wasted)


@functools.partial(jax.jit, static_argnames=_STATIC)
def keep_start(cfg, weights, pool: Pool, version, *, sampling, num_samples: int,
               max_new_tokens: int, eos: tuple, pad_id: int, engine: EngineConfig,
               groups: int, max_staleness, restart, width: int = 0, stop_at=None):
  """The first rollout of a kept engine: every group of `pool` new (nothing drawn);
  keep_program's returns."""
  del max_staleness, restart, width
  G, T = num_samples, max_new_tokens
  R = pool.groups * G
  kept = Kept(engine=None, prompt_tokens=pool.prompt_tokens, prompt_mask=pool.prompt_mask,
              example_ids=pool.example_ids, versions=jnp.zeros((R, T), jnp.int32),
              keys=pool.keys)
  final = _run_kept(cfg, weights, kept, jnp.ones((R,), bool), sampling=sampling,
                    num_samples=G, max_new_tokens=T, eos=eos, pad_id=pad_id, engine=engine,
                    groups=groups, stop_at=stop_at, resume=False)
  kept = kept.replace(engine=final)
  zero = jnp.zeros((), jnp.int32)
  return _pick(kept, final, jnp.zeros((R,), jnp.int32), jnp.ones((R,), bool), version,
               groups, pad_id, zero, zero)


def kept_with(kept: Kept, prompt_tokens: Array, prompt_mask: Array, example_ids: Array,
              rng: Array) -> Kept:
  """kept with its last B groups (the ones returned) replaced by B new prompts [B, P],
  their rows keyed fold_in(rng, r) as `fresh` keys them."""
  B, Q = prompt_tokens.shape[0], kept.prompt_tokens.shape[0]
  G = kept.keys.shape[0] // Q
  new_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(B * G))
  return kept.replace(prompt_tokens=kept.prompt_tokens.at[Q - B:].set(prompt_tokens),
                      prompt_mask=kept.prompt_mask.at[Q - B:].set(prompt_mask),
                      example_ids=kept.example_ids.at[Q - B:].set(example_ids.astype(jnp.int32)),
                      keys=jnp.concatenate([kept.keys[:(Q - B) * G], new_keys]))
