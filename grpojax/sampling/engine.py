"""The rollout engine: G completions per prompt over a paged KV cache and S decode slots.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, S decode slots, M pages of p tokens, V vocabulary.

Reasoning completions are ragged: most rows stop early, a few run to T. The
lockstep sampler (sampler.py) keeps every row's slot and T-token buffer until
the longest row ends. Here a row holds a slot only while it decodes, and its
keys and values only the pages it has filled:

- The B prompts are prefilled once, together, and stored once (their G rows
  read the same keys). Each row's first token is drawn from that prefill.
- S slots decode one row each, in one `lax.while_loop` of static shapes. When
  a row ends (EOS or T tokens), its pages return to the pool and its slot
  takes the lowest-numbered pending row at the next step.
- A row takes a page of the pool when its next token starts one. Rows are
  admitted only while pages remain for every slot's next token. If running
  rows need more pages than are free, the highest-numbered rows are preempted:
  their pages are freed and they start again later from their first token.
- Attention (`ops.paged_attention`) reads the live keys once per step: the
  prompts with a decoding row, the full pages in use and each slot's page in
  progress, not the pool nor S x the longest row.

DAPO's dynamic sampling streams through the same loop (`stream_program`): the
candidate prompts of several batches are prefilled together and their rows
wait in one queue (the lowest first, so earlier groups always get the slots
first). Each group is scored on the host as its last row ends (by a callback the
loop waits on, or on host threads while it decodes: HostScorer), and the loop
stops once the first B accepted groups, in order, are known. The slots
that whole rounds leave idle while a batch's longest rows finish decode the
next batch's groups instead, and no batch is decoded past what is needed.

Row r's token t is drawn with key fold_in(fold_in(rng, r), t), whatever slot,
step or restart it is drawn in: the samples do not depend on S, M or the
order rows run in. `generate` (sampler.py) draws each step's tokens with one
key for all rows instead, so the two agree in distribution, and token for
token when greedy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import threading
import time
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from grpojax import ops
from grpojax.models import cache as cache_lib
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import contract, strategies
from grpojax.sampling.contract import SampleOutput

Array = jax.Array
PENDING, RUNNING, DONE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes of the engine (hashable: part of the jitted program's identity).

  slots: S rows decoded at once; 0 is all N rows.
  page_size: p tokens per page.
  pages: M pages in the pool, at most (and 0 is) enough for every slot at full
    length (S * ceil(T / p), no preemption). Fewer pages hold only live
    tokens (grpojax.plan.fit_pages sizes them to the memory budget); one row
    at full length must fit.
  tail_slots: the narrower widths the loop steps down to for a run's tail. Once
    no row is pending and at most n rows run (n the next width), the running
    slots are gathered into n slots and the loop goes on in a step over n: its
    draw, products and bookkeeping shrink with the slots, its weight reads do
    not (on an H200 at Qwen2.5-0.5B's shapes, one live row: 2.55 ms a step at
    S = 256, 1.61 at 16; bench/RESULTS.md). Each width is one more compiled
    loop body. None: S/4, S/16, ... while at least 16 (`tail`); (): never.
  """

  slots: int = 0
  page_size: int = 128
  pages: int = 0
  tail_slots: tuple[int, ...] | None = None

  def __post_init__(self):
    for key, why in (("slots", "must be >= 0 (0: every row at once)"),
                     ("pages", "must be >= 0 (0: enough for every slot at full length)"),
                     ("page_size", "must be >= 1 (tokens per KV page)")):
      if getattr(self, key) < (key == "page_size"):
        raise ValueError(f"EngineConfig.{key}={getattr(self, key)!r} {why}")
    if self.tail_slots is not None:
      if (not isinstance(self.tail_slots, tuple)
          or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.tail_slots)):
        raise ValueError(f"EngineConfig.tail_slots={self.tail_slots!r} must be automatic (None), "
                         "none (()) or slot counts >= 1 (a tuple)")

  def tail(self, slots: int) -> tuple[int, ...]:
    """The widths, widest first and each under S = slots, that a run's tail narrows to."""
    if self.tail_slots is None:
      widths, n = [], slots // 4
      while n >= 16:
        widths.append(n)
        n //= 4
      return tuple(widths)
    return tuple(sorted({n for n in self.tail_slots if n < slots}, reverse=True))

  def sizes(self, rows: int, max_new_tokens: int) -> tuple[int, int]:
    """(S, M) for N = rows and T = max_new_tokens; raises when M cannot hold one row."""
    S = min(self.slots or rows, rows)
    per_row = -(-max_new_tokens // self.page_size)
    M = min(self.pages, S * per_row) if self.pages else S * per_row
    if M < per_row:
      raise ValueError(f"EngineConfig.pages={self.pages} cannot hold one completion of "
                       f"{max_new_tokens} tokens in pages of {self.page_size}: give 0 (every "
                       f"slot at full length) or at least {per_row}")
    return S, M

  def per_shard(self, shards: int, max_new_tokens: int) -> EngineConfig:
    """Each of `shards` row shards' engine: its share of the slots and pages (rounded
    up), and at least one completion of max_new_tokens' pages."""
    share = lambda n: -(-n // shards)  # noqa: E731
    pages = self.pages and max(share(self.pages), -(-max_new_tokens // self.page_size))
    tail = None if self.tail_slots is None else tuple(share(n) for n in self.tail_slots)
    return dataclasses.replace(self, slots=share(self.slots), pages=pages, tail_slots=tail)


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


class HostScorer:
  """Scores the streaming engine's groups on host threads while it decodes (`Stream.host`).

  fn(example_ids [n], tokens [n, T], mask [n, T], valid [n] bool) -> (rewards
  [n, K] float32, errors [1, K] int32), numpy (HostRewards.score_rows): scores
  the valid rows of one hand-off, up to F groups of G rows. Hand-offs run on
  `threads` threads at once; the loop collects them as they finish, each row
  shard its own. `begin()` opens a run: what earlier runs handed off and never
  collected (groups past the ones needed) is dropped. An error fn raises is
  raised by the collect that meets it, inside the loop, as a synchronous
  scorer's would be. waited_s: the seconds the last run's loop waited for
  results with nothing left to decode.
  """

  def __init__(self, fn: Callable, *, threads: int = 4):
    self.fn = fn
    self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grpojax-score")
    self._lock = threading.Lock()
    self._jobs: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    self.waited_s = 0.0

  def __hash__(self):  # static in the program: by identity
    return id(self)

  def begin(self) -> None:
    with self._lock:
      self._jobs = collections.defaultdict(collections.deque)
      self.waited_s = 0.0

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def submit(self, shard, groups, example_ids, tokens, mask, valid) -> np.ndarray:
    """Host callback: groups [F] (-1: padding) and their rows' inputs, handed to a thread."""
    groups, valid = np.asarray(groups), np.asarray(valid, bool)
    job = self._pool.submit(self.fn, np.asarray(example_ids), np.asarray(tokens),
                            np.asarray(mask), valid)
    with self._lock:
      self._jobs[int(shard)].append((groups, job))
    return np.int32(0)

  def collect(self, shard, wait, *, F: int, rows: int, K: int):
    """Host callback: (groups [F] int32, -1 where none, rewards [rows, K], errors [K])
    of finished hand-offs, as many as fit in F groups. wait: the loop has nothing
    left to decode; block until one finishes (up to a second)."""
    with self._lock:
      pending = [job for _, job in self._jobs[int(shard)]]
    if bool(wait) and not pending:
      # The loop waits only on groups it handed off and has not had back.
      raise RuntimeError(f"HostScorer: row shard {int(shard)} waits on groups this scorer "
                         "does not hold (begin() called during a run?)")
    if bool(wait) and not any(job.done() for job in pending):
      start = time.perf_counter()
      concurrent.futures.wait(pending, timeout=1.0,
                              return_when=concurrent.futures.FIRST_COMPLETED)
      self.waited_s += time.perf_counter() - start
    groups = np.full((F,), -1, np.int32)
    rewards = np.full((rows, K), np.nan, np.float32)
    errors = np.zeros((K,), np.int32)
    G = rows // F
    n = 0
    with self._lock:
      left = collections.deque()
      for ids, job in self._jobs[int(shard)]:
        count = int(np.sum(ids >= 0))
        if not job.done() or n + count > F:
          left.append((ids, job))
          continue
        got, errs = job.result()  # raises what fn raised
        keep = np.flatnonzero(ids >= 0)
        groups[n:n + count] = ids[keep]
        rewards[n * G:(n + count) * G] = np.asarray(got, np.float32).reshape(F, G, K)[keep].reshape(
            -1, K)
        errors += np.asarray(errs, np.int32).reshape(-1)
        n += count
      self._jobs[int(shard)] = left
    return groups, rewards, errors


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


@flax.struct.dataclass
class EngineStats:
  """What a run of the engine did: steps [] decode steps, preempted [] rows restarted,
  pages_peak [] most pages held at once, keys_read [] keys (each with its value)
  one layer's attention read over all steps (ops.paged_keys_read), and
  live_keys [] the keys the decoded rows attended to (each row its prompt and
  its tokens so far; float32, as it can pass 2**31), tail_steps [] of the steps
  those taken narrowed (EngineConfig.tail_slots)."""

  steps: Array
  preempted: Array
  pages_peak: Array
  keys_read: Array
  live_keys: Array
  tail_steps: Array

  @classmethod
  def of_shards(cls, stats: EngineStats) -> EngineStats:
    """The stats of a run over row shards from theirs ([d] each): steps the most any
    took, pages_peak the sum of their peaks, the rest summed."""
    return cls(steps=jnp.max(stats.steps), preempted=jnp.sum(stats.preempted),
               pages_peak=jnp.sum(stats.pages_peak), keys_read=jnp.sum(stats.keys_read),
               live_keys=jnp.sum(stats.live_keys), tail_steps=jnp.max(stats.tail_steps))


@flax.struct.dataclass
class _State:
  tokens: Array  # [N, T] int32
  logps: Array  # [N, T] float32
  length: Array  # [N] int32 tokens drawn for the row
  status: Array  # [N] int32 PENDING / RUNNING / DONE
  eos: Array  # [N] bool: the row ended with an EOS
  cache: cache_lib.PagedCache
  stats: EngineStats
  # Streaming (Stream) only; C candidate groups, K rewards.
  scored: Array  # [C] bool
  submitted: Array  # [C] bool: handed to Stream.host
  accepted: Array  # [C] bool
  rewards: Array  # [N, K] float32
  errors: Array  # [K] int32


def generate(cfg: ModelConfig, weights, prompt_tokens: Array, prompt_mask: Array, *, rng: Array,
             num_samples: int, max_new_tokens: int, sampling: strategies.SamplingParams,
             eos_ids, pad_id: int, engine: EngineConfig = EngineConfig(), mesh=None,
             with_stats: bool = False, stop_at: Array | None = None):
  """`sampler.generate_from_params` through the engine; the same arguments and SampleOutput.

  Args as `sampler.generate_from_params`, plus engine: the slots and pool
  (EngineConfig). With with_stats, returns (SampleOutput, EngineStats).
  stop_at: a benchmark and test hook, [N] int32: row n draws eos_ids[0] as its
  token stop_at[n] - 1 (its own EOS may end it sooner).
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
            pad_id=int(pad_id), stop_at=stop_at)
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


@functools.partial(
    jax.jit, static_argnames=("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id",
                              "engine", "mesh"))
def sharded_program(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, mesh, sampling,
                    num_samples, max_new_tokens, eos, pad_id, engine: EngineConfig,
                    stop_at=None):
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

  def local(weights, tokens, mask, rng, stop_at):
    shard = 0
    for a in axes:
      shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
    out, stats = generate_program(
        cfg, weights, tokens, mask, rng, sampling=sampling, num_samples=num_samples,
        max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id, engine=local_engine,
        stop_at=stop_at, row_offset=shard * tokens.shape[0] * num_samples)
    return out, jax.tree.map(lambda x: x[None], stats)

  stop_spec = None if stop_at is None else rows
  out, stats = jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows, P(), stop_spec),
                             out_specs=(rows, rows), check_vma=False)(
                                 weights, prompt_tokens, prompt_mask, rng, stop_at)
  return out, EngineStats.of_shards(stats)


@functools.partial(
    jax.jit, static_argnames=("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id",
                              "engine", "stream", "mesh"))
def stream_program(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, example_ids, rng, *,
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
  shards = row_shards(mesh, B)
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
      shard = 0
      for a in axes:
        shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
      out, extra, stats = local(weights, tokens, mask, ids, stop, shard)
      return out, extra.replace(errors=extra.errors[None]), stats

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
  state = _run(cfg, weights, flat(tokens_RbP), flat(mask_RbP), keys_R, sampling=sampling,
               num_samples=G, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id,
               engine=engine, stop_at=None if stop_Rn is None else stop_Rn.reshape(-1),
               row_offset=row_offset, stream=stream, example_ids=flat(ids_Rb),
               rows_per_key=b * G, shard=shard)
  group = jnp.arange(C)
  rows_of = lambda x: x.reshape(C, G)  # noqa: E731
  touched = (state.scored | jnp.any(rows_of(state.length) > 1, axis=1)
             | jnp.any(rows_of(state.status) == RUNNING, axis=1))
  # The accepted groups first, in order; then the last batch's scored (unaccepted) ones.
  rank = jnp.where(state.accepted, group,
                   jnp.where(state.scored & (group >= C - b), C + group, 2 * C + group))
  chosen = jnp.argsort(rank)[:stream.groups]
  rows = (chosen[:, None] * G + jnp.arange(G)).reshape(-1)
  out = _output(state, pad_id, rows)
  by_batch = lambda x: x.reshape(R, -1, *x.shape[1:])  # noqa: E731
  extra = StreamOutput(
      prompt_tokens=flat(tokens_RbP)[chosen], prompt_mask=flat(mask_RbP)[chosen],
      example_ids=flat(ids_Rb)[chosen], rewards=state.rewards[rows],
      decoded=by_batch(touched), scored=by_batch(state.scored), accepted=by_batch(state.accepted),
      needed=by_batch(jnp.cumsum(state.accepted) - state.accepted < stream.groups),
      chosen=by_batch(jnp.zeros((C,), bool).at[chosen].set(True)),
      all_rewards=by_batch(state.rewards), all_lengths=by_batch(state.length),
      all_truncated=by_batch(~state.eos), errors=state.errors)
  return out, extra, state.stats


def row_keys(rng: Array, rows: Array, position: Array) -> Array:
  """The key that draws token `position` [N] of row `rows` [N]: independent of slots and steps.
  rng: one key, or [N] keys (a row's round's, in `stream_program`)."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if rng.ndim == (0 if typed else 1):
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(rows, position)
  return jax.vmap(lambda k, r, t: jax.random.fold_in(jax.random.fold_in(k, r), t))(
      rng, rows, position)


@functools.partial(
    jax.jit, static_argnames=("cfg", "sampling", "num_samples", "max_new_tokens", "eos", "pad_id",
                              "engine"))
def generate_program(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, sampling,
                     num_samples, max_new_tokens, eos, pad_id, engine: EngineConfig,
                     stop_at=None, row_offset=0):
  """The engine's jitted program: `generate` after its checks, returning (SampleOutput,
  EngineStats); eos a tuple, sampling SamplingParams. Public for lowering (grpojax.plan).
  row_offset: the number of the first row (a shard's, in `sharded_program`)."""
  state = _run(cfg, weights, prompt_tokens, prompt_mask, rng, sampling=sampling,
               num_samples=num_samples, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id,
               engine=engine, stop_at=stop_at, row_offset=row_offset)
  return _output(state, pad_id), state.stats


def _output(state: _State, pad_id: int, rows=None) -> SampleOutput:
  """The SampleOutput of `rows` [n] (default all) of a finished run."""
  pick = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731
  tokens, logps, length, eos = map(pick, (state.tokens, state.logps, state.length, state.eos))
  mask = (jnp.arange(tokens.shape[1])[None, :] < length[:, None]).astype(jnp.int32)
  return SampleOutput(tokens=jnp.where(mask > 0, tokens, pad_id), mask=mask,
                      logps=jnp.where(mask > 0, logps, 0.0), lengths=length, truncated=~eos)


def _run(cfg: ModelConfig, weights, prompt_tokens, prompt_mask, rng, *, sampling, num_samples,
         max_new_tokens, eos, pad_id, engine: EngineConfig, stop_at=None, row_offset=0,
         stream: Stream | None = None, example_ids=None, rows_per_key: int = 0,
         shard=0) -> _State:
  """The engine's loop over every row of the prompts [B, P]; its final _State.

  stream: DAPO's streaming (`stream_program`): each group is scored as its last
  row ends, and the loop stops once the first stream.groups accepted groups are
  known (or every group is scored). example_ids [B] are handed to stream.score
  (or stream.host, as row shard `shard`'s). rng: then [B*G / rows_per_key] keys:
  row r draws with rng[r // rows_per_key] as row r % rows_per_key (its round's key
  and row).
  """
  B, _ = prompt_tokens.shape
  G, T = num_samples, max_new_tokens
  N = B * G
  S, M = engine.sizes(N, T)
  p = engine.page_size
  eos_arr = jnp.asarray(eos, jnp.int32)
  rows = jnp.arange(N, dtype=jnp.int32)
  if stream is None:
    rng_of = lambda r, t: row_keys(rng, r + row_offset, t)  # noqa: E731  the rows' global keys
  else:
    rng_of = lambda r, t: row_keys(rng[r // rows_per_key], r % rows_per_key + row_offset, t)  # noqa: E731

  hidden, prefilled = transformer.prefill(cfg, weights, prompt_tokens, prompt_mask, group=G,
                                          max_new_tokens=1)
  heads = (cfg.kernels, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
  cache = cache_lib.PagedCache.after_prefill(
      prefilled, jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), slots=S, pages=M, page_size=p,
      prompt_multiple=ops.paged_prompt_multiple(*heads, p))
  weights = transformer.decode_params(cfg, weights)

  # Every row's first token, from its prompt's last hidden state (left padding ends it at P - 1).
  logits = jnp.repeat(transformer.unembed(cfg, weights, hidden[:, -1]), G, axis=0)
  tok, logp = strategies.sample_rows(rng_of(rows, jnp.zeros_like(rows)), logits, sampling)
  if stop_at is not None:
    tok = jnp.where(stop_at == 1, eos[0], tok)
  ended = jnp.isin(tok, eos_arr)
  K = stream.rewards if stream else 0
  state = _State(
      tokens=jnp.full((N, T), pad_id, jnp.int32).at[:, 0].set(tok),
      logps=jnp.zeros((N, T), jnp.float32).at[:, 0].set(logp),
      length=jnp.ones((N,), jnp.int32),
      status=jnp.where(ended | (T == 1), DONE, PENDING).astype(jnp.int32),
      eos=ended,
      cache=cache,
      stats=EngineStats(*(jnp.zeros((), jnp.int32) for _ in range(3)),
                        *(jnp.zeros((), jnp.float32) for _ in range(2)),
                        jnp.zeros((), jnp.int32)),
      scored=jnp.zeros((B,), bool),
      submitted=jnp.zeros((B,), bool),
      accepted=jnp.zeros((B,), bool),
      rewards=jnp.full((N, K), jnp.nan, jnp.float32),
      errors=jnp.zeros((K,), jnp.int32),
  )

  def body(state: _State) -> _State:
    if stream is not None and stream.host is None:
      state = _score(state, stream, example_ids, G)
    elif stream is not None:
      state = _hand_off(state, stream, example_ids, G, shard)
    state = _allocate(_admit(state, p), p)
    c = state.cache
    running = c.slot_row >= 0
    row = jnp.maximum(c.slot_row, 0)
    keys = sum(ops.paged_keys_read(
        *heads, slot_row=c.slot_row, slot_position=c.slot_position, group=G, full_pages=jnp.sum(c.page_full()),
        prompt_length=c.prompt_valid.shape[1], num_prompts=B, page_size=p, num_pages=M))
    live = jnp.sum(jnp.where(running, c.prompt_length[row // G] + c.slot_position + 1, 0))
    fed = jnp.take_along_axis(state.tokens[row], c.slot_position[:, None], axis=1)[:, 0]
    logits, c = transformer.paged_decode_step(cfg, weights, fed, c)
    t = c.slot_position + 1  # the position drawn now
    tok, logp = strategies.sample_rows(rng_of(row, t), logits, sampling)
    if stop_at is not None:
      tok = jnp.where(t + 1 == stop_at[row], eos[0], tok)
    put = jnp.where(running, c.slot_row, N)  # idle slots write nowhere
    ended = jnp.isin(tok, eos_arr)
    finished = running & (ended | (t + 1 == T))
    state = state.replace(
        tokens=state.tokens.at[put, t].set(tok, mode="drop"),
        logps=state.logps.at[put, t].set(logp, mode="drop"),
        length=state.length.at[put].set(t + 1, mode="drop"),
        status=state.status.at[jnp.where(finished, c.slot_row, N)].set(DONE, mode="drop"),
        eos=state.eos.at[put].set(ended, mode="drop"),
        cache=c.replace(slot_position=jnp.where(running, t, c.slot_position)),
        stats=state.stats.replace(steps=state.stats.steps + 1,
                                  keys_read=state.stats.keys_read + keys.astype(jnp.float32),
                                  live_keys=state.stats.live_keys + live.astype(jnp.float32)),
    )
    return _release(state, finished)

  def more(state: _State) -> Array:
    if stream is None:
      return jnp.any(state.status != DONE)
    return ~_stream_done(state, stream.groups)

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


def _fits(state: _State, slots: int) -> Array:
  """Whether `slots` slots can take the rest of the run: no row pending, at most that
  many running."""
  return ~jnp.any(state.status == PENDING) & (jnp.sum(state.cache.slot_row >= 0) <= slots)


def _score(state: _State, stream: Stream, example_ids: Array, G: int) -> _State:
  """Scores the groups whose rows have all ended, up to stream.groups of them (the
  rest at the next steps), through one host callback, only on the steps where one
  has ended."""
  B = state.scored.shape[0]
  F = stream.groups
  ended = jnp.all(state.status.reshape(B, G) == DONE, axis=1) & ~state.scored

  def score(carry):
    scored, accepted, rewards, errors = carry
    group, = jnp.nonzero(ended, size=F, fill_value=B)
    valid = group < B
    group = jnp.minimum(group, B - 1)
    rows = (group[:, None] * G + jnp.arange(G)).reshape(-1)
    T = state.tokens.shape[1]
    mask = (jnp.arange(T)[None, :] < state.length[rows][:, None]).astype(jnp.int32)
    got, errs, accept = stream.score(example_ids[group], state.tokens[rows], mask, valid)
    put_group = jnp.where(valid, group, B)
    put_rows = jnp.where(jnp.repeat(valid, G), rows, G * B)
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


def _hand_off(state: _State, stream: Stream, example_ids: Array, G: int, shard) -> _State:
  """Stream.host's side of a step: the groups whose rows have all ended go to the host
  (up to stream.groups a step, the rest at the next), and every stream.poll_every
  steps, or each step once nothing is left to decode, the finished ones come back
  and are accepted or not (stream.accept)."""
  B = state.scored.shape[0]
  F, K, host = stream.groups, stream.rewards, stream.host
  T = state.tokens.shape[1]
  ended = jnp.all(state.status.reshape(B, G) == DONE, axis=1) & ~state.submitted

  def submit(submitted):
    group, = jnp.nonzero(ended, size=F, fill_value=B)
    valid = group < B
    group = jnp.minimum(group, B - 1)
    rows = (group[:, None] * G + jnp.arange(G)).reshape(-1)
    mask = (jnp.arange(T)[None, :] < state.length[rows][:, None]).astype(jnp.int32)
    done = io_callback(host.submit, jax.ShapeDtypeStruct((), jnp.int32),
                       jnp.asarray(shard, jnp.int32),
                       jnp.where(valid, group, -1), jnp.repeat(example_ids[group], G),
                       state.tokens[rows], mask, jnp.repeat(valid, G))
    # Its (zero) result is used, so no compiler can drop the hand-off.
    return submitted.at[jnp.where(valid, group, B)].set(done == 0, mode="drop")

  submitted = jax.lax.cond(jnp.any(ended), submit, lambda x: x, state.submitted)
  waiting = jnp.any(submitted & ~state.scored)
  idle = ~jnp.any(state.cache.slot_row >= 0) & ~jnp.any(state.status == PENDING)
  poll = waiting & (idle | (state.stats.steps % stream.poll_every == 0))

  def collect(carry):
    scored, accepted, rewards, errors = carry
    group, got, errs = io_callback(
        functools.partial(host.collect, F=F, rows=F * G, K=K),
        (jax.ShapeDtypeStruct((F,), jnp.int32), jax.ShapeDtypeStruct((F * G, K), jnp.float32),
         jax.ShapeDtypeStruct((K,), jnp.int32)), jnp.asarray(shard, jnp.int32), idle)
    valid = group >= 0
    ok = stream.accept(got, valid) & valid
    put_group = jnp.where(valid, group, B)
    rows = (jnp.maximum(group, 0)[:, None] * G + jnp.arange(G)).reshape(-1)
    put_rows = jnp.where(jnp.repeat(valid, G), rows, G * B)
    return (scored.at[put_group].set(True, mode="drop"),
            accepted.at[put_group].set(ok, mode="drop"),
            rewards.at[put_rows].set(got, mode="drop"), errors + errs)

  scored, accepted, rewards, errors = jax.lax.cond(
      poll, collect, lambda carry: carry,
      (state.scored, state.accepted, state.rewards, state.errors))
  return state.replace(submitted=submitted, scored=scored, accepted=accepted, rewards=rewards,
                       errors=errors)


def _stream_done(state: _State, wanted: int) -> Array:
  """Whether the first `wanted` accepted groups are known: the shortest prefix of
  groups holding that many accepted ones is all scored; or every group is."""
  accepted = jnp.cumsum(state.accepted)
  unscored = jnp.cumsum(~state.scored)
  return jnp.any((accepted >= wanted) & (unscored == 0)) | (unscored[-1] == 0)


def _admit(state: _State, p: int) -> _State:
  """Idle slots take the lowest-numbered pending rows, as many as the free pages allow
  once every running slot has the page its next token may start."""
  c = state.cache
  S, N = c.slots, state.status.shape[0]
  idle = c.slot_row < 0
  pending = state.status == PENDING
  free = jnp.sum(c.page_owner < 0)
  needs = jnp.sum(_needs_page(state, p))
  allowed = jnp.clip(free - needs, 0, S)
  idle_rank = jnp.cumsum(idle) - 1
  pend_rank = jnp.cumsum(pending) - 1
  by_rank = jnp.full((S,), -1, jnp.int32).at[jnp.where(pending, pend_rank, S)].set(
      jnp.arange(N, dtype=jnp.int32), mode="drop")
  take = idle & (idle_rank < allowed)
  new = jnp.where(take, by_rank[jnp.clip(idle_rank, 0, S - 1)], -1)
  take = take & (new >= 0)
  slot_row = jnp.where(take, new, c.slot_row)
  return state.replace(
      status=state.status.at[jnp.where(take, new, N)].set(RUNNING, mode="drop"),
      length=state.length.at[jnp.where(take, new, N)].set(1, mode="drop"),
      cache=c.replace(slot_row=slot_row,
                      slot_position=jnp.where(take, 0, c.slot_position)))


def _needs_page(state: _State, p: int) -> Array:
  """[S] bool: running slots whose fed token starts a page."""
  c = state.cache
  return (c.slot_row >= 0) & (c.slot_position % p == 0)


def _allocate(state: _State, p: int) -> _State:
  """Gives each slot whose fed token starts a page a free page (the lowest-numbered
  first), preempting the highest-numbered rows when too few are free."""
  c = state.cache
  S, M = c.slots, c.num_pages
  running = c.slot_row >= 0
  need = _needs_page(state, p)
  free = jnp.sum(c.page_owner < 0)
  # Preemption: evict the j highest-numbered running rows, the smallest j that leaves
  # enough pages for the needs of the rest (j = all always does).
  held = jnp.where(running, -(-c.slot_position // p), 0)
  order = jnp.argsort(jnp.where(running, -c.slot_row, 1))  # highest rows first, idle last
  freed = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(held[order])])
  spared = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(need[order].astype(jnp.int32))])
  enough = free + freed >= jnp.sum(need) - spared
  evict = jnp.argmax(enough)  # the first j that suffices
  victim = jnp.zeros((S,), bool).at[order].set(jnp.arange(S) < evict) & running
  state = _release(state, victim, restart=True)
  c = state.cache
  need = need & ~victim
  # The i-th needing slot gets the i-th free page.
  rank = jnp.cumsum(need) - 1
  # Unrolled: the default method is a while loop that a GPU runs from the host, one
  # trip after another, log2(M) trips every step (bench/RESULTS.md, the H100 profile).
  page = jnp.searchsorted(jnp.cumsum(c.page_owner < 0), rank + 1, side="left",
                          method="scan_unrolled").astype(jnp.int32)
  page = jnp.where(need, page, M)
  in_use = jnp.sum(c.page_owner >= 0) + jnp.sum(need)
  return state.replace(
      cache=c.replace(
          page_owner=c.page_owner.at[page].set(jnp.arange(S, dtype=jnp.int32), mode="drop"),
          page_start=c.page_start.at[page].set(c.slot_position, mode="drop"),
          # A slot writes only its newest page: no page table is kept (reads go
          # by owner, releases by owner).
          slot_page=jnp.where(need, page, c.slot_page)),
      stats=state.stats.replace(
          preempted=state.stats.preempted + jnp.sum(victim),
          pages_peak=jnp.maximum(state.stats.pages_peak, in_use)))


def _release(state: _State, slots: Array, restart: bool = False) -> _State:
  """Frees the pages and slots of `slots` [S] bool; with restart, their rows are pending
  again (they will draw the same tokens, from the same keys)."""
  c = state.cache
  N = state.status.shape[0]
  owner_released = slots[jnp.maximum(c.page_owner, 0)] & (c.page_owner >= 0)
  if restart:
    status = state.status.at[jnp.where(slots, c.slot_row, N)].set(PENDING, mode="drop")
    state = state.replace(status=status,
                          eos=state.eos.at[jnp.where(slots, c.slot_row, N)].set(False, mode="drop"))
  return state.replace(
      cache=c.replace(page_owner=jnp.where(owner_released, -1, c.page_owner),
                      slot_row=jnp.where(slots, -1, c.slot_row),
                      slot_page=jnp.where(slots, c.num_pages, c.slot_page)))
