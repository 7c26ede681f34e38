"""Reward functions run in the trainer's process, under a watchdog.

`rewards.num_workers=0` keeps reward code in this process on purpose: `print`
shows, `pdb.set_trace()` works, closures and lambdas need no pickling, and
nothing is spawned. The watchdog gives it the pool's guarantees where Python
can: a call runs in its own thread, and one that overruns its time, or calls
`os._exit` / `sys.exit`, is abandoned and retried row by row, so only the bad
row scores NaN (counted as an error of that function, one warning line).

What a thread cannot do is kill: a hung call keeps its (daemon) thread until
the trainer exits, and code that crashes the interpreter or holds the GIL in
C forever still takes the trainer down. Untrusted or hostile verifiers
belong in worker processes (`rewards.num_workers >= 1`).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from grpojax.rewards.base import call_reward_fn, row_slice, unique_names, warn_once

CHUNK_ROWS = 8  # the pool's chunk: a call on n rows is allowed ceil(n / 8) row timeouts
INTERRUPT_GRACE_S = 2.0  # after interrupt(), calls still running get this long to finish

_real_exit = os._exit
_reward_threads: set[tuple[int, int]] = set()  # (pid, thread id) running reward code


class _Exited(BaseException):
  """os._exit called from reward code: ends its call, not the trainer."""

  def __init__(self, code):
    super().__init__(code)
    self.code = code


def _guarded_exit(code):
  # Keyed by pid too: a child forked from a reward thread has the same thread
  # id, and its os._exit must really end it.
  if (os.getpid(), threading.get_ident()) in _reward_threads:
    raise _Exited(code)
  _real_exit(code)


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
    os._exit = _guarded_exit  # reward threads only; every other caller exits as before

  def interrupt(self):
    """SIGTERM: calls running now, or started later, end within the grace period."""
    self._interrupt_at = min(self._interrupt_at, time.monotonic() + INTERRUPT_GRACE_S)

  def close(self):
    pass  # hung threads are daemons: they go with the process

  def _attempt(self, k: int, kwargs: dict, n: int, budget: float):
    """One call in its own thread: ("ok", result) | ("raise", exc) |
    ("exit", code) | ("timeout", None) | ("interrupted", None)."""
    fn, name = self.fns[k], self.names[k]
    box, done = {}, threading.Event()

    def target():
      key = (os.getpid(), threading.get_ident())
      _reward_threads.add(key)
      try:
        box["out"] = ("ok", call_reward_fn(fn, kwargs, n, name))
      except _Exited as e:
        box["out"] = ("exit", e.code)
      except SystemExit as e:
        box["out"] = ("exit", e.code)
      except BaseException as e:  # noqa: BLE001 - RewardFunctionError: the caller's
        box["out"] = ("raise", e)
      finally:
        _reward_threads.discard(key)
        done.set()

    thread = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    deadline = time.monotonic() + budget
    thread.start()
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

  def run(self, kwargs: dict, n: int,
          functions: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """rewards [n, K] float32 (NaN: None/failed), errors [K], first errors [K].

    functions: the indices of the functions to call (default all); the others' columns stay NaN.
    """
    k_count = len(self.fns)
    rewards = np.full((n, k_count), np.nan, np.float32)
    errors, firsts = np.zeros(k_count, np.int64), [""] * k_count
    if n == 0:
      return rewards, errors, firsts
    for k in range(k_count) if functions is None else functions:
      name = self.names[k]
      budget = self.row_timeout_s * math.ceil(n / CHUNK_ROWS)
      kind, out = self._attempt(k, kwargs, n, budget)
      if kind == "ok":
        rewards[:, k], errors[k], firsts[k] = out
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
        elif kind == "raise":
          raise out
        elif kind == "interrupted":
          self.interrupted = True
          break
        else:
          errors[k] += 1
          firsts[k] = firsts[k] or f"{name}: {self._why(kind, out, self.row_timeout_s)}"
    return rewards, errors, firsts
