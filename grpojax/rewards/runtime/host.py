"""The bridge from jitted code to the verifiers: a host callback per device.

Inside jit, `HostRewards.__call__(example_ids, tokens, mask, mesh=...)`
wraps `jax.experimental.io_callback` in `shard_map`, so every device hands only
its own rows to its own host. An io_callback, not a pure one: the reward
functions are impure (they log, time out, run workers and sandboxes), and XLA
may drop, repeat or reorder a pure callback. Unordered: the rows' rewards
depend on nothing but their rows, and an ordered effect does not lower inside
shard_map over several devices. On the host the callback decodes the completions,
looks up each example's columns (gold answer, tests, ...), runs the reward
functions in a persistent `RewardPool`, and returns rewards `[rows, K]`
(NaN where a function gave None, failed or timed out) and error counts `[K]`.
Rows that returned TIMED_OUT are counted on the host instead (`take_timeouts`,
read by the loop after each rollout as rewards/<name>/timeouts): the errors'
path through the jitted rollout and the streaming engine stays as it is.

The callback is a module-level function that finds its HostRewards by `slot`, an
int32 the program takes as an argument (`DeviceRewards`): a program compiled once
serves every HostRewards of the same shape, each run its own functions, so a
process's later runs (the tests' many, a resumed run) reuse it. A program with a
host callback never goes to the persistent compilation cache: without this each
run would compile its rollout again.

Axes: N rows (B prompts × G completions), T completion tokens, K functions.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from grpojax.parallel import mesh as mesh_lib
from grpojax.rewards.base import (MAX_ERROR_FRACTION, RewardFunctionError, RewardOutput,
                                  TrainerState, build_kwargs, check_errors, unique_names,
                                  validate_weights, warn_once)
from grpojax.rewards.runtime.inprocess import InProcessRunner
from grpojax.rewards.runtime.pool import RewardPool


class _ReportedByTheRun(logging.Filter):
  """JAX logs a failing callback's traceback before raising it through the program; a
  reward function's failure is the run's to report, in one line (HostRewards.error)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], RewardFunctionError))


logging.getLogger("jax._src.callback").addFilter(_ReportedByTheRun())


# The live HostRewards by slot. Weak: a HostRewards nobody holds (closed or not) is
# released with its functions and data; a program compiled for it holds only its slot.
_LIVE: weakref.WeakValueDictionary[int, HostRewards] = weakref.WeakValueDictionary()
_SLOTS = itertools.count()


def _at(slot) -> HostRewards:
  host = _LIVE.get(int(slot))
  if host is None:
    raise RuntimeError(f"a reward callback ran for HostRewards slot {int(slot)}, which was "
                       "closed: its run ended before the program that scores for it")
  return host


def _callback_at(slot, *args):
  return _at(slot)._callback(*args)


def _valid_callback_at(slot, *args):
  return _at(slot)._valid_callback(*args)


def _shard_map(fn, mesh, in_specs, out_specs):
  """shard_map across JAX versions (jax.shard_map is the stable home since 0.6)."""
  if hasattr(jax, "shard_map"):
    # Callback outputs differ per device by design: skip the replication check.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
  from jax.experimental.shard_map import shard_map  # older JAX
  return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


class HostRewards:
  """Runs reward functions on the host for completions produced on device.

  Args:
    reward_fns: K TRL-style reward functions.
    decode: `decode(list of token-id lists) -> list of str`.
    lookup: `lookup(example_id) -> dict of columns` for one example; the
      `prompt_column` value becomes `prompts`, every other column is passed
      by name (TRL's `**kwargs`).
    weights: K weights for the device-side combination (default ones).
    num_workers: worker processes (default: the core count, at most 8); 0
      runs the functions in this process under a watchdog (prints and pdb
      work, closures need no pickling; see rewards/runtime/inprocess.py for
      what a thread cannot guard against).
    row_timeout_s: see RewardPool; applies in-process too.
    max_error_fraction: a function failing on more of a call's rows than
      this stops the run with an error naming it (None: never).
    row_columns: `row_columns(rows [n]) -> {column: n values}`, columns of the
      rollout's rows (their indices in it; -1 for rows of none: the probe) rather than
      its examples (grpojax.tools.Environments.columns: each row's environment
      instance as `environments`); training rollouts only.
    conversation: `conversation(row, completion_ids) -> messages or None`, a tool-using
      row's completion as the chat messages TRL hands conversational reward functions
      (grpojax.tools.ToolRunner.conversation; None: one assistant message, as without
      tools); training rollouts only (eval passes them to `score`).
    models: M reward models (grpojax.models.reward.RewardModel), after the functions:
      the callback renders and tokenizes their inputs, and `__call__` scores them on the
      device with `reward_params`, as columns K .. K+M-1 (names and weights include
      them; the functions alone may be none).
  """

  def __init__(self, reward_fns: Sequence[Callable], *,
               decode: Callable[[list[list[int]]], list[str]],
               lookup: Callable[[int], Mapping], weights: Sequence[float] | None = None,
               num_workers: int | None = None, row_timeout_s: float = 30.0,
               chunk_rows: int | None = None, prompt_column: str = "prompt",
               max_error_fraction: float | None = MAX_ERROR_FRACTION,
               row_columns: Callable[[np.ndarray], Mapping] | None = None,
               conversation: Callable[[int, list[int]], list | None] | None = None,
               models: Sequence = ()):
    if not reward_fns and not models:
      raise ValueError("HostRewards needs at least one reward function or reward model")
    self.fns, self.models = list(reward_fns), list(models)
    self.names = unique_names([*self.fns, *self.models])
    self.fn_names = self.names[:len(self.fns)]  # the host's own columns
    self.weights = validate_weights([*self.fns, *self.models], weights)
    self.decode, self.lookup, self.prompt_column = decode, lookup, prompt_column
    self.max_error_fraction, self.row_columns = max_error_fraction, row_columns
    self.conversation = conversation
    self.seconds = 0.0  # host time spent scoring, summed over calls
    # Each worker imports grpojax (and so JAX): cap the default on big hosts.
    workers = min(os.cpu_count() or 1, 8) if num_workers is None else num_workers
    self.pool = (RewardPool(self.fns, num_workers=workers, row_timeout_s=row_timeout_s,
                            chunk_rows=chunk_rows) if workers > 0 and self.fns else
                 InProcessRunner(self.fns, row_timeout_s=row_timeout_s))
    self._warned: set = set()
    # Every compute() call's rows since the caller last cleared it (a rollout's
    # callback runs once per device shard), for logging sample completions.
    self.recent: list[dict] = []
    # Passed to the reward functions as `trainer_state` (TRL's): the loop moves it on
    # each step. None: not passed.
    self.trainer_state: TrainerState | None = None
    # log_metric's values of training batches since take_logged_metrics.
    self.logged_metrics: dict[str, list[float]] = {}
    # Rows of training batches that returned TIMED_OUT, per function, since
    # take_timeouts; a call begun before the last take is left out (see there).
    self._timeouts = np.zeros(len(self.fns), np.int64)
    self._taken = 0  # how many times take_timeouts ran
    self.error: RewardFunctionError | None = None  # the one a callback raised
    self._logged_lock = threading.Lock()
    self.slot = next(_SLOTS)  # how a program's callback finds this one (DeviceRewards)
    _LIVE[self.slot] = self

  def close(self):
    _LIVE.pop(self.slot, None)
    self.pool.close()

  def interrupt(self):
    """SIGTERM: reward calls in flight end within seconds, their rows NaN. Safe
    from any thread (the trainer's signal watcher calls it while jit waits)."""
    self.pool.interrupt()

  @property
  def interrupted(self) -> bool:
    """Whether interrupt() cut some call short: that batch's rewards are incomplete."""
    return self.pool.interrupted

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------- host side

  def _columns(self, example_ids: np.ndarray) -> tuple[list, dict]:
    # Groups repeat an id G times: look each example up once.
    examples = {i: dict(self.lookup(i)) for i in dict.fromkeys(example_ids.tolist())}
    return self._split(examples[i] for i in example_ids.tolist())

  def _split(self, rows) -> tuple[list, dict]:
    """(prompts, {column: values}) of rows: the prompt column apart, every other by name."""
    rows = list(rows)
    keys = dict.fromkeys(k for r in rows for k in r if k != self.prompt_column)
    return [r.get(self.prompt_column) for r in rows], {k: [r.get(k) for r in rows] for k in keys}

  def score(self, rows: Sequence[Mapping], completions: Sequence[str],
            completion_ids: Sequence[Sequence[int]], functions: Sequence[int] = (0,),
            conversations: Sequence[list | None] | None = None) -> np.ndarray:
    """Rewards [n, K] of completions of the given rows, through the same workers.

    For held-out evaluation: rows are passed whole (not looked up by id; their
    prompt column holds the formatted prompt), only `functions` are called
    (default: the first, the task's verifier; the other columns are NaN), a
    failing or interrupted call is NaN (no error threshold), and the time is
    not counted in `seconds` (the training reward time). conversations: per row, the
    tool-using completion's messages (`conversation`'s) or None.
    """
    prompts, columns = self._split(rows)
    kwargs = build_kwargs(prompts, trl_completions(prompts, completions, conversations), columns,
                          completion_ids, self.trainer_state)
    rewards, *_ = self.pool.run(kwargs, len(rows), functions)  # TIMED_OUT: NaN, not right
    return rewards

  def compute(self, example_ids, tokens, mask=None, rows=None) -> RewardOutput:
    """Host-side rewards for numpy inputs.

    example_ids: [N] ints; tokens: [N, T] completion tokens; mask: [N, T]
    (1 = real token; None: all real); rows: [N] their rows in the rollout (row_columns').
    """
    ids = np.asarray(example_ids).reshape(-1)
    taken = self._taken  # which step's count this call's timeouts go to
    tokens = np.asarray(tokens)
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    completion_ids = [row[m].tolist() for row, m in zip(tokens, mask)]
    completions = list(self.decode(completion_ids))
    prompts, columns = self._columns(ids)
    if self.row_columns is not None:
      columns.update(self.row_columns(np.full(len(ids), -1) if rows is None else
                                      np.asarray(rows).reshape(-1)))
    conversations = None
    if self.conversation is not None and rows is not None:
      conversations = [self.conversation(int(r), c)
                       for r, c in zip(np.asarray(rows).reshape(-1), completion_ids)]
    trl_done = trl_completions(prompts, completions, conversations)
    kwargs = build_kwargs(prompts, trl_done, columns, completion_ids, self.trainer_state)
    rewards, errors, firsts, logs, timeouts = self.pool.run(kwargs, len(ids))
    check_errors(self.fn_names, errors, len(ids), self.max_error_fraction, firsts)
    model_inputs = tuple(m.inputs(prompts, trl_done) for m in self.models)
    if len(ids) and not self.interrupted:
      for k, name in enumerate(self.fn_names):
        if timeouts[k]:
          warn_once(self._warned, (name, "timeouts"),
                    f"reward function {name!r} ran out of time on {timeouts[k]} of "
                    f"{len(ids)} completions (it returned TIMED_OUT): those rows are "
                    f"left out of their groups' means and counted in rewards/{name}/"
                    "timeouts, not as wrong answers, nor as errors; shown once")
        # None everywhere, without errors: usually a dataset column the
        # function reads is missing or empty, and it trains on nothing.
        elif errors[k] == 0 and np.isnan(rewards[:, k]).all():
          warn_once(self._warned, name,
                    f"reward function {name!r} returned None for all {len(ids)} "
                    "completions of a batch: it adds nothing to the advantages "
                    "(is the dataset column it reads filled?); shown once")
    with self._logged_lock:  # a mesh's shards may call back at once
      for name, values in logs.metrics.items():
        self.logged_metrics.setdefault(name, []).extend(values)
      if taken == self._taken:
        self._timeouts += timeouts
    self.recent.append({"example_ids": ids, "prompts": prompts, "completions": completions,
                        "rewards": rewards, "extra": logs.extra})
    return RewardOutput(rewards=rewards, names=self.fn_names, errors=errors, logs=logs,
                        timeouts=timeouts, model_inputs=model_inputs)

  def probe(self, example_ids) -> None:
    """Calls each function once on these rows, each with an empty completion (a model
    may end at once), before the rollout runs (rewards.check_at_start): one that
    raises, or returns the wrong type or number of values, stops the run here in one
    line naming it. What the call logs is dropped. Opt-in: a stateful function (a
    counter, a curriculum) sees one call more than TRL makes."""
    ids = np.asarray(example_ids).reshape(-1)
    empty = np.zeros((len(ids), 1), np.int32)
    saved, self.max_error_fraction = self.max_error_fraction, 0.0
    try:
      self.compute(ids, empty, np.zeros(empty.shape, bool))
    except RewardFunctionError as e:
      first = str(e).strip().splitlines()[0]  # the function, the rows and the exception
      raise RewardFunctionError(f"rewards.check_at_start: {first.split(': that is')[0]}") from e
    finally:
      self.max_error_fraction = saved
      self.take_logged_metrics()
      self.take_timeouts()
      self.recent.clear()

  def take_logged_metrics(self) -> dict[str, float]:
    """The mean of each metric the functions logged (log_metric) since the last take."""
    with self._logged_lock:
      taken, self.logged_metrics = self.logged_metrics, {}
    return {name: float(np.mean(values)) for name, values in taken.items()}

  def take_timeouts(self) -> np.ndarray:
    """[K] rows of training batches (compute, the rollout's callbacks) that returned
    TIMED_OUT since the last take: the loop takes them after each step's rollout,
    as that step's rewards/<name>/timeouts.

    A call begun before the last take and ended after it (a group the streaming
    engine handed off and the step did not wait for, which the rollout's errors
    leave out too) counts in neither step. Held-out evaluation (score) is not
    counted. A row the watchdog or a worker's deadline cuts off (row_timeout_s)
    is a hang, not a verdict out of time: an error, as before."""
    with self._logged_lock:
      taken, self._timeouts = self._timeouts, np.zeros(len(self.fns), np.int64)
      self._taken += 1
    return taken

  def _callback(self, example_ids, tokens, mask, rows=None):
    start = time.perf_counter()
    try:
      out = self.compute(example_ids, tokens, mask, rows)
    except RewardFunctionError as e:
      # XLA re-raises it wrapped in its own error and traceback: the loop raises this.
      self.error = e
      raise
    self.seconds += time.perf_counter() - start  # read by the loop as time/reward
    return (out.rewards, out.errors.astype(np.int32)[None, :],
            *(x for ids_lengths in out.model_inputs for x in ids_lengths))

  def score_rows(self, example_ids, tokens, mask, valid):
    """Host-side (numpy): (rewards [n, K] float32, NaN where not valid, errors [1, K]
    int32) of the valid rows of example_ids [n], tokens [n, T], mask [n, T]; the
    rollout engine's streaming hands its groups here (engine.HostScorer)."""
    if self.models:  # their forward runs in the program, which this path leaves
      raise ValueError("reward models score inside the rollout program: the streaming "
                       "engine's overlapped scoring cannot run them")
    return self._valid_callback(example_ids, tokens, mask, valid)[:2]

  def _valid_callback(self, example_ids, tokens, mask, valid):
    valid = np.asarray(valid, bool)
    rewards = np.full((len(valid), len(self.fns)), np.nan, np.float32)
    errors = np.zeros((1, len(self.fns)), np.int32)
    inputs = [x for m in self.models for x in (
        np.full((len(valid), m.max_length), m.pad_id, np.int32), np.zeros(len(valid), np.int32))]
    if valid.any():
      rewards[valid], errors, *got = self._callback(
          np.asarray(example_ids)[valid], np.asarray(tokens)[valid], np.asarray(mask)[valid])
      for whole, part in zip(inputs, got):
        whole[valid] = part
    return (rewards, errors, *inputs)

  # ----------------------------------------------------------- device side

  @property
  def on_device(self) -> DeviceRewards:
    """The traceable side, equal for every HostRewards of the same shape (K functions,
    the same reward models): a static of programs shared across runs, which pass the
    run's `slot`."""
    return DeviceRewards(len(self.fns), tuple(self.models))

  def __call__(self, example_ids: jax.Array, tokens: jax.Array, mask: jax.Array, *,
               mesh: jax.sharding.Mesh | None = None,
               batch_axes: Sequence[str] = mesh_lib.BATCH_AXES,
               valid: jax.Array | None = None,
               reward_params: Sequence | None = None) -> tuple[jax.Array, jax.Array]:
    """Traceable: `DeviceRewards.__call__` with this HostRewards' slot, a constant of the
    program traced (a program shared across runs takes the slot as an argument)."""
    return self.on_device(example_ids, tokens, mask, mesh=mesh, batch_axes=batch_axes,
                          valid=valid, reward_params=reward_params, slot=self.slot)


@dataclasses.dataclass(frozen=True)
class DeviceRewards:
  """The device side of a HostRewards with k functions and these reward models (equal
  models: the same objects), which reaches the host side by its slot."""

  k: int
  models: tuple = ()

  def __call__(self, example_ids: jax.Array, tokens: jax.Array, mask: jax.Array, *,
               slot, mesh: jax.sharding.Mesh | None = None,
               batch_axes: Sequence[str] = mesh_lib.BATCH_AXES,
               valid: jax.Array | None = None,
               reward_params: Sequence | None = None) -> tuple[jax.Array, jax.Array]:
    """Traceable: rewards [N, K+M] float32 (NaN: not applicable) and errors [K+M] int32.

    slot: the HostRewards whose functions score (HostRewards.slot), an int or a traced
    int32 scalar. With a `mesh`, rows are split over `batch_axes` (those the mesh has)
    and each device verifies only its own shard; without one, a single
    callback sees all N rows. valid: [N] bool, the rows to score (the rest are
    padding: NaN rewards, never shown to the functions); without a mesh only
    (the rollout engine's streaming calls it on each row shard's own rows).
    reward_params: the M reward models' parameters (TrainState.reward_params), which
    score the ids the callback returns, here on the device.
    """
    k = self.k
    if len(self.models) != len(reward_params or ()):
      raise ValueError(f"HostRewards has {len(self.models)} reward model(s) and "
                       f"{len(reward_params or ())} set(s) of reward_params")
    slot = jnp.asarray(slot, jnp.int32)

    # Each row's index in the rollout, for row_columns (a shard may hold part of a group).
    rows = jnp.arange(example_ids.shape[0], dtype=jnp.int32)

    def local(at_slot, ids, toks, m, at):
      n = ids.shape[0]
      shapes = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((1, k), jnp.int32),
                *(s for model in self.models for s in (
                    jax.ShapeDtypeStruct((n, model.max_length), jnp.int32),
                    jax.ShapeDtypeStruct((n,), jnp.int32))))
      if valid is not None:
        return io_callback(_valid_callback_at, shapes, at_slot, ids, toks, m, valid)
      return io_callback(_callback_at, shapes, at_slot, ids, toks, m, at)

    if valid is not None and mesh is not None:
      raise ValueError("HostRewards: valid= is for a shard's own rows, without a mesh")
    if mesh is None:
      rewards, errors, *inputs = local(slot, example_ids, tokens, mask, rows)
    else:
      axes = tuple(a for a in batch_axes if a in mesh.axis_names)
      if not axes:
        raise ValueError(f"none of batch_axes={tuple(batch_axes)} is an axis of the mesh "
                         f"{mesh.axis_names}")
      row = P(axes)
      fn = _shard_map(local, mesh, in_specs=(P(), row, P(axes, None), P(axes, None), row),
                      out_specs=(P(axes, None), P(axes, None),
                                 *(s for _ in self.models for s in (P(axes, None), row))))
      rewards, errors, *inputs = fn(slot, example_ids, tokens, mask, rows)
    errors = errors.sum(0)  # [shards, K] -> [K]
    if not self.models:
      return rewards, errors
    # Each model scores itself (grpojax.models.reward: the model layer, above this one).
    scored = [m.score(params, inputs[2 * i], inputs[2 * i + 1])
              for i, (m, params) in enumerate(zip(self.models, reward_params))]
    if valid is not None:  # padding rows: no reward, as the functions give them
      scored = [jnp.where(valid, x, jnp.nan) for x in scored]
    return (jnp.concatenate([rewards, jnp.stack(scored, axis=1)], axis=1),
            jnp.concatenate([errors, jnp.zeros(len(self.models), errors.dtype)]))


def trl_completions(prompts: Sequence, completions: Sequence[str],
                    conversations: Sequence[list | None] | None = None) -> list:
  """Completions as TRL hands them to reward functions: a conversational prompt (chat
  messages) gets `[{"role": "assistant", "content": text}]`, or where the row used tools
  its conversation (`conversations[i]`: assistant turns with their tool calls and the
  tool messages, the last turn at the end); a text prompt gets the text."""
  conversations = conversations or [None] * len(completions)
  return [(conv or [{"role": "assistant", "content": c}]) if isinstance(p, (list, tuple)) else c
          for p, c, conv in zip(prompts, completions, conversations)]
