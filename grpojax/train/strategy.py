"""Rollout strategies: how a step's Rollout is drawn from the data, chosen once by name.

Axes: B prompts a step, G group size, N = B*G rows, P prompt length, R rounds
(batches a dynamic-sampling step may draw), K reward functions.

Every strategy has one signature, `strategy(state, source, rng) -> (Rollout,
metrics)`, and `strategy.lower(abstract_state, rng, prompt_length=P)` for the
planner. The loop, the planner and the API build one with `make(name, ...)`:

- plain: one batch, one rollout program.
- dynamic: DAPO's dynamic sampling in whole rounds (a rollout program a batch,
  the groups picked on the host between rounds).
- streaming: DAPO's dynamic sampling in one run of the paged engine: the
  rounds' rows in one queue, scored as each group ends, stopped once the
  groups needed are known; the prompts not reached go back to the source.
- carried: the paged engine's unfinished rows kept from one rollout to the
  next (rollout.max_staleness > 0): each rollout returns the first B groups
  complete and decodes on the rest after the update.

Research code registers its own (`register("mine")` on a RolloutStrategy
subclass) and names it in `rollout.strategy`.

A source serves the step's prompt batches: `next()` -> {prompt_tokens [B, P],
prompt_mask [B, P], example_ids [B]} placed on the devices, and `rewind(back,
used)`: serve again from prompt `used` of the batch `back` draws ago (1: the
last), dropping what followed it. PromptSource is the loop's, over its
PromptIterator; a plain dict is a source that serves that batch every time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from grpojax import registry
from grpojax.core import advantages as advantages_lib
from grpojax.models import sharding as sharding_lib
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import engine as engine_lib
from grpojax.sampling.engine import carry
from grpojax.train.rollout import (Rollout, RolloutConfig, assemble, engine_metrics,
                                   generate_in_chunks, rollout_metrics, trained_lengths, zero_std_groups)
from grpojax.train.state import TrainState

Array = jax.Array

STRATEGIES: registry.Registry[type] = registry.Registry("rollout.strategy")


def register(name: str, *, override: bool = False):
  """Class decorator: the RolloutStrategy subclass under `name` (rollout.strategy=name)."""
  def add(cls):
    STRATEGIES.register(name, cls, override=override)
    cls.name = name
    return cls
  return add


def choose(dynamic_sampling: bool, engine, max_staleness: int = 0) -> str:
  """The built-in strategy for a run: carried where rows may be carried between
  rollouts (max_staleness > 0), streaming where DAPO's dynamic sampling runs on the
  paged engine (engine an EngineConfig), dynamic on the lockstep sampler, else plain."""
  if max_staleness > 0:
    return "carried"
  if not dynamic_sampling:
    return "plain"
  return "dynamic" if engine is None else "streaming"


def make(name: str, config: RolloutConfig, host_rewards, *, num_prompts: int,
         max_rounds: int = 1, reward_weights=None, mesh=None, **options) -> RolloutStrategy:
  """The strategy registered as `name`, built for B = num_prompts prompts a step (at
  most max_rounds batches of them where it draws more); options are its own."""
  return STRATEGIES.get(name)(config, host_rewards, num_prompts=num_prompts,
                              max_rounds=max_rounds, reward_weights=reward_weights, mesh=mesh,
                              **options)


class PromptSource:
  """The loop's source: batches of a PromptIterator, placed on `mesh` (global arrays,
  rows over the batch axes); rewind goes back through the iterator's own positions."""

  def __init__(self, iterator, mesh, *, history: int = 64):
    self.iterator, self.mesh = iterator, mesh
    self._marks = collections.deque(maxlen=history)  # the position before each draw

  def next(self) -> dict:
    self._marks.append(self.iterator.state_dict())
    return mesh_lib.global_batch(self.iterator.next(), self.mesh)

  def rewind(self, back: int, used: int) -> None:
    if not 1 <= back <= len(self._marks):
      raise ValueError(f"rewind({back}, {used}): only the last {len(self._marks)} draws are kept")
    self.iterator.rewind(self._marks[-back], used)
    self._marks.clear()


class _Repeat:
  """A dict as a source: that batch at every draw; nothing to give back to."""

  def __init__(self, batch: Mapping):
    self.batch = batch

  def next(self) -> Mapping:
    return self.batch

  def rewind(self, back: int, used: int) -> None:
    pass


def as_source(source):
  """`source` if it serves batches (next, rewind), a dict as one that repeats it."""
  if isinstance(source, Mapping):
    return _Repeat(source)
  if not (callable(getattr(source, "next", None)) and callable(getattr(source, "rewind", None))):
    raise TypeError(f"a rollout source has next() and rewind(back, used), or is one batch "
                    f"(a dict); got {type(source).__name__}")
  return source


class _Unslotted:
  """A host_rewards other than a HostRewards (grpojax.plan's stand-in for a device this
  host lacks): called as it is, the slot dropped."""

  def __init__(self, host):
    self.host = host

  def __call__(self, *args, slot, **kw):
    del slot
    return self.host(*args, **kw)


class _Program:
  """A jitted program shared by the runs of the same settings (the builders below,
  lru_cache'd), called with this run's reward slot: the program compiles once a process,
  not once a run (its reward callback keeps it out of the persistent cache)."""

  def __init__(self, jitted, slot):
    self.jitted, self.slot = jitted, slot

  def __call__(self, *args, **kw):
    return self.jitted(*args, slot=self.slot, **kw)

  def lower(self, *args, **kw):
    return self.jitted.lower(*args, slot=self.slot, **kw)

  def _cache_size(self) -> int:
    return self.jitted._cache_size()  # pylint: disable=protected-access


def _weights(key):
  return None if key is None else jnp.asarray(key, jnp.float32)


@functools.lru_cache(maxsize=32)
def _rollout_program(config: RolloutConfig, rewards, mesh, weight_key, names):
  G = config.group_size

  @jax.jit
  def rollout(state: TrainState, batch: dict, rng: Array, slot: Array) -> tuple[Rollout, dict]:
    weights = _weights(weight_key)
    out, run_metrics = generate_in_chunks(config, state, batch["prompt_tokens"],
                                          batch["prompt_mask"], rng, mesh)
    example_ids = jnp.repeat(batch["example_ids"], G, axis=0)
    rewards_NK, errors_K = rewards(example_ids, out.tokens, out.mask, mesh=mesh,
                                   reward_params=state.reward_params, slot=slot)
    metrics = rollout_metrics(names, rewards_NK, errors_K, weights, G, trained_lengths(out),
                              out.truncated)
    metrics.update(run_metrics)
    return assemble(config, state, batch["prompt_tokens"], batch["prompt_mask"], out,
                    rewards_NK, weights), metrics

  return rollout


@functools.lru_cache(maxsize=32)
def _take_groups(G: int, mesh):
  @jax.jit
  def take_groups(kept: Rollout, new: Rollout, source_B: Array) -> Rollout:
    """Groups source_B of concatenate(kept, new): < B picks kept's, >= B new's."""
    rows = (source_B[:, None] * G + jnp.arange(G)).reshape(-1)

    def take(a, b):
      x = jnp.concatenate([a, b])[rows]
      # Rows stay split over the batch axes, as the update expects them.
      return x if mesh is None else jax.lax.with_sharding_constraint(
          x, mesh_lib.row_sharding(mesh, x.shape[0], x.ndim))

    return jax.tree.map(take, kept, new)

  return take_groups


class RolloutStrategy:
  """How a step's Rollout is drawn; subclasses register a name (`register`).

  config: RolloutConfig. host_rewards: grpojax.rewards.runtime.host.HostRewards
  (called from inside jit). num_prompts: B, the groups a Rollout holds.
  max_rounds: the batches a step may draw. reward_weights: [K] (default ones).
  mesh: rows over ("data", "fsdp"), each shard verified on its own host.
  """

  name = ""

  def __init__(self, config: RolloutConfig, host_rewards, *, num_prompts: int,
               max_rounds: int = 1, reward_weights=None, mesh=None):
    if not advantages_lib.needs_critic(config.estimator):  # unknown names fail here, not in a trace
      advantages_lib.get_advantage_fn(config.estimator)
    if num_prompts < 1 or max_rounds < 1:
      raise ValueError(f"num_prompts={num_prompts} and max_rounds={max_rounds} must be >= 1")
    self.config, self.host_rewards, self.mesh = config, host_rewards, mesh
    self.num_prompts, self.max_rounds = num_prompts, max_rounds
    self.weights = None if reward_weights is None else jnp.asarray(reward_weights, jnp.float32)
    # The weights as a static of the shared programs (float32 values, as self.weights').
    self._weight_key = (None if reward_weights is None else
                        tuple(np.asarray(reward_weights, np.float32).reshape(-1).tolist()))
    self.names = tuple(host_rewards.names)
    if hasattr(host_rewards, "on_device"):  # a HostRewards: programs shared across runs
      self._rewards, self._slot = host_rewards.on_device, np.int32(host_rewards.slot)
    else:
      self._rewards, self._slot = _Unslotted(host_rewards), np.int32(0)

  def _build(self, build, *key):
    """build(*key): programs shared with the runs of equal key where host_rewards is a
    HostRewards, else this run's own (a stand-in is keyed by identity: never shared)."""
    if isinstance(self._rewards, _Unslotted):
      return build.__wrapped__(*key)
    return build(*key)

  def __call__(self, state: TrainState, source, rng: Array) -> tuple[Rollout, dict]:
    raise NotImplementedError

  def lower(self, state: TrainState, rng, *, prompt_length: int):
    """The jitted program a step runs, lowered on abstract inputs (grpojax.plan)."""
    raise NotImplementedError

  def abstract_batch(self, prompt_length: int) -> dict:
    """A batch's shapes (and shardings on a mesh), as a source serves it."""
    B = self.num_prompts

    def spec(shape):
      sharding = None if self.mesh is None else mesh_lib.row_sharding(self.mesh, B, len(shape))
      return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    return {"prompt_tokens": spec((B, prompt_length)), "prompt_mask": spec((B, prompt_length)),
            "example_ids": spec((B,))}

  def rollout_program(self) -> _Program:
    """The jitted `(state, batch, rng) -> (Rollout, metrics)` of one batch: sample,
    score on the host, advantages, log-probs. The batch is a dict: prompt_tokens
    [B, P] (left-padded), prompt_mask [B, P], example_ids [B] (keys into the
    host-side dataset, for the verifiers)."""
    return _Program(self._build(_rollout_program, self.config, self._rewards, self.mesh,
                                self._weight_key, self.names), self._slot)


@register("plain")
class Plain(RolloutStrategy):
  """One batch a step through one rollout program."""

  def __init__(self, config, host_rewards, **kw):
    super().__init__(config, host_rewards, **kw)
    self.program = self.rollout_program()

  def __call__(self, state, source, rng):
    tools = getattr(self.config.hook, "host", None)
    if not hasattr(tools, "stats"):
      return self.program(state, as_source(source).next(), rng)
    tools.begin()  # a rollout's rows own their tools' state, from their first call
    rollout, metrics = self.program(state, as_source(source).next(), rng)
    jax.block_until_ready(rollout.tokens)  # every call of the rollout has run
    return rollout, {**metrics, **tools.stats(rollout.tokens.shape[0])}

  def lower(self, state, rng, *, prompt_length: int):
    return self.program.lower(state, self.abstract_batch(prompt_length), rng)


@register("dynamic")
class Dynamic(Plain):
  """DAPO's dynamic sampling in whole rounds.

  Draws a batch, keeps its groups whose rewards differ, and draws more batches
  until B such groups are collected or max_rounds batches were drawn; then fills
  the rest with the last batch's zero-std groups (zero advantage: they would only
  dilute the update). Every program keeps its static shape: the rollout program
  runs unchanged per round (round r with fold_in(rng, r), round 0 with rng
  itself: a batch with nothing to drop is exactly the plain rollout), the host
  picks groups between rounds, and one gather program moves the picked groups
  into a Rollout of B groups.

  Advantages are those computed in each group's own round: exact for per-group
  estimators (advantage.scale "group" or "none"), which config.validate demands.
  Metrics are the first round's (a fresh draw, comparable with the flag off) plus
  dynamic_sampling/rounds, /dropped_groups (zero-std groups left out) and
  /kept_zero_std (zero-std groups trained on because max_rounds ran out).
  """

  def __init__(self, config, host_rewards, **kw):
    super().__init__(config, host_rewards, **kw)
    self._warned = False
    self.take_groups = _take_groups(config.group_size, self.mesh)

  def __call__(self, state, source, rng):
    source = as_source(source)
    B, G = self.num_prompts, self.config.group_size
    put = (lambda x: x) if self.mesh is None else (
        lambda x: sharding_lib.put(x, mesh_lib.replicated(self.mesh)))
    kept, filled, dropped, kept_zero = None, 0, 0, 0
    for r in range(self.max_rounds):
      new, new_metrics = self.program(state, source.next(),
                                      rng if r == 0 else jax.random.fold_in(rng, r))
      if r == 0:
        kept, metrics = new, new_metrics
      zero = sharding_lib.to_host(new.zero_std)[::G]  # a group's rows agree
      need = B - filled
      picked = np.flatnonzero(~zero)[:need]
      if r == self.max_rounds - 1 and len(picked) < need:
        # Out of rounds: zero-std groups fill the batch rather than change its shape.
        kept_zero = need - len(picked)
        picked = np.concatenate([picked, np.flatnonzero(zero)[:kept_zero]])
        self._warn(kept_zero)
      dropped += int(zero.sum()) - kept_zero
      # Slots past filled + len(picked) are placeholders, overwritten by later rounds.
      source_B = np.arange(B, dtype=np.int32)
      source_B[filled:filled + len(picked)] = B + picked
      kept = self.take_groups(kept, new, put(source_B))
      filled += len(picked)
      if filled == B:
        break
    metrics = dict(metrics)
    metrics.update({"dynamic_sampling/rounds": r + 1, "dynamic_sampling/dropped_groups": dropped,
                    "dynamic_sampling/kept_zero_std": kept_zero})
    return kept, metrics

  def _warn(self, kept_zero: int) -> None:
    if not self._warned:  # once per run; the metric counts every step
      self._warned = True
      logging.warning("dynamic sampling: %d of %d groups still have zero reward std after "
                      "%d rounds (rollout.dynamic_sampling_max_rounds); training on them "
                      "(metric dynamic_sampling/kept_zero_std)", kept_zero, self.num_prompts,
                      self.max_rounds)


@register("streaming")
class Streaming(Dynamic):
  """DAPO's dynamic sampling through the paged engine (config.engine), in one run.

  The groups `dynamic` picks, from one engine run instead of up to R: R batches
  are drawn and prefilled together, the engine decodes their rows as one queue
  (earlier groups first), scores each group on the host as its last row ends, and
  stops once the first B accepted groups are known (`engine.stream_program`).
  Without a mesh that splits the prompts the rows, rewards and advantages are
  token for token those of `dynamic` over the same engine; on one, each row
  shard collects its own share of the groups from its share of every batch.

  The prompts past every shard's B-th accepted group go back to the source
  (`rewind`: served again next step, whether or not the engine began them): the
  data gives up what whole rounds' groups would have been picked from, and no
  more. Metrics are the first batch's (all of its groups are always decoded)
  plus dynamic_sampling/rounds (batches reached), /dropped_groups (zero-std
  groups passed over), /kept_zero_std, /decoded_groups (begun),
  /surplus_groups (begun past the groups needed: the decoding the free slots
  bought, their prompts given back) and /skipped_prompts (consumed, not needed:
  where shards went different distances), and the run's engine/*.

  overlap: the groups are verified on host threads while the engine decodes
  (engine.HostScorer), and dynamic_sampling/scoring_wait_s says how long the loop
  waited for them with nothing left to decode. Else the loop waits for each
  group's verification as it ends. The groups, rows and advantages are the same;
  the decoded and surplus counts depend on the verifiers' timing.
  """

  def __init__(self, config, host_rewards, *, overlap: bool = True, **kw):
    if config.engine is None:
      raise ValueError("streaming dynamic sampling runs on the rollout engine: "
                       "rollout.engine='paged'")
    if config.hook is not None:
      raise ValueError("streaming runs the engine with its own hook (StreamHook); "
                       "RolloutConfig.hook cannot run beside it yet")
    if getattr(host_rewards, "models", None):
      raise ValueError("rewards.models score in the rollout program, and the streaming strategy "
                       "scores each group as it ends, outside it: set rollout.strategy=dynamic "
                       "(a batch at a time) for dynamic sampling with reward models")
    super().__init__(config, host_rewards, **kw)
    B, G, mesh, weights = self.num_prompts, config.group_size, self.mesh, self.weights
    shards = engine_lib.row_shards(mesh, B)
    names, host = self.names, host_rewards

    def accept(rewards_NK, valid):
      return valid & ~zero_std_groups(advantages_lib.combine_rewards(rewards_NK, weights), G)

    def score(ids_F, tokens, mask, valid):
      rewards_NK, errors_K = host(jnp.repeat(ids_F, G), tokens, mask, valid=jnp.repeat(valid, G))
      return rewards_NK, errors_K, accept(rewards_NK, valid)

    self.scorer = engine_lib.HostScorer(host.score_rows) if overlap else None
    if overlap:
      stream = engine_lib.Stream(groups=B // shards, rewards=len(names), host=self.scorer,
                                 accept=accept)
    else:
      stream = engine_lib.Stream(score=score, groups=B // shards, rewards=len(names))

    @jax.jit
    def program(state: TrainState, prompts, masks, ids, rng):
      # stream_program's shard_map places each row shard's prompts itself.
      out, extra, stats = engine_lib.stream_program(
          state.model_config, state.model_params, prompts, masks, ids, rng,
          sampling=config.sampling, num_samples=G, max_new_tokens=config.max_new_tokens,
          eos=tuple(config.eos_ids), pad_id=config.pad_id, engine=config.engine, stream=stream,
          mesh=mesh)
      first = lambda x: x[0]  # noqa: E731  the first batch's rows
      metrics = rollout_metrics(names, first(extra.all_rewards), extra.errors, weights, G,
                                first(extra.all_lengths), first(extra.all_truncated))
      metrics.update(engine_metrics(stats))
      rollout = assemble(config, state, extra.prompt_tokens, extra.prompt_mask, out,
                         extra.rewards, weights)
      return rollout, metrics, (extra.decoded, extra.accepted, extra.needed, extra.chosen)

    @jax.jit
    def stack(batches):
      """[R, B, P] of R batches padded on the left to the widest."""
      width = max(b["prompt_tokens"].shape[1] for b in batches)
      pad = lambda x, v: jnp.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=v)  # noqa: E731
      return (jnp.stack([pad(b["prompt_tokens"], config.pad_id) for b in batches]),
              jnp.stack([pad(b["prompt_mask"], 0) for b in batches]),
              jnp.stack([b["example_ids"] for b in batches]))

    self.stream_program, self._stack = program, stack

  def __call__(self, state, source, rng):
    source = as_source(source)
    B, R = self.num_prompts, self.max_rounds
    batches = [source.next() for _ in range(R)]
    if self.scorer is not None:
      self.scorer.begin()
    rollout, metrics, flags = self.stream_program(state, *self._stack(batches), rng)
    begun, accepted, needed, chosen = (np.asarray(sharding_lib.to_host(x)).reshape(-1)
                                       for x in flags)
    reached = int(np.flatnonzero(needed)[-1]) + 1  # through the furthest shard's last need
    if reached < R * B:  # the prompts the data gives up: through `reached`
      batch, used = divmod(reached, B)
      source.rewind(R - batch, used)
    kept_zero = int(np.sum(chosen & ~accepted))
    if kept_zero:
      self._warn(kept_zero)
    metrics = dict(metrics)
    metrics.update({
        "dynamic_sampling/rounds": -(-reached // B),
        "dynamic_sampling/dropped_groups": int(np.sum(needed & ~accepted)) - kept_zero,
        "dynamic_sampling/kept_zero_std": kept_zero,
        "dynamic_sampling/decoded_groups": int(begun.sum()),
        "dynamic_sampling/surplus_groups": int(np.sum(begun & ~needed)),
        "dynamic_sampling/skipped_prompts": int(np.sum(~needed[:reached]))})
    if self.scorer is not None:
      metrics["dynamic_sampling/scoring_wait_s"] = self.scorer.waited_s
    return rollout, metrics

  def lower(self, state, rng, *, prompt_length: int):
    """The streaming program over R batches [R, B, P], each split as a batch is."""
    def rounds(x):
      sharding = None if x.sharding is None else jax.sharding.NamedSharding(
          x.sharding.mesh, jax.sharding.PartitionSpec(None, *x.sharding.spec))
      return jax.ShapeDtypeStruct((self.max_rounds, *x.shape), x.dtype, sharding=sharding)

    batch = self.abstract_batch(prompt_length)
    return self.stream_program.lower(
        state, *(rounds(batch[k]) for k in ("prompt_tokens", "prompt_mask", "example_ids")), rng)


@functools.lru_cache(maxsize=32)
def _carried_programs(config: RolloutConfig, B: int, shards: int, rewards, mesh, weight_key,
                      names):
  """Carried's (program, first, kept_shape) for B prompts a step, shared by equal settings."""
  G, T = config.group_size, config.max_new_tokens
  engine = dataclasses.replace(config.engine, slots=config.engine.slots or B * G)

  kw = dict(sampling=config.sampling, num_samples=G, max_new_tokens=T,
            eos=tuple(config.eos_ids), pad_id=config.pad_id, engine=engine, groups=B,
            max_staleness=config.max_staleness, restart=config.partial == "restart")

  def run(state: TrainState, pool, batch: dict, rng: Array, width: int):
    """(SampleOutput, returned Pool, what is carried next, EngineStats, CarryStats)."""
    version = state.step.astype(jnp.int32)
    cfg, params = state.model_config, state.model_params
    if isinstance(pool, carry.Kept):  # "keep": the engine goes on where it stopped
      kept = carry.kept_with(pool, batch["prompt_tokens"], batch["prompt_mask"],
                             batch["example_ids"], rng)
      return carry.keep_program(cfg, params, kept, version, width=width,
                                fresh_from=kept.prompt_tokens.shape[0] - B, **kw)
    new = carry.fresh(batch["prompt_tokens"], batch["prompt_mask"], batch["example_ids"], rng,
                      num_samples=G, max_new_tokens=T, pad_id=config.pad_id)
    if shards > 1:
      return carry.resume_sharded(cfg, params, pool, new, version, mesh=mesh, width=width,
                                  **kw)
    pool = new if pool is None else carry.join(pool, new)
    go = carry.keep_start if config.partial == "keep" else carry.resume_program
    return go(cfg, params, pool, version, width=width, **kw)

  def kept_shape(state: TrainState, groups: int, prompt_length: int):
    """The Kept a "keep" run carries for `groups` groups of prompts that long."""
    tokens = jax.ShapeDtypeStruct((groups, prompt_length), jnp.int32)
    pool = jax.eval_shape(lambda t, k: carry.fresh(t, t, t[:, 0], k, num_samples=G,
                                                   max_new_tokens=T, pad_id=config.pad_id),
                          tokens, jax.eval_shape(lambda: jax.random.key(0)))
    return jax.eval_shape(lambda s, p: carry.keep_start(
        s.model_config, s.model_params, p, s.step.astype(jnp.int32), **kw)[2], state, pool)

  @functools.partial(jax.jit, static_argnames=("width",))
  def program(state: TrainState, pool, batch: dict, rng: Array, slot: Array, width: int):
    weights = _weights(weight_key)
    version = state.step.astype(jnp.int32)
    out, got, kept, engine_stats, stats = run(state, pool, batch, rng, width)
    rewards_NK, errors_K = rewards(jnp.repeat(got.example_ids, G), out.tokens, out.mask,
                                   mesh=mesh, reward_params=state.reward_params, slot=slot)
    metrics = rollout_metrics(names, rewards_NK, errors_K, weights, G, trained_lengths(out),
                              out.truncated)
    metrics.update(engine_metrics(engine_stats))
    metrics.update(carry.staleness_metrics(got.versions, out.mask, version,
                                           config.max_staleness))
    metrics.update(carry.stats_metrics(stats, engine_stats, trained_lengths(out)))
    rollout = assemble(config, state, got.prompt_tokens, got.prompt_mask, out, rewards_NK,
                       weights)
    longest = (jnp.zeros((), jnp.int32) if isinstance(kept, carry.Kept) else
               jnp.max(jnp.where(kept.ended, 0, kept.length), initial=0))
    return rollout, metrics, kept, longest

  @jax.jit
  def first(batches, rng):
    """The pool of the carried batches a run starts with (nothing drawn yet)."""
    pools = [carry.fresh(b["prompt_tokens"], b["prompt_mask"], b["example_ids"],
                         jax.random.fold_in(rng, i + 1), num_samples=G, max_new_tokens=T,
                         pad_id=config.pad_id) for i, b in enumerate(batches)]
    return functools.reduce(carry.join, pools)

  return program, first, kept_shape


@register("carried")
class Carried(RolloutStrategy):
  """Rollouts that never drain to their longest row (config.max_staleness > 0).

  The engine holds the rows of config.carried_batches + 1 batches. A rollout adds
  one new batch behind the carried groups, decodes until B groups have all their
  rows ended, returns the first B complete (oldest first) and keeps the rest for
  the next rollout (`engine.carry`): they decode on under the weights the update
  makes, their tokens so far recomputed (config.partial "recompute") or thrown
  away ("restart"), and a row whose first token is more than max_staleness
  versions old starts again. Each token keeps its behaviour log-prob (the
  version's that drew it): Rollout.sampler_logps, what loss.decoupled weighs by.

  On a mesh whose batch axes split the prompts each row shard carries its own rows
  and returns its share of the B groups (carry.resume_sharded; not with "keep").
  The first rollout draws carried_batches + 1 batches. With carried_batches=0 no
  row is kept, and a rollout is "plain"'s, token for token. The slots default to
  B*G (one batch's rows), so that the carried rows wait for them.
  Metrics beside plain's: carry/* (engine.carry: staleness, restarted, wasted
  and carried rows, slot occupancy, generated against trained lengths) and
  carry/prefill_width, the prompt and prefix width every pool row was prefilled at.
  `state_dict` / `load_state_dict`: the carried rows, for exact resumes; `undo`
  puts back the rows before the last rollout (a step not applied).
  """

  def __init__(self, config, host_rewards, **kw):
    if config.engine is None:
      raise ValueError("carried rollouts run on the rollout engine: rollout.engine='paged'")
    if config.hook is not None or config.generation_chunks != 1:
      raise ValueError("carried rollouts take no RolloutConfig.hook and one generation chunk")
    super().__init__(config, host_rewards, **kw)
    B = self.num_prompts
    shards = engine_lib.row_shards(self.mesh, B)
    if jax.process_count() > 1:
      raise ValueError("carried rollouts run in one process: the carried rows are saved "
                       "from this host (rollout.max_staleness=0 across several)")
    if shards > 1 and config.partial == "keep":
      raise ValueError("rollout.partial='keep' carries one engine's pages: a mesh whose batch "
                       "axes split the prompts runs one engine a shard (use 'recompute')")
    self.pool, self._before, self.width = None, None, 0
    program, self._first, self._kept_shape = self._build(
        _carried_programs, config, B, shards, self._rewards, self.mesh, self._weight_key,
        self.names)
    self.program = _Program(program, self._slot)
    self._saved = None  # a "keep" run's carried state, restored at its first rollout
    self._longest = None  # the last rollout's longest carried row: read at the next one

  def _settle(self) -> None:
    """The prefix width the carried rows need, from the last rollout's longest row: read
    when it is needed, not when that rollout is dispatched, so that a rollout waits on
    nothing (the rollout beside the update runs while its caller dispatches the update)."""
    if self._longest is not None:
      self.width = carry.prefix_width(int(self._longest), self.config.max_new_tokens)
      self._longest = None

  def __call__(self, state, source, rng):
    source = as_source(source)
    extra = self.config.carried_batches
    if self._saved is not None:
      self.pool, self._saved = self._restore_kept(state, self._saved), None
    self._settle()
    before = (self.pool, self.width)  # what a step not applied leaves: its draws undone too
    if self.pool is None and extra:
      self.pool = self._first([source.next() for _ in range(extra)], rng)
      # The narrowest width the carried rows will need: the program the next steps run
      # ("keep" prefills no prefix).
      self.width = carry.prefix_width(self.config.partial != "keep",
                                      self.config.max_new_tokens)
    rollout, metrics, kept, longest = self.program(state, self.pool, source.next(), rng,
                                                   width=self.width)
    # The prompt width every pool row was prefilled at: the recompute's cost.
    metrics = {**metrics, "carry/prefill_width": rollout.prompt_tokens.shape[1] + self.width}
    self._before = before
    self.pool = kept if extra or isinstance(kept, carry.Kept) else None
    self._longest = longest
    return rollout, metrics

  def undo(self) -> None:
    """Puts back the carried rows from before the last rollout (its step was not applied)."""
    if self._before is not None:
      (self.pool, self.width), self._longest = self._before, None
      self._before = None

  def state_dict(self) -> dict:
    """The carried rows as host arrays ({} before the first rollout); for "keep", the
    engine's whole state, its pages included (their keys and values are the old
    weights': recomputing them would not resume exactly)."""
    self._settle()
    if self.pool is None:
      return {}
    pool = self.pool.replace(keys=jax.random.key_data(self.pool.keys))
    if isinstance(pool, carry.Kept):
      out = {f"kept_{i:04d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(pool))
             if x.size}  # (orbax saves no empty array: they come back from the shapes)
      out["kept_shape"] = np.asarray(pool.prompt_tokens.shape, np.int32)
      return out
    out = {f.name: np.asarray(getattr(pool, f.name)) for f in dataclasses.fields(pool)}
    out["width"] = np.asarray(self.width, np.int32)
    return out

  def _restore_kept(self, state, saved: dict):
    shape = self._kept_shape(state, *(int(n) for n in saved["kept_shape"]))
    leaves = [jnp.asarray(saved[f"kept_{i:04d}"]) if x.size else jnp.zeros(x.shape, x.dtype)
              for i, x in enumerate(jax.tree.leaves(shape))]
    kept = jax.tree.unflatten(jax.tree.structure(shape), leaves)
    return kept.replace(keys=jax.random.wrap_key_data(kept.keys))

  def load_state_dict(self, saved: Mapping) -> None:
    """Carries the rows of `state_dict` into the next rollout."""
    self._saved = self._longest = None
    if not saved:
      self.pool, self.width = None, 0
      return
    saved = dict(saved)
    if "kept_shape" in saved:  # rebuilt at the next rollout, which knows the model
      self.pool, self.width, self._saved = None, 0, saved
      return
    self.width = int(saved.pop("width"))
    fields = {k: jnp.asarray(v) for k, v in saved.items()}
    fields["keys"] = jax.random.wrap_key_data(fields["keys"])
    self.pool = carry.Pool(**fields)

  def lower(self, state, rng, *, prompt_length: int):
    """The rollout program with its carried pool, at the widest prefix (T - 1); for
    "keep", with the engine's state carried whole."""
    batch = self.abstract_batch(prompt_length)
    if self.config.partial == "keep":
      kept = self._kept_shape(state, (self.config.carried_batches + 1) * self.num_prompts,
                              prompt_length)
      return self.program.lower(state, kept, batch, rng, width=0)
    pool = None
    if self.config.carried_batches:
      pool = jax.eval_shape(self._first, [batch] * self.config.carried_batches, rng)
    return self.program.lower(state, pool, batch, rng,
                              width=max(self.config.max_new_tokens - 1, 0))
