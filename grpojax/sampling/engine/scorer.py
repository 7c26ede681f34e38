"""HostScorer: the streaming engine's groups verified on host threads while it decodes.

Axes: F groups a hand-off holds, G samples per prompt, n = F*G rows, T tokens,
K rewards.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable

import numpy as np


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
