"""The reward-function protocol (TRL's) and running several functions on a batch.

A reward function is called as `fn(prompts=[...], completions=[...],
completion_ids=[...], trainer_state=..., **dataset_columns)` and returns one
`float | None` per row; None (or NaN) means "not applicable", and `TIMED_OUT`
that the row's verdict ran out of time. It may be any callable (a function, an
object with `__call__`) and may be `async def`: its coroutine is awaited, and a
batch's async functions run concurrently (as TRL runs them). `compute_rewards`
runs K functions and returns float32 rewards `[N, K]` with NaN for None, plus
how many rows each function failed on and timed out on. Weighting and group
statistics happen on device (`grpojax.core.advantages`), where an all-NaN row
gets advantage 0.

What fails is the row, never the batch: a function that raises anything on a
row (any exception, and BaseExceptions too: SystemExit, KeyboardInterrupt,
GeneratorExit, its own subclasses), or returns inf or -inf for it, gives that
row NaN, counted in `rewards/<name>/errors`, with one warning. The one
exception that passes is the user's own Ctrl-C: a KeyboardInterrupt while a
SIGINT reached this process during the call (see _SigintSeen).

Axes: N rows (completions), K reward functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import inspect
import logging
import math
import numbers
import operator
import signal
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence

import numpy as np

RewardFn = Callable[..., list]  # fn(prompts=, completions=, **columns) -> list[float | None]
MAX_ERROR_FRACTION = 0.5  # more failing rows than this in a batch is a bug, not noise


class RewardFunctionError(RuntimeError):
  """A reward function is broken (raises on most rows, or returns junk)."""


class _TimedOut:
  """The type of TIMED_OUT, which has one instance."""

  __slots__ = ()

  def __repr__(self):
    return "TIMED_OUT"

  def __bool__(self):
    # `1.0 if verdict else 0.0` would score a timeout as right: say so instead.
    raise TypeError("TIMED_OUT has no truth value: a verdict that ran out of time is "
                    "neither right nor wrong (compare with `is TIMED_OUT`)")

  def __reduce__(self):
    # By name: unpickled in another process (a worker's verdict) it is this module's
    # TIMED_OUT again, so `is TIMED_OUT` holds everywhere.
    return "TIMED_OUT"


# What a reward function returns for a row whose verdict ran out of time (a slow
# machine, an expression too big to decide in time). Not a wrong answer: the row is
# NaN, left out of its group's mean like a failed row, and counted in
# rewards/<name>/timeouts. Not an error either: timeouts do not count toward
# max_error_fraction, since a loaded host is no bug in the reward code.
TIMED_OUT = _TimedOut()


@dataclasses.dataclass(frozen=True)
class TrainerState:
  """The run's progress, passed to reward functions as `trainer_state` (TRL passes
  transformers' TrainerState, with these fields among others), for rewards shaped
  by the step: curricula, length schedules."""

  global_step: int = 0  # GRPO steps finished before this rollout
  max_steps: int = 0  # the run's train.steps

  def __getitem__(self, key):
    # TRL's is an object too; a dict-minded reward learns how in one line.
    raise TypeError(f"trainer_state is an object with attributes, as TRL's: write "
                    f"trainer_state.{key} (fields: global_step, max_steps), not trainer_state[...]")


@dataclasses.dataclass
class RewardLogs:
  """What reward functions logged through TRL's hooks, which they get as keyword
  arguments: `log_metric(name, value)`, a scalar averaged over the step into the
  run's metrics, and `log_extra(column, values)`, one value per completion of the
  call, shown in the completions table. Picklable: a worker sends its own back."""

  metrics: dict = dataclasses.field(default_factory=dict)  # name -> [values]
  extra: dict = dataclasses.field(default_factory=dict)  # column -> [one per row]

  def log_metric(self, name: str, value: float) -> None:
    self.metrics.setdefault(str(name), []).append(float(value))

  def log_extra(self, column: str, values: Sequence) -> None:
    self.extra.setdefault(str(column), []).extend(values)

  @staticmethod
  def merge(parts: Sequence[tuple[Sequence[int], RewardLogs]], n: int) -> RewardLogs:
    """One batch's logs from its calls' (rows, logs): metrics pooled, extra columns laid
    out over the n rows (None where a call logged nothing for that column)."""
    out = RewardLogs()
    for rows, logs in parts:
      for name, values in logs.metrics.items():
        out.metrics.setdefault(name, []).extend(values)
      for column, values in logs.extra.items():
        laid = out.extra.setdefault(column, [None] * n)
        for r, v in zip(rows, values):
          laid[r] = v
    return out


HOOKS = ("log_metric", "log_extra")


def is_async(fn) -> bool:
  """Whether calling `fn` gives a coroutine: an `async def` function, or an object
  whose `__call__` is one."""
  return inspect.iscoroutinefunction(fn) or (
      not inspect.isroutine(fn) and inspect.iscoroutinefunction(getattr(fn, "__call__", None)))


def _awaited(out):
  """`out`, or its result where it is awaitable (an async reward function's call)."""
  if not inspect.isawaitable(out):
    return out

  async def wait():
    return await out

  try:
    asyncio.get_running_loop()
  except RuntimeError:  # the usual case: a runner's thread or a worker, no loop running
    return asyncio.run(wait())
  # This thread runs an event loop (a notebook calling compute_rewards): another thread's.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, wait()).result()


def reward_name(fn) -> str:
  """The name metrics use for a reward function (TRL: its __name__)."""
  name = getattr(fn, "__name__", None)
  return name if isinstance(name, str) else type(fn).__name__


def unique_names(fns: Sequence) -> tuple[str, ...]:
  """Reward names, made unique with a suffix where two functions share one."""
  names, seen = [], {}
  for fn in fns:
    base = reward_name(fn)
    seen[base] = seen.get(base, 0) + 1
    names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
  return tuple(names)


def validate_weights(fns: Sequence, weights: Sequence[float] | None) -> np.ndarray:
  """Weights `[K]` as float32 (default all ones), with a clear error if wrong."""
  if weights is None:
    return np.ones(len(fns), np.float32)
  w = np.asarray(weights, np.float32)
  if w.shape != (len(fns),) or not np.all(np.isfinite(w)):
    raise ValueError(
        f"reward weights {list(weights)} must be {len(fns)} finite numbers, one per "
        f"reward function ({', '.join(unique_names(fns))})")
  return w


def completion_text(completion) -> str:
  """Text of a completion: a string, or TRL's conversational message list."""
  if isinstance(completion, str):
    return completion
  if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
    return str(completion[-1].get("content", ""))
  raise TypeError(f"a completion must be a string or a list of messages, got {completion!r:.80}")


def _accepted_kwargs(fn, kwargs: dict) -> dict:
  """The keyword arguments `fn` can take (all of them if it has **kwargs)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return kwargs
  missing = [p.name for p in params
             if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in kwargs]
  if missing:
    raise RewardFunctionError(
        f"reward function {reward_name(fn)!r} needs {missing}, which the batch does not "
        f"have; available: {sorted(kwargs)}")
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return kwargs
  names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  return {k: v for k, v in kwargs.items() if k in names}


def _to_float(value, name: str) -> float:
  if value is None or value is TIMED_OUT:
    return math.nan
  if isinstance(value, (numbers.Real, np.bool_)):
    try:
      return float(value)  # NaN stays NaN: TRL reads it as "not applicable"
    except OverflowError:  # an int past float's range: as non-finite as inf
      return math.copysign(math.inf, value)
  raise RewardFunctionError(
      f"reward function {name!r} returned {value!r:.80} ({type(value).__name__}); "
      "expected float, int, bool, None or TIMED_OUT")


@dataclasses.dataclass
class _Values:
  """One call's values: float32 [n], NaN for None, TIMED_OUT and non-finite values."""

  values: np.ndarray
  nonfinite: int  # rows given inf, -inf (or a number past float32's range): errors
  timeouts: int  # rows given TIMED_OUT
  why: str  # the first non-finite value, said as an error


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _values(out: Sequence, name: str) -> _Values:
  wide = np.asarray([_to_float(v, name) for v in out], np.float64)
  # inf, -inf, and what float32 cannot hold (it would be inf on device); NaN is False.
  bad = np.abs(wide) > _FLOAT32_MAX
  nonfinite, why = int(np.count_nonzero(bad)), ""
  if nonfinite:
    wide[bad] = np.nan
    why = (f"reward function {name!r} returned {out[int(np.argmax(bad))]!r:.80}, not a "
           "finite float32 (None or NaN: not applicable)")
  timeouts = sum(v is TIMED_OUT for v in out) if TIMED_OUT in out else 0
  return _Values(wide.astype(np.float32), nonfinite, timeouts, why)


# Immutable values: every reward call can share them. Exact types, not isinstance:
# a subclass of str or int may carry mutable attributes. numpy's scalars are
# immutable too (its void, structured records, is not).
_ATOMS = frozenset({str, int, float, bool, complex, bytes, type(None)}
                   | (set(np.sctypeDict.values()) - {np.object_, np.void}))


def _flat(xs) -> bool:
  return set(map(type, xs)) <= _ATOMS


def _fresh(x):
  """x with its mutable parts copied at any depth (lists, dicts, sets, numpy
  arrays; other objects deep-copied) and its immutable parts shared (_ATOMS,
  and tuples and frozensets of them)."""
  t = type(x)
  if t in _ATOMS:
    return x
  if t is list:
    return x.copy() if _flat(x) else [_fresh(v) for v in x]
  if t is dict:
    return {k: _fresh(v) for k, v in x.items()}  # keys are hashable: shared
  if t is tuple or t is frozenset:
    if _flat(x):
      return x
    items = [_fresh(v) for v in x]
    return x if all(map(operator.is_, items, x)) else t(items)  # all immutable: shared
  if t is set:
    return x.copy() if _flat(x) else set(map(_fresh, x))
  if t is np.ndarray and x.dtype != object:
    return x.copy()
  try:
    return copy.deepcopy(x)
  except Exception:  # noqa: BLE001 - an object that cannot be copied is shared
    return x


def _fresh_column(x):
  try:
    return _fresh(x)
  except RecursionError:  # a list that holds itself: deepcopy follows cycles
    return copy.deepcopy(x)


def _copier(x, rows: bool = False) -> Callable[[], object]:
  """A function giving fresh copies of x (see _fresh), for many calls on one batch.

  Looking at every element's type is what costs (256 rows of 4096 token ids:
  ~13 ms, the copies themselves ~1 ms), so a batch's layout is read once: a
  list of plain values, or of lists of them (token ids, tests), then copies
  without looking again.
  """
  if rows:  # lists of ints by the protocol (token ids): nothing to look at
    return lambda: [row.copy() for row in x]
  if type(x) is list:
    kinds = set(map(type, x))
    if kinds <= _ATOMS:
      return x.copy
    if kinds == {list} and all(map(_flat, x)):
      return lambda: [row.copy() for row in x]
  return lambda: _fresh_column(x)


ROWS = ("completion_ids",)  # build_kwargs' columns of flat lists
# Columns of live objects, handed to every call as they are (TRL's `environments`: a
# reward reads the state a rollout left in its environment, which a copy may not hold).
LIVE = ("environments",)


class BatchCopies:
  """Each reward call's own copy of a batch's columns (lists, dicts, sets,
  arrays, at any depth; strings and numbers shared).

  So a function that edits its arguments in place (a completion, the gold
  `answer`, a message dict, a row of token ids or of tests) changes neither
  what the next function or a row-by-row retry sees, nor the dataset's own
  rows, nor a later call of the same function. The columns must not change
  while their copies are being made: each one's layout is read once.
  """

  def __init__(self, kwargs: Mapping, rows: Sequence[str] = ()):
    """rows: columns that are lists of flat lists by construction, copied
    without reading their layout (build_kwargs' `completion_ids`)."""
    self.kwargs, self._copiers, self.rows = kwargs, {}, frozenset(rows)

  def __call__(self, keys) -> dict:
    out = {}
    for key in keys:
      make = self._copiers.get(key)
      if make is None:
        value = self.kwargs[key]
        make = self._copiers[key] = (value.copy if key in LIVE else
                                     _copier(value, key in self.rows))
      out[key] = make()
    return out


def fresh_kwargs(kwargs: Mapping) -> dict:
  """One call's own copy of the batch (BatchCopies, for a single call)."""
  return {key: value.copy() if key in LIVE else _fresh_column(value)
          for key, value in kwargs.items()}


def _call(fn, name: str, kwargs: dict, n: int) -> _Values:
  out = _awaited(fn(**kwargs))
  if isinstance(out, np.ndarray):
    out = out.tolist()
  if not isinstance(out, Sequence) or isinstance(out, (str, bytes)) or len(out) != n:
    got = f"{len(out)} values" if isinstance(out, Sequence) else type(out).__name__
    raise RewardFunctionError(
        f"reward function {name!r} returned {got} for {n} completions; it must return "
        "a list with one float (or None) per completion")
  return _values(out, name)


def row_slice(kwargs: dict, i: int) -> dict:
  """The keyword arguments of a call on row i alone (`trainer_state`, not a column, whole)."""
  return {k: (v[i:i + 1] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}


def warn_once(seen: set, key, message: str) -> None:
  """One log line per `key` in `seen`: a hang every step is news once, not a flood."""
  if key not in seen:
    seen.add(key)
    logging.getLogger("grpojax.rewards").warning(message)


def _logged(fn, name: str, kwargs: dict, n: int,
            hooks: Sequence[str]) -> tuple[_Values, RewardLogs]:
  """_call with this call's own RewardLogs behind the hooks `fn` takes."""
  logs = RewardLogs()
  out = _call(fn, name, {**kwargs, **{h: getattr(logs, h) for h in hooks}}, n)
  for column, values in logs.extra.items():
    if len(values) != n:
      raise RewardFunctionError(
          f"reward function {name!r} logged {len(values)} values in column {column!r} for "
          f"{n} completions: log_extra takes one value per completion")
  return out, logs


class _SigintSeen:
  """Tells the user's Ctrl-C from a reward function that raises KeyboardInterrupt.

  Python raises KeyboardInterrupt for SIGINT on the main thread only, through
  the Python handler installed there. So: off the main thread (the runners'
  call threads, a worker process, which ignores SIGINT), or with no Python
  handler (SIG_IGN; SIG_DFL, which ends the process without an exception), a
  KeyboardInterrupt is the function's own. On the main thread, with a Python
  handler, this wraps that handler for the duration of the calls: it counts
  the signals and hands each on, so a KeyboardInterrupt is the user's iff a
  SIGINT arrived meanwhile. A handler set from C (getsignal gives None) cannot
  be wrapped: then every KeyboardInterrupt is taken for the user's.
  """

  def __init__(self):
    self.count = 0
    self._handler = self._previous = None
    self._unknown = False

  def __enter__(self) -> _SigintSeen:
    if threading.current_thread() is not threading.main_thread():
      return self
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:
      self._unknown = True
    elif callable(previous):
      def handler(signum, frame):
        self.count += 1
        return previous(signum, frame)

      self._previous, self._handler = previous, handler
      signal.signal(signal.SIGINT, handler)
    return self

  def __exit__(self, *exc):
    # Put back only our own: a function that installed a handler of its own keeps it.
    if self._handler is not None and signal.getsignal(signal.SIGINT) is self._handler:
      signal.signal(signal.SIGINT, self._previous)

  def is_users(self, e: BaseException) -> bool:
    """Whether `e` is the user's Ctrl-C, which must stop the run, not fail a row."""
    return isinstance(e, KeyboardInterrupt) and (self.count > 0 or self._unknown)


def _warn_escape(warned: set, name: str, e: BaseException) -> None:
  """One line for a function that raised what is not an Exception: a row's error, which
  would otherwise look like the run stopping (Ctrl-C, sys.exit)."""
  if isinstance(e, Exception):
    return  # counted in errors and shown by check_errors, as always
  kind = type(e).__name__
  what = (f"exited with code {e.code} (sys.exit / os._exit in reward code)"
          if isinstance(e, SystemExit) else
          "raised KeyboardInterrupt, though no Ctrl-C (SIGINT) arrived"
          if isinstance(e, KeyboardInterrupt) else f"raised {kind} (a BaseException)")
  warn_once(warned, (name, "raised", kind),
            f"reward function {name!r} {what}: a row where it does scores NaN (counted in "
            f"rewards/{name}/errors) and the run goes on (shown once)")


def call_reward_fn(fn, kwargs: dict, n: int, name: str | None = None, *,
                   copies: BatchCopies | None = None, warned: set | None = None
                   ) -> tuple[np.ndarray, int, str, RewardLogs, int]:
  """Runs one reward function on a batch of `n` rows.

  A function that raises on the batch is retried row by row, so that one
  bad row costs one reward, not n. Anything a call raises counts (SystemExit,
  KeyboardInterrupt and other BaseExceptions too), except RewardFunctionError
  and the user's own Ctrl-C (_SigintSeen), which propagate. Each of these
  calls gets its own copy of its arguments (BatchCopies), and its own
  log_metric and log_extra where the function takes them. Returns (values
  `[n]` float32 with NaN for None/failed/timed-out rows, rows that failed
  (raised, or returned inf or -inf), the first error's traceback, what it
  logged, rows that returned TIMED_OUT). Returning or logging the wrong
  number or type of values raises RewardFunctionError.

  copies: BatchCopies(kwargs), shared by the calls of several functions on
    this batch so that its layout is read once (default: made here).
  warned: the warnings shown already (warn_once), for one line per function
    over many calls (default: this call's own).
  """
  name = name or reward_name(fn)
  warned = set() if warned is None else warned
  taken = _accepted_kwargs(fn, {**kwargs, **dict.fromkeys(HOOKS)})
  hooks = [h for h in HOOKS if h in taken]
  kwargs = {k: v for k, v in taken.items() if k not in HOOKS}
  copies = BatchCopies(kwargs) if copies is None else copies
  with _SigintSeen() as sigint:
    try:
      out, logs = _logged(fn, name, copies(kwargs), n, hooks)
      _warn_nonfinite(warned, name, out)
      return out.values, out.nonfinite, out.why, logs, out.timeouts
    except RewardFunctionError:
      raise
    except BaseException as e:  # noqa: BLE001 - user code; isolated below row by row
      if sigint.is_users(e):
        raise
      _warn_escape(warned, name, e)
      first = traceback.format_exc()
    values, parts = np.full(n, np.nan, np.float32), []
    raised = nonfinite = timeouts = 0
    why = ""
    for i in range(n):
      try:
        # Row by row from the batch as it came, not as the failed call left it.
        out, logs = _logged(fn, name, fresh_kwargs(row_slice(kwargs, i)), 1, hooks)
      except RewardFunctionError:
        raise
      except BaseException as e:  # noqa: BLE001
        if sigint.is_users(e):
          raise
        _warn_escape(warned, name, e)
        raised += 1
        continue
      _warn_nonfinite(warned, name, out)
      values[i] = out.values[0]
      nonfinite, timeouts, why = nonfinite + out.nonfinite, timeouts + out.timeouts, why or out.why
      parts.append(([i], logs))
  # The batch's traceback stands for the rows that raised alone; where none did (only
  # the whole batch raised), the first non-finite value is the first error, if any.
  first = first if raised else why
  return values, raised + nonfinite, first, RewardLogs.merge(parts, n), timeouts


def _warn_nonfinite(warned: set, name: str, out: _Values) -> None:
  if out.nonfinite:
    warn_once(warned, (name, "nonfinite"),
              f"{out.why}: that row scores NaN (counted in rewards/{name}/errors; "
              "shown once)")


@dataclasses.dataclass(frozen=True)
class RewardOutput:
  """rewards: [N, K] float32, NaN where a function gave None, failed or timed out.
  names: K unique reward names. errors: K failed-rows counts. logs: what the
  functions logged through log_metric and log_extra. timeouts: K counts of rows
  that returned TIMED_OUT (None: none)."""

  rewards: np.ndarray
  names: tuple[str, ...]
  errors: np.ndarray
  logs: RewardLogs = dataclasses.field(default_factory=RewardLogs)  # log_metric, log_extra
  timeouts: np.ndarray | None = None
  # Per reward model (HostRewards' models): its input ids [N, R] int32 and lengths [N]
  # int32, scored on the device (grpojax.models.reward).
  model_inputs: tuple = ()

  def __post_init__(self):
    if self.timeouts is None:
      object.__setattr__(self, "timeouts", np.zeros(len(self.names), np.int64))

  def metrics(self) -> dict[str, float]:
    """TRL-style per-function metrics: rewards/<name>/mean, /std, /errors, /timeouts."""
    out = {}
    for k, name in enumerate(self.names):
      col = self.rewards[:, k]
      ok = col[~np.isnan(col)]
      out[f"rewards/{name}/mean"] = float(ok.mean()) if ok.size else math.nan
      out[f"rewards/{name}/std"] = float(ok.std()) if ok.size else math.nan
      out[f"rewards/{name}/errors"] = float(self.errors[k])
      out[f"rewards/{name}/timeouts"] = float(self.timeouts[k])
    return out


def check_errors(names: Sequence[str], errors: Sequence[int], n: int,
                 max_error_fraction: float | None = MAX_ERROR_FRACTION,
                 first_errors: Sequence[str] = ()) -> None:
  """Stops the run when a function failed on more than the allowed fraction.

  `errors` are failed rows only: a row that returned TIMED_OUT is not one (a
  loaded machine is no bug in the reward code), so timeouts never stop a run;
  HostRewards warns of them instead."""
  if max_error_fraction is None or n == 0:
    return
  for k, (name, e) in enumerate(zip(names, errors)):
    if e > max_error_fraction * n:
      detail = first_errors[k] if k < len(first_errors) and first_errors[k] else ""
      # The exception in the first line (what a one-line report shows), its traceback after.
      cause = next((line.strip() for line in reversed(detail.splitlines()) if line.strip()),
                   "no error text")
      raise RewardFunctionError(
          f"reward function {name!r} failed on {int(e)} of {n} completions: {cause}: that "
          f"is a bug in the reward code, not noise. The first error:\n{detail}".rstrip())


def build_kwargs(prompts: Sequence, completions: Sequence, columns: Mapping | None,
                 completion_ids: Sequence | None,
                 trainer_state: TrainerState | None = None) -> dict:
  """The keyword arguments of a reward-function call, the columns checked for length;
  `trainer_state` where given."""
  n = len(completions)
  kwargs = {"prompts": list(prompts), "completions": list(completions)}
  if completion_ids is not None:
    # Token ids, flat lists by the protocol: BatchCopies copies them row by row
    # without reading every id's type (ROWS).
    kwargs["completion_ids"] = [c.tolist() if isinstance(c, np.ndarray) else list(c)
                                for c in completion_ids]
  for key, col in (columns or {}).items():
    if key in kwargs:
      raise ValueError(f"dataset column {key!r} clashes with a reward-function argument")
    kwargs[key] = list(col)
  for key, col in kwargs.items():
    if len(col) != n:
      raise ValueError(f"{key!r} has {len(col)} rows but there are {n} completions")
  if trainer_state is not None:
    if "trainer_state" in kwargs:
      raise ValueError("dataset column 'trainer_state' clashes with a reward-function argument")
    kwargs["trainer_state"] = trainer_state
  return kwargs


def compute_rewards(fns: Sequence[RewardFn], prompts: Sequence, completions: Sequence,
                    columns: Mapping[str, Sequence] | None = None, *,
                    completion_ids: Sequence[Sequence[int]] | None = None,
                    max_error_fraction: float | None = MAX_ERROR_FRACTION) -> RewardOutput:
  """Runs every reward function on the batch, in this process.

  Args:
    fns: K reward functions.
    prompts, completions: N each.
    columns: dataset columns, each a list of N values, passed as keywords.
    completion_ids: N token-id lists, passed as `completion_ids`.
    max_error_fraction: a function failing on more rows than this raises
      RewardFunctionError naming it (None: never).

  Returns:
    RewardOutput with rewards `[N, K]` (NaN: None, failed or TIMED_OUT), errors and
    timeouts `[K]`.
  """
  kwargs = build_kwargs(prompts, completions, columns, completion_ids)
  n, names = len(completions), unique_names(fns)
  rewards = np.full((n, len(fns)), np.nan, np.float32)
  errors, timeouts = np.zeros(len(fns), np.int64), np.zeros(len(fns), np.int64)
  firsts, copies, parts, warned = [], BatchCopies(kwargs, rows=ROWS), [], set()
  for k, (fn, name) in enumerate(zip(fns, names)):
    rewards[:, k], errors[k], first, logs, timeouts[k] = call_reward_fn(
        fn, kwargs, n, name, copies=copies, warned=warned)
    firsts.append(first)
    parts.append((range(n), logs))
  check_errors(names, errors, n, max_error_fraction, firsts)
  return RewardOutput(rewards=rewards, names=names, errors=errors,
                      logs=RewardLogs.merge(parts, n), timeouts=timeouts)
