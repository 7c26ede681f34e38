"""DAPO's dynamic sampling streamed through the engine: one row-event hook (StreamHook)
that scores each group as its last row ends and stops the run once the groups
needed are known, and the program that runs it (`stream_program`).

Axes: R batches of B candidate prompts, C = R*B candidate groups, G samples per
prompt, F groups a scoring call takes, T = max_new_tokens, K rewards.

The candidate prompts of several batches are prefilled together and their rows
wait in one queue (the lowest first, so earlier groups always get the slots
first). Each group is scored on the host as its last row ends (by a callback the
loop waits on, or on host threads while it decodes: HostScorer), and the loop
stops once the first B accepted groups, in order, are known. The slots that
whole rounds leave idle while a batch's longest rows finish decode the next
batch's groups instead, and no batch is decoded past what is needed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling.engine import loop
from grpojax.sampling.engine.hooks import RowHook, Rows
from grpojax.sampling.engine.scorer import HostScorer
from grpojax.sampling.engine.pages import DONE, PENDING, RUNNING, EngineConfig, EngineStats

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Stream:
  """DAPO's streaming (static: part of the program's identity). Groups are scored
  one of two ways:

  score: traceable, called inside the decode loop on the groups whose rows have
    all ended, which waits for it: (example_ids [F], tokens [F*G, T], mask
    [F*G, T], valid [F] bool) -> (rewards [F*G, K] float32, errors [K] int32,
    accept [F] bool). Rows of groups not valid are padding: score must leave
    them out (their rewards are dropped). F = groups.
  host, accept: or a HostScorer that scores them on the host while the loop
    decodes, and a traceable accept(rewards [F*G, K], valid [F]) -> [F] bool
    of its results. The loop hands it each group as it ends and polls it every
    poll_every steps (each step once nothing is left to decode); the groups
    chosen are the same, the run goes on decoding while verifiers work.
  groups: how many accepted groups to collect (per row shard).
  rewards: K, the reward columns score returns.
  """

  score: Callable | None = None
  groups: int = 0
  rewards: int = 0
  host: HostScorer | None = None
  accept: Callable | None = None
  poll_every: int = 8

  def __post_init__(self):
    if (self.score is None) == (self.host is None) or (self.host is None) != (self.accept is None):
      raise ValueError("Stream: give score (scored in the loop), or host and accept (scored "
                       "on the host while the loop decodes)")
    if self.groups < 1 or self.rewards < 1 or self.poll_every < 1:
      raise ValueError(f"Stream: groups={self.groups}, rewards={self.rewards} and "
                       f"poll_every={self.poll_every} must be >= 1")


@flax.struct.dataclass
class StreamOutput:
  """What `stream_program` returns beside the chosen groups' SampleOutput. C candidate
  groups (rounds x the shard's prompts), F chosen groups, G rows each, K rewards.

  prompt_tokens, prompt_mask: [F, P] the chosen groups' prompts; example_ids [F].
  rewards: [F*G, K] the chosen rows' rewards (from the loop's scoring).
  decoded: [C] bool, the candidates begun (or scored); scored: [C] bool, those
    finished and scored; accepted: [C] bool, those whose score accepted them;
    needed: [C] bool, the prefix through the B-th accepted (all, if fewer were):
    what whole rounds would have consumed of it; chosen: [C] bool, those returned.
  all_rewards: [C*G, K], all_lengths [C*G], all_truncated [C*G]: every candidate
    row's (rewards NaN where not scored), for the first round's metrics.
  errors: [K] reward function errors over all scoring calls.
  """

  prompt_tokens: Array
  prompt_mask: Array
  example_ids: Array
  rewards: Array
  decoded: Array
  scored: Array
  accepted: Array
  needed: Array
  chosen: Array
  all_rewards: Array
  all_lengths: Array
  all_truncated: Array
  errors: Array


@functools.partial(
    jax.jit, static_argnames=("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id",
                              "engine", "stream", "mesh"))
def stream_program(cfg, weights, prompt_tokens, prompt_mask, example_ids, rng, *,
                   sampling, num_samples, max_new_tokens, eos, pad_id, engine: EngineConfig,
                   stream: Stream, mesh=None, stop_at=None):
  """DAPO's dynamic sampling in one run of the engine: (SampleOutput, StreamOutput,
  EngineStats) of the B groups chosen from R batches of B candidate prompts.

  prompt_tokens, prompt_mask: [R, B, P] (left-padded); example_ids [R, B]; rng: the
  step's key. Batch r's rows draw as `generate` would draw them with key rng (r = 0)
  or fold_in(rng, r): the rows of a batch decoded here are token for token those of
  that round's `generate(engine=...)`. Rows are admitted lowest first, batch 0's
  before batch 1's, and each group is scored (stream.score or stream.host) once its
  last row ends; the run stops once the shortest prefix of groups with B accepted is
  all scored.
  Returned: the first B accepted groups in order, then, if all R batches gave
  fewer, the last batch's first unaccepted groups: the groups (and order) that
  whole rounds pick. Groups past that prefix that had begun are left unfinished.
  stream.groups must be B (each row shard's share on a mesh). With a mesh whose
  batch axes split the prompts, each shard streams its own share of every batch
  towards its share of the groups (as `sharded_program`), so the groups chosen
  are each shard's first accepted ones. stop_at: [R, B*G] the test hook.
  StreamOutput's [C] and [C*G] fields come as [R, B] and [R, B*G]: in batch order.
  """
  from jax.sharding import PartitionSpec as P

  R, B, _ = prompt_tokens.shape
  G = num_samples
  shards = loop.row_shards(mesh, B)
  if stream.groups * shards != B:
    raise ValueError(f"Stream.groups={stream.groups} must be the {B} prompts of a batch over "
                     f"{shards} row shard(s)")
  keys = jnp.stack([rng] + [jax.random.fold_in(rng, r) for r in range(1, R)])
  local_engine = engine.per_shard(shards, max_new_tokens)
  kw = dict(cfg=cfg, sampling=sampling, num_samples=G, max_new_tokens=max_new_tokens, eos=eos,
            pad_id=pad_id, engine=local_engine, stream=stream)
  forced = stop_at is not None
  if not forced:
    stop_at = jnp.zeros((R, B * G), jnp.int32)  # a placeholder, never read

  def local(weights, tokens, mask, ids, stop, shard):
    out, extra, stats = _stream_local(weights, tokens, mask, ids, keys, stop if forced else None,
                                      row_offset=shard * (B // shards) * G, shard=shard, **kw)
    return out, extra, jax.tree.map(lambda x: x[None], stats)

  if shards == 1:
    out, extra, stats = local(weights, prompt_tokens, prompt_mask, example_ids, stop_at, 0)
  else:
    axes = tuple(a for a in mesh_lib.BATCH_AXES if a in mesh.shape)
    cols = P(None, axes)

    def sharded(weights, tokens, mask, ids, stop):
      out, extra, stats = local(weights, tokens, mask, ids, stop, loop.shard_index(mesh, axes))
      return out, extra.replace(errors=extra.errors[None]), stats

    weights = loop.compute_dtype_matmuls(cfg, weights)  # replicated in the compute dtype
    out, extra, stats = jax.shard_map(
        sharded, mesh=mesh, in_specs=(P(), cols, cols, cols, cols),
        out_specs=(P(axes), StreamOutput(*(P(axes),) * 4, *(P(None, axes),) * 8, P(axes)),
                   P(axes)),
        check_vma=False)(weights, prompt_tokens, prompt_mask, example_ids, stop_at)
    extra = extra.replace(errors=extra.errors.sum(0))
  return out, extra, EngineStats.of_shards(stats)


def _stream_local(weights, tokens_RbP, mask_RbP, ids_Rb, keys_R, stop_Rn, *, cfg, sampling,
                  num_samples, max_new_tokens, eos, pad_id, engine, stream, row_offset, shard):
  """One shard's streaming run over its b prompts of each of R batches."""
  R, b, _ = tokens_RbP.shape
  G = num_samples
  C = R * b
  flat = lambda x: x.reshape(R * b, *x.shape[2:])  # noqa: E731
  hook = StreamHook(stream)
  start = hook.init(C, G).replace(example_ids=flat(ids_Rb), shard=jnp.asarray(shard, jnp.int32))
  state = loop.run(cfg, weights, flat(tokens_RbP), flat(mask_RbP), keys_R, sampling=sampling,
                   num_samples=G, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id,
                   engine=engine, stop_at=None if stop_Rn is None else stop_Rn.reshape(-1),
                   row_offset=row_offset, hook=hook, hook_state=start, rows_per_key=b * G)
  scores = state.hook
  group = jnp.arange(C)
  rows_of = lambda x: x.reshape(C, G)  # noqa: E731
  touched = (scores.scored | jnp.any(rows_of(state.length) > 1, axis=1)
             | jnp.any(rows_of(state.status) == RUNNING, axis=1))
  # The accepted groups first, in order; then the last batch's scored (unaccepted) ones.
  rank = jnp.where(scores.accepted, group,
                   jnp.where(scores.scored & (group >= C - b), C + group, 2 * C + group))
  chosen = jnp.argsort(rank)[:stream.groups]
  rows = _group_rows(chosen, G)
  out = loop.output(state, pad_id, rows)
  by_batch = lambda x: x.reshape(R, -1, *x.shape[1:])  # noqa: E731
  extra = StreamOutput(
      prompt_tokens=flat(tokens_RbP)[chosen], prompt_mask=flat(mask_RbP)[chosen],
      example_ids=flat(ids_Rb)[chosen], rewards=scores.rewards[rows],
      decoded=by_batch(touched), scored=by_batch(scores.scored),
      accepted=by_batch(scores.accepted),
      needed=by_batch(jnp.cumsum(scores.accepted) - scores.accepted < stream.groups),
      chosen=by_batch(jnp.zeros((C,), bool).at[chosen].set(True)),
      all_rewards=by_batch(scores.rewards), all_lengths=by_batch(state.length),
      all_truncated=by_batch(~state.eos), errors=scores.errors)
  return out, extra, state.stats


@flax.struct.dataclass
class StreamState:
  """StreamHook's state. C candidate groups, N = C*G rows, K rewards.

  example_ids: [C] the groups' examples (for the verifiers); shard: [] this row
  shard's number (HostScorer keeps each shard's hand-offs apart); scored [C]
  bool, those scored; submitted [C] bool, those handed to Stream.host;
  accepted [C] bool; rewards [N, K] float32 (NaN where not scored); errors [K]
  int32, reward function errors over all scoring calls.
  """

  example_ids: Array
  shard: Array
  scored: Array
  submitted: Array
  accepted: Array
  rewards: Array
  errors: Array


@dataclasses.dataclass(frozen=True, eq=False)
class StreamHook(RowHook):
  """Streaming as a row-event hook: at each step's start the groups whose rows have
  all ended are scored (Stream.score in the loop, or handed to Stream.host and
  collected as they finish), and the run goes on until the first Stream.groups
  accepted groups are known, or every group is scored."""

  stream: Stream

  def __hash__(self):
    return hash(self.stream)

  def __eq__(self, other):
    return isinstance(other, StreamHook) and self.stream == other.stream

  def init(self, num_prompts: int, group: int) -> StreamState:
    K = self.stream.rewards
    none = jnp.zeros((num_prompts,), bool)
    return StreamState(example_ids=jnp.zeros((num_prompts,), jnp.int32),
                       shard=jnp.zeros((), jnp.int32), scored=none, submitted=none,
                       accepted=none, rewards=jnp.full((num_prompts * group, K), jnp.nan,
                                                       jnp.float32),
                       errors=jnp.zeros((K,), jnp.int32))

  def begin_step(self, state: StreamState, rows: Rows) -> StreamState:
    if self.stream.host is None:
      return _score(state, rows, self.stream)
    return _hand_off(state, rows, self.stream)

  def more(self, state: StreamState, rows: Rows) -> Array:
    """Until the first `groups` accepted groups are known: the shortest prefix of groups
    holding that many accepted ones is all scored; or every group is."""
    accepted = jnp.cumsum(state.accepted)
    unscored = jnp.cumsum(~state.scored)
    return ~(jnp.any((accepted >= self.stream.groups) & (unscored == 0)) | (unscored[-1] == 0))


def _group_rows(group: Array, G: int) -> Array:
  """[F*G] the rows of groups [F]."""
  return (group[:, None] * G + jnp.arange(G)).reshape(-1)


def _ended(state: StreamState, rows: Rows, seen: Array) -> tuple[Array, int]:
  """([C] groups whose rows have all ended and are not `seen`, G)."""
  C = state.scored.shape[0]
  G = rows.status.shape[0] // C
  return jnp.all(rows.status.reshape(C, G) == DONE, axis=1) & ~seen, G


def _completions(rows: Rows, group_rows: Array) -> tuple[Array, Array]:
  """(tokens [n, T], mask [n, T]) of rows [n] as they ended."""
  T = rows.tokens.shape[1]
  mask = (jnp.arange(T)[None, :] < rows.length[group_rows][:, None]).astype(jnp.int32)
  return rows.tokens[group_rows], mask


def _score(state: StreamState, rows: Rows, stream: Stream) -> StreamState:
  """Scores the groups whose rows have all ended, up to stream.groups of them (the
  rest at the next steps), through one host callback, only on the steps where one
  has ended."""
  C, F = state.scored.shape[0], stream.groups
  ended, G = _ended(state, rows, state.scored)

  def score(carry):
    scored, accepted, rewards, errors = carry
    group, = jnp.nonzero(ended, size=F, fill_value=C)
    valid = group < C
    group = jnp.minimum(group, C - 1)
    group_rows = _group_rows(group, G)
    got, errs, accept = stream.score(state.example_ids[group], *_completions(rows, group_rows),
                                     valid)
    put_group = jnp.where(valid, group, C)
    put_rows = jnp.where(jnp.repeat(valid, G), group_rows, G * C)
    return (scored.at[put_group].set(True, mode="drop"),
            accepted.at[put_group].set(accept & valid, mode="drop"),
            rewards.at[put_rows].set(got.astype(jnp.float32), mode="drop"),
            errors + errs.astype(jnp.int32))

  # Only the small arrays the scoring writes pass through the cond: no branch
  # carries the cache's pages, which XLA would otherwise have to thread through it.
  scored, accepted, rewards, errors = jax.lax.cond(
      jnp.any(ended), score, lambda carry: carry,
      (state.scored, state.accepted, state.rewards, state.errors))
  return state.replace(scored=scored, accepted=accepted, rewards=rewards, errors=errors)


def _hand_off(state: StreamState, rows: Rows, stream: Stream) -> StreamState:
  """Stream.host's side of a step: the groups whose rows have all ended go to the host
  (up to stream.groups a step, the rest at the next), and every stream.poll_every
  steps, or each step once nothing is left to decode, the finished ones come back
  and are accepted or not (stream.accept)."""
  C = state.scored.shape[0]
  F, K, host = stream.groups, stream.rewards, stream.host
  ended, G = _ended(state, rows, state.submitted)

  def submit(submitted):
    group, = jnp.nonzero(ended, size=F, fill_value=C)
    valid = group < C
    group = jnp.minimum(group, C - 1)
    tokens, mask = _completions(rows, _group_rows(group, G))
    done = io_callback(host.submit, jax.ShapeDtypeStruct((), jnp.int32), state.shard,
                       jnp.where(valid, group, -1), jnp.repeat(state.example_ids[group], G),
                       tokens, mask, jnp.repeat(valid, G))
    # Its (zero) result is used, so no compiler can drop the hand-off.
    return submitted.at[jnp.where(valid, group, C)].set(done == 0, mode="drop")

  submitted = jax.lax.cond(jnp.any(ended), submit, lambda x: x, state.submitted)
  waiting = jnp.any(submitted & ~state.scored)
  idle = ~jnp.any(rows.slot_row >= 0) & ~jnp.any(rows.status == PENDING)
  poll = waiting & (idle | (rows.step % stream.poll_every == 0))

  def collect(carry):
    scored, accepted, rewards, errors = carry
    group, got, errs = io_callback(
        functools.partial(host.collect, F=F, rows=F * G, K=K),
        (jax.ShapeDtypeStruct((F,), jnp.int32), jax.ShapeDtypeStruct((F * G, K), jnp.float32),
         jax.ShapeDtypeStruct((K,), jnp.int32)), state.shard, idle)
    valid = group >= 0
    ok = stream.accept(got, valid) & valid
    put_group = jnp.where(valid, group, C)
    put_rows = jnp.where(jnp.repeat(valid, G), _group_rows(jnp.maximum(group, 0), G), G * C)
    return (scored.at[put_group].set(True, mode="drop"),
            accepted.at[put_group].set(ok, mode="drop"),
            rewards.at[put_rows].set(got, mode="drop"), errors + errs)

  scored, accepted, rewards, errors = jax.lax.cond(
      poll, collect, lambda carry: carry,
      (state.scored, state.accepted, state.rewards, state.errors))
  return state.replace(submitted=submitted, scored=scored, accepted=accepted, rewards=rewards,
                       errors=errors)
