"""A persistent pool of worker processes that run reward functions on row chunks.

Each task is (one reward function, a chunk of rows). A task that overruns
`row_timeout_s`, or whose worker dies (segfault, os._exit), has its worker
killed and replaced; its rows are retried one by one so that only the row
that hangs loses its reward (NaN, counted as an error of that function), and
the first hang or death of each function is logged in one line. `interrupt()`
(SIGTERM in the trainer) ends every pending task within a short grace period.
One dispatcher thread serves every caller, so concurrent callers (one host
callback per device) share the workers instead of queueing behind a lock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence

import numpy as np

from grpojax.rewards.base import (RewardFunctionError, RewardLogs, call_reward_fn, unique_names,
                                  warn_once)
from grpojax.rewards.runtime.inprocess import INTERRUPT_GRACE_S

_STARTUP_S = 300.0  # spawning imports grpojax (and so JAX): minutes on a loaded host


@contextlib.contextmanager
def _main_hidden(hide: bool):
  """Keep spawned workers from re-running the trainer's `__main__` script.

  Spawn re-imports the main module in every child, which re-runs an
  unguarded script. Only reward functions defined in `__main__` need that.
  """
  main = sys.modules.get("__main__")
  if not hide or main is None:
    yield
    return
  saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
  main.__dict__.pop("__file__", None)
  main.__dict__["__spec__"] = None
  try:
    yield
  finally:
    main.__dict__.update(saved)


def _defined_in_main(fn) -> bool:
  return "__main__" in (getattr(fn, "__module__", None), type(fn).__module__)


def _file_modules(fns) -> list[tuple[str, str]]:
  """(module name, file) of the functions' modules that a fresh interpreter could not
  import by name: e.g. a --config file, which ml_collections loads as "config_config"."""
  out = []
  for fn in fns:
    name = getattr(fn, "__module__", None) or type(fn).__module__
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if (name and path and name != "__main__" and (name, path) not in out
        and importlib.machinery.PathFinder.find_spec(name.split(".")[0]) is None):
      out.append((name, path))
  return out


def _load_file_modules(modules) -> None:
  for name, path in modules:
    if name in sys.modules:
      continue
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
      sys.path.insert(0, folder)  # the file's own sibling imports
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _worker_main(conn, payload, names, file_modules=()):
  # Ctrl-C is the trainer's business; a worker just finishes or gets killed.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  # The workers are the parallelism here: the math reward's Math-Verify runs in
  # one child process per worker (plus its spare), not one per core each.
  os.environ.setdefault("GRPOJAX_MATH_PROCESSES", "1")
  warned: set = set()  # one line per function and kind of failure, per worker
  # The functions arrive pickled: their modules loaded first, as the trainer has them.
  _load_file_modules(file_modules)
  fns = pickle.loads(payload)
  conn.send(("ready",))
  while True:
    try:
      task_id, k, kwargs, n = conn.recv()
    except (EOFError, OSError):
      return  # the trainer went away
    try:
      conn.send((task_id, "ok", *call_reward_fn(fns[k], kwargs, n, names[k], warned=warned)))
    except RewardFunctionError as e:
      conn.send((task_id, "fatal", str(e), 0, "", None, 0))
    except BaseException:  # noqa: BLE001 - reported, the worker lives on
      # call_reward_fn counts what the function raises: this is the worker's own failure
      # (the reply does not pickle, say).
      conn.send((task_id, "fatal", traceback.format_exc(), 0, "", None, 0))


@dataclasses.dataclass
class _Batch:
  rewards: np.ndarray  # [n, K]
  errors: np.ndarray  # [K]
  firsts: list
  timeouts: np.ndarray  # [K] rows that returned TIMED_OUT
  parts: list = dataclasses.field(default_factory=list)  # (rows, RewardLogs) of its tasks
  pending: int = 0
  fatal: str | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class _Task:
  batch: _Batch
  k: int
  rows: list[int]
  kwargs: dict
  single: bool  # already split after a timeout: a second one is final


@dataclasses.dataclass
class _Worker:
  proc: multiprocessing.Process | None
  conn: mpc.Connection
  ready: bool = False
  task: _Task | None = None
  task_id: int = 0
  deadline: float = 0.0


class RewardPool:
  """Runs K reward functions over batches in `num_workers` processes.

  Args:
    fns: reward functions; must be picklable (module-level functions or
      instances of module-level classes), as they are sent to workers.
    num_workers: processes; verifiers mostly wait on subprocesses (the code
      sandbox, math-verify), so more than the core count can pay off.
    row_timeout_s: time a task (one function on a chunk of rows) may take
      before its worker is killed; its rows are then retried one by one,
      and a row that overruns alone scores NaN and counts as an error.
    chunk_rows: rows per task (None: up to 8, enough to keep workers busy).
  """

  def __init__(self, fns: Sequence, *, num_workers: int = 2, row_timeout_s: float = 30.0,
               chunk_rows: int | None = None):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    try:
      pickle.dumps(list(fns))
    except Exception as e:  # noqa: BLE001
      raise ValueError(
          "reward functions must be picklable to run in worker processes: define them "
          "at module level (not lambdas or closures), or run them in-process "
          f"(num_workers=0). Pickling failed with: {e}") from e
    self.fns, self.names = list(fns), unique_names(fns)
    self._needs_main = any(_defined_in_main(fn) for fn in self.fns)
    self._payload = pickle.dumps(self.fns)
    self._file_modules = _file_modules(self.fns)
    self.row_timeout_s, self.chunk_rows = row_timeout_s, chunk_rows
    self._ctx = multiprocessing.get_context("spawn")
    self._queue: collections.deque[_Task] = collections.deque()
    self._lock = threading.Lock()
    self._wake_r, self._wake_w = os.pipe()
    os.set_blocking(self._wake_w, False)
    self._closed = False
    self._broken: str | None = None
    self._next_id = 0
    self._interrupt_at = float("inf")
    self._cut_done = False
    self._warned: set = set()
    self.interrupted = False  # some task was cut short by interrupt()
    self._workers = [self._spawn() for _ in range(num_workers)]
    self._thread = threading.Thread(target=self._loop, name="reward-pool", daemon=True)
    self._thread.start()

  # ----------------------------------------------------------- public

  def run(self, kwargs: dict, n: int, functions: Sequence[int] | None = None
          ) -> tuple[np.ndarray, np.ndarray, list[str], RewardLogs, np.ndarray]:
    """rewards [n, K] float32 (NaN: None/failed/timed out), errors [K], first errors
    [K], what the functions logged (RewardLogs over the n rows), and timeouts [K] (rows
    that returned TIMED_OUT).

    functions: the indices of the functions to call (default all); the others' columns stay NaN.
    """
    k_count = len(self.fns)
    batch = _Batch(rewards=np.full((n, k_count), np.nan, np.float32),
                   errors=np.zeros(k_count, np.int64), firsts=[""] * k_count,
                   timeouts=np.zeros(k_count, np.int64))
    ks = range(k_count) if functions is None else functions
    empty = batch.rewards, batch.errors, batch.firsts, RewardLogs(), batch.timeouts
    if n == 0 or not ks:
      return empty
    chunk = self.chunk_rows or min(8, max(1, -(-n // (4 * len(self._workers)))))
    tasks = [_Task(batch, k, list(range(lo, min(lo + chunk, n))), kwargs, False)
             for k in ks for lo in range(0, n, chunk)]
    batch.pending = len(tasks)
    with self._lock:
      if self._closed or self._broken:
        raise RuntimeError(self._broken or "the reward pool is closed")
      if time.monotonic() >= self._interrupt_at:
        self.interrupted = True
        return empty
      self._queue.extend(tasks)
    self._wake()
    batch.done.wait()
    if batch.fatal:
      raise RewardFunctionError(batch.fatal)
    return (batch.rewards, batch.errors, batch.firsts, RewardLogs.merge(batch.parts, n),
            batch.timeouts)

  def interrupt(self):
    """SIGTERM: tasks running now, or queued later, end within the grace period
    (their rows NaN, `interrupted` set), so the trainer can save and exit."""
    with self._lock:
      self._interrupt_at = min(self._interrupt_at, time.monotonic() + INTERRUPT_GRACE_S)
    self._wake()

  def close(self):
    """Stops the workers; callers still waiting get an error, not a hang."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._wake()
    self._thread.join(timeout=10)
    with self._lock:
      self._abort("the reward pool was closed while rewards were pending")
    os.close(self._wake_r)
    os.close(self._wake_w)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _wake(self):
    try:
      os.write(self._wake_w, b"x")
    except BlockingIOError:
      pass  # the pipe is full of wake-ups already

  # ---------------------------------------------------------- workers

  def _spawn(self) -> _Worker:
    parent, child = self._ctx.Pipe()
    proc = self._ctx.Process(target=_worker_main, name="reward-worker", daemon=True,
                             args=(child, self._payload, self.names, self._file_modules))
    with _main_hidden(not self._needs_main):
      proc.start()
    child.close()
    return _Worker(proc=proc, conn=parent, deadline=time.monotonic() + _STARTUP_S)

  @staticmethod
  def _kill(w: _Worker):
    if w.proc is None:
      return
    if w.proc.is_alive():
      w.proc.kill()
    w.proc.join(timeout=5)
    w.conn.close()

  def _replace(self, i: int):
    self._kill(self._workers[i])
    self._workers[i] = self._spawn()

  # ------------------------------------------------------- dispatcher

  def _finish(self, task: _Task, values, errors: int, first: str, logs: RewardLogs | None = None,
              timeouts: int = 0):
    b = task.batch
    b.rewards[task.rows, task.k] = values
    b.timeouts[task.k] += timeouts
    if logs is not None:
      b.parts.append((task.rows, logs))
    b.errors[task.k] += errors
    if first and not b.firsts[task.k]:
      b.firsts[task.k] = first
    b.pending -= 1
    if b.pending == 0:
      b.done.set()

  def _fail(self, task: _Task, why: str):
    """A task's worker hung or died: retry its rows alone, or give up on one."""
    name = self.names[task.k]
    warn_once(self._warned, (name, why.split()[0]),
              f"reward function {name!r}: {why}; its rows are retried one by one, and a row "
              f"that fails alone scores NaN (counted in rewards/{name}/errors; shown once)")
    if task.single or len(task.rows) == 1:
      self._finish(task, np.nan, 1, f"{self.names[task.k]}: {why}")
      return
    task.batch.pending += len(task.rows) - 1
    self._queue.extendleft(
        _Task(task.batch, task.k, [r], task.kwargs, True) for r in reversed(task.rows))

  def _assign(self, w: _Worker):
    task = self._queue.popleft()
    rows = task.rows
    kwargs = {key: [col[r] for r in rows] if isinstance(col, list) else col
              for key, col in task.kwargs.items()}
    self._next_id += 1
    w.task, w.task_id = task, self._next_id
    # One row's allowance for the whole chunk: chunks are small, and one
    # that overruns is retried row by row, so a hanging row costs at most
    # two timeouts and the rows beside it lose nothing.
    w.deadline = time.monotonic() + self.row_timeout_s
    try:
      w.conn.send((w.task_id, task.k, kwargs, len(rows)))
    except (OSError, ValueError):
      pass  # a dead worker is noticed by the wait below

  def _loop(self):
    try:
      self._serve()
    except BaseException:  # noqa: BLE001 - callers must never wait forever
      with self._lock:
        self._abort("the reward pool's dispatcher failed:\n" + traceback.format_exc())

  def _serve(self):
    while True:
      with self._lock:
        if self._closed:
          break
        for w in self._workers:
          if w.proc is not None and w.ready and w.task is None and self._queue:
            self._assign(w)
      soonest = min((w.deadline for w in self._workers if w.proc is not None),
                    default=float("inf"))
      if not self._cut_done:  # once cut, waking for it again would spin
        soonest = min(soonest, self._interrupt_at)
      timeout = None if soonest == float("inf") else max(0.0, soonest - time.monotonic())
      live = [(i, w) for i, w in enumerate(self._workers) if w.proc is not None]
      conns = {w.conn: i for i, w in live}
      sentinels = {w.proc.sentinel: i for i, w in live}
      ready = mpc.wait([self._wake_r, *conns, *sentinels], timeout=timeout)
      if self._wake_r in ready:
        os.read(self._wake_r, 1 << 12)
      with self._lock:
        self._handle(ready, conns, sentinels)

  def _handle(self, ready, conns, sentinels):
    for conn, i in conns.items():
      w = self._workers[i]
      if conn not in ready:
        continue
      try:
        msg = conn.recv()
      except (EOFError, OSError):
        continue  # death is handled through the sentinel (a worker sends
        # one reply per task, so nothing is left unread behind EOF)
      if msg[0] == "ready":
        w.ready, w.deadline = True, float("inf")
        continue
      task_id, kind, payload, errors, first, logs, timeouts = msg
      if w.task is None or task_id != w.task_id:
        continue
      task, w.task, w.deadline = w.task, None, float("inf")
      if kind == "ok":
        self._finish(task, payload, errors, first, logs, timeouts)
      else:
        task.batch.fatal = task.batch.fatal or payload
        self._finish(task, np.nan, 0, "")
    now = time.monotonic()
    if now >= self._interrupt_at:
      self._cut()
    for i, w in enumerate(self._workers):
      if w.proc is None:
        continue
      dead = w.proc.sentinel in ready
      late = now >= w.deadline
      if not (dead or late):
        continue
      if not w.ready:
        self._abort(f"a reward worker failed to start (exit code {w.proc.exitcode}); "
                    "are the reward functions importable from a module?")
        return
      task = w.task
      self._replace(i)
      if task is not None:
        self._fail(task, f"worker died (exit code {w.proc.exitcode})" if dead
                   else f"timed out after {self.row_timeout_s:.1f}s")

  def _cut(self):
    """interrupt()'s grace is over: every pending task ends now, its rows NaN."""
    tasks = list(self._queue)
    self._queue.clear()
    for i, w in enumerate(self._workers):
      if w.proc is not None and w.task is not None:
        tasks.append(w.task)
        w.task = None
        self._replace(i)
    for task in tasks:
      self._finish(task, np.nan, 0, "")
    self.interrupted = self.interrupted or bool(tasks)
    self._cut_done = True

  def _abort(self, why: str):
    """The pool cannot work (closed, or workers die on start): fail everything."""
    self._broken = self._broken or why
    tasks = list(self._queue) + [w.task for w in self._workers if w.task is not None]
    self._queue.clear()
    for w in self._workers:
      self._kill(w)
      w.proc, w.task, w.deadline = None, None, float("inf")
    for task in tasks:
      task.batch.fatal = task.batch.fatal or why
      self._finish(task, np.nan, 0, "")
