"""Reward functions run in the trainer's process, under a watchdog.

`rewards.num_workers=0` keeps reward code in this process on purpose: `print`
shows, `pdb.set_trace()` works, closures and lambdas need no pickling, and
nothing is spawned. The watchdog gives it the pool's guarantees where Python
can: a call runs in its own thread, and one that overruns its time, or calls
`os._exit` / `sys.exit` (or raises anything else: base.call_reward_fn), is
abandoned or retried row by row, so only the bad row scores NaN (counted as an
error of that function, one warning line).
Each call gets its own copy of the batch (base.BatchCopies), as a worker's
would: an edit in place reaches neither the next function nor a retry.

`os._exit` is guarded on every thread, not only the call's own: once an
InProcessRunner exists, `os._exit` ends its process only from the main
thread. From any other thread it raises SystemExit there, as `sys.exit`
would, with one warning line naming the thread and the call site: on a
call's thread that fails the call as above; on a thread the reward started
(threading.Thread, Timer, ThreadPoolExecutor, `_thread`, and theirs) it ends
that thread or executor task quietly. Other processes are untouched: a child
forked by reward code or by multiprocessing still exits. Why every non-main
thread rather than the reward's descendants: tracking descent needs hooks in
`threading` and `_thread` that differ across Python 3.11-3.13, and would
still miss threads it did not see start (a pool made before the call, C
threads calling into Python). The rewards themselves never run on the main
thread (jit's host callback calls them on an XLA thread, a `_DummyThread` to
Python, and each call gets its own thread from there), and nothing the
trainer runs off the main thread calls `os._exit` (JAX only at exit, orbax
and multiprocessing only in forked children); your own watchdog thread that
must end the process can call `inprocess.real_exit`. The guard stays for the
life of the process: a thread a reward left behind may still fire.

What a thread cannot do is kill. Reward code must run in worker processes
(`rewards.num_workers >= 1`) when it can crash the interpreter (a segfault
in a C extension or ctypes), kill its own process by a signal
(`os.kill(os.getpid(), ...)`, `os.abort()`), hold the GIL in C for long (a
regex with catastrophic backtracking: `re` keeps the GIL while it matches,
so not even the watchdog runs), or monkeypatch modules the trainer shares
(`os`, `numpy`, `builtins`, `os._exit` itself); so must any untrusted
verifier. A hung call keeps its (daemon) thread until the trainer exits.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from grpojax.rewards.base import (ROWS, BatchCopies, RewardLogs, call_reward_fn, is_async,
                                  row_slice, unique_names, warn_once)

CHUNK_ROWS = 8  # the pool's chunk: a call on n rows is allowed ceil(n / 8) row timeouts
INTERRUPT_GRACE_S = 2.0  # after interrupt(), calls still running get this long to finish

real_exit = os._exit  # the unguarded os._exit, for a trainer's own threads that need it
_guard_pid: int | None = None  # the process whose non-main threads are guarded
_call_threads: set[int] = set()  # threads running a reward call: the runner reports their exit
_warned: set = set()


def _guarded_exit(code):
  ident = threading.get_ident()
  # A forked child has another pid (its forking thread is its main thread
  # anyway): its os._exit must really end it.
  if os.getpid() != _guard_pid or ident == threading.main_thread().ident:
    real_exit(code)
  if ident not in _call_threads:
    caller = sys._getframe().f_back  # noqa: SLF001 - the call site, for the one log line
    # None: called straight from C, as `_thread.start_new_thread(os._exit, ...)` does.
    site = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "no Python caller"
    warn_once(_warned, site,
              f"os._exit({code}) called on thread {threading.current_thread().name!r} "
              f"({site}): reward functions run in the trainer (rewards.num_workers=0), "
              "where only the main thread may end the process; that thread ends instead "
              "(shown once per call site)")
  # What sys.exit does off the main thread: threading and _thread end the thread
  # without a traceback (they match SystemExit exactly, so no subclass), and an
  # executor hands it to whoever waits on the task.
  raise SystemExit(code)


def _guard_exit() -> None:
  global _guard_pid
  _guard_pid = os.getpid()
  os._exit = _guarded_exit


def _debugging(ident: int) -> bool:
  """Is a debugger (pdb) stepping through the thread `ident`?

  A user at a pdb prompt inside a reward function is not a hang.
  """
  frame = sys._current_frames().get(ident)  # noqa: SLF001 - the only way to look
  while frame is not None:
    if frame.f_trace is not None:
      return True
    frame = frame.f_back
  return False


class InProcessRunner:
  """Runs K reward functions on a batch in this process; see the module docstring.

  The same interface as RewardPool: `run(kwargs, n)`, `interrupt()`,
  `interrupted`, `close()`.
  """

  def __init__(self, fns: Sequence, *, row_timeout_s: float = 30.0):
    self.fns, self.names = list(fns), unique_names(fns)
    self.row_timeout_s = row_timeout_s
    self._interrupt_at = math.inf
    self._warned: set = set()
    self.interrupted = False  # some call was cut short by interrupt()
    _guard_exit()  # off the main thread, os._exit ends only its thread: see above

  def interrupt(self):
    """SIGTERM: calls running now, or started later, end within the grace period."""
    self._interrupt_at = min(self._interrupt_at, time.monotonic() + INTERRUPT_GRACE_S)

  def close(self):
    pass  # hung threads are daemons: they go with the process

  def _attempt(self, k: int, kwargs: dict, n: int, budget: float,
               copies: BatchCopies | None = None):
    """One call in its own thread: ("ok", result) | ("raise", exc) |
    ("exit", code) | ("timeout", None) | ("interrupted", None)."""
    return self._wait(*self._start(k, kwargs, n, budget, copies))

  def _start(self, k: int, kwargs: dict, n: int, budget: float, copies: BatchCopies | None):
    fn, name = self.fns[k], self.names[k]
    box, done = {}, threading.Event()

    def target():
      key = threading.get_ident()
      _call_threads.add(key)
      try:
        box["out"] = ("ok", call_reward_fn(fn, kwargs, n, name, copies=copies,
                                           warned=self._warned))
      except SystemExit as e:  # call_reward_fn counts the function's own; this is a guard
        box["out"] = ("exit", e.code)
      except BaseException as e:  # noqa: BLE001 - RewardFunctionError: the caller's
        box["out"] = ("raise", e)
      finally:
        _call_threads.discard(key)
        done.set()

    thread = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    deadline = time.monotonic() + budget
    thread.start()
    return thread, box, done, deadline, budget

  def _wait(self, thread, box, done, deadline: float, budget: float):
    while True:
      # Polled, not one long wait: interrupt() may move the end closer.
      left = min(deadline, self._interrupt_at) - time.monotonic()
      if done.wait(max(0.0, min(left, 0.25))):
        return box["out"]
      if left <= 0:
        if time.monotonic() >= self._interrupt_at:
          return "interrupted", None
        if _debugging(thread.ident):
          deadline = time.monotonic() + budget
          continue
        return "timeout", None

  def _why(self, kind: str, out, seconds: float) -> str:
    if kind == "exit":
      return f"exited with code {out} (os._exit / sys.exit in reward code)"
    return f"timed out after {seconds:.1f}s"

  def run(self, kwargs: dict, n: int, functions: Sequence[int] | None = None
          ) -> tuple[np.ndarray, np.ndarray, list[str], RewardLogs, np.ndarray]:
    """rewards [n, K] float32 (NaN: None/failed/timed out), errors [K], first errors
    [K], what the functions logged (RewardLogs over the n rows), and timeouts [K] (rows
    that returned TIMED_OUT).

    functions: the indices of the functions to call (default all); the others' columns stay NaN.
    """
    k_count = len(self.fns)
    rewards = np.full((n, k_count), np.nan, np.float32)
    errors, firsts = np.zeros(k_count, np.int64), [""] * k_count
    timeouts = np.zeros(k_count, np.int64)
    parts = []  # (rows, RewardLogs) of each call that returned
    if n == 0:
      return rewards, errors, firsts, RewardLogs(), timeouts
    copies = BatchCopies(kwargs, rows=ROWS)  # each call its own; the batch's layout read once
    order = list(range(k_count) if functions is None else functions)
    budget = self.row_timeout_s * math.ceil(n / CHUNK_ROWS)
    # Async functions are awaited concurrently, as TRL does: their calls start together,
    # each in its own thread and event loop, and run beside the others.
    running = {k: self._start(k, kwargs, n, budget, copies) for k in order
               if is_async(self.fns[k])}
    for k in order:
      name = self.names[k]
      kind, out = (self._wait(*running[k]) if k in running else
                   self._attempt(k, kwargs, n, budget, copies))
      if kind == "ok":
        rewards[:, k], errors[k], firsts[k], logs, timeouts[k] = out
        parts.append((range(n), logs))
        continue
      if kind == "raise":
        raise out
      if kind == "interrupted":
        self.interrupted = True
        continue
      warn_once(self._warned, (name, kind),
                f"reward function {name!r} {self._why(kind, out, budget)}; its rows are "
                "retried one by one, and a row that fails alone scores NaN (counted in "
                f"rewards/{name}/errors; shown once)")
      # Row by row, so only the bad row loses its reward; all retries
      # together get one more batch allowance.
      end = time.monotonic() + max(budget, self.row_timeout_s)
      for i in range(n):
        left = min(self.row_timeout_s, end - time.monotonic())
        kind, out = self._attempt(k, row_slice(kwargs, i), 1, left) if left > 0 else (
            "timeout", None)
        if kind == "ok":
          rewards[i, k] = out[0][0]
          errors[k] += out[1]
          firsts[k] = firsts[k] or out[2]
          parts.append(([i], out[3]))
          timeouts[k] += out[4]
        elif kind == "raise":
          raise out
        elif kind == "interrupted":
          self.interrupted = True
          break
        else:
          errors[k] += 1
          firsts[k] = firsts[k] or f"{name}: {self._why(kind, out, self.row_timeout_s)}"
    return rewards, errors, firsts, RewardLogs.merge(parts, n), timeouts
