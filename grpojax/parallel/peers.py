"""A multi-process run's watch on its peers: a process that dies without a word
(SIGKILL, the OOM killer, a lost host) is named in one line by the others.

Without it JAX's own answer comes at its heartbeat timeout (100 s by default): the
survivors abort from C++ with a thread dump and no word of what to do. Here each
process writes a heartbeat key to JAX's coordination service every `every_s`
seconds and reads its peers'; when a peer's has not moved for `timeout_s` (and the
peer did not say it was exiting), or the service itself is gone (process 0, which
hosts it, died), the process writes one line to stderr and exits with status 1
before JAX's abort. Every process is stopped that way, and rerunning all of them
with the same command resumes from the last checkpoint.

A peer that exits on its own marks its key first: at the end of the run it is never
reported; with an error (`failed(line)`, which the command line calls with the one
line it prints) the others stop at once with that line, rather than wait in a
collective for JAX's abort.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time

PREFIX = "grpojax/alive/"
EXITED = "exited"
FAILED = "failed: "
# Below JAX's heartbeat timeout (100 s), above any pause a live process makes while
# holding Python's lock; GRPOJAX_PEER_TIMEOUT_S changes it (tests use a few seconds).
TIMEOUT_S = 60.0


class PeerWatch:
  """Heartbeats through `client` (jax's DistributedRuntimeClient) and a daemon thread
  that reports a silent peer. `report(line)` is called once (default: print the line
  and os._exit(1))."""

  def __init__(self, client, process_index: int, process_count: int, *,
               timeout_s: float = TIMEOUT_S, every_s: float = 2.0, report=None):
    self.client, self.me, self.count = client, process_index, process_count
    self.timeout_s, self.every_s = float(timeout_s), float(every_s)
    self.report = report or self._exit_with
    self._stop = threading.Event()
    self._beat = 0
    self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its last value, when it moved)
    self._silent: int | None = None  # the peer reported silent
    self._thread = threading.Thread(target=self._run, daemon=True, name="grpojax-peer-watch")

  def start(self) -> "PeerWatch":
    self._send()
    self._thread.start()
    atexit.register(self.close)  # after jax's own: runs before its shutdown
    return self

  def close(self, value: str = EXITED) -> None:
    """Says this process is exiting (`value`: EXITED, or FAILED and its error line) and
    stops."""
    if self._stop.is_set():
      return
    self._stop.set()
    try:
      self.client.key_value_set(PREFIX + str(self.me), value, allow_overwrite=True)
    except Exception:  # noqa: BLE001  the service may be gone already: nothing to tell
      pass

  def _send(self) -> None:
    self._beat += 1
    self.client.key_value_set(PREFIX + str(self.me), str(self._beat), allow_overwrite=True)

  def check(self, now: float) -> str | None:
    """One round: send a beat, read the peers'; the line to report, or None."""
    try:
      self._send()
      values = dict(self.client.key_value_dir_get(PREFIX))
    except Exception as e:  # noqa: BLE001  the coordination service is unreachable
      if self._stop.is_set():
        return None
      head = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
      return (f"process 0 of {self.count} (it hosts JAX's coordination service) is gone "
              f"({head}): {_RERUN}")
    for peer in range(self.count):
      if peer == self.me:
        continue
      value = values.get(PREFIX + str(peer))
      if value is not None and value.startswith(FAILED):
        return (f"process {peer} of {self.count} stopped with an error ({value[len(FAILED):]}): "
                f"fix it, then {_RERUN}")
      last = self._seen.get(peer)
      if last is None or value != last[0]:
        self._seen[peer] = (value, now)
        continue
      if value != EXITED and now - last[1] > self.timeout_s:
        self._silent = peer
        return (f"process {peer} of {self.count} stopped answering (no heartbeat for "
                f"{now - last[1]:.0f} s: it died or hangs): {_RERUN}")
    return None

  def wait_for_peers(self, skip: int | None = None) -> None:
    """Process 0 hosts JAX's coordination service and the others abort (a C++ dump)
    the moment it goes: it waits, a few heartbeats at most, until each peer (but
    `skip`, the silent one) has said it is exiting. A no-op on the others."""
    if self.me != 0:
      return
    deadline = time.monotonic() + 3 * self.every_s + 2
    while time.monotonic() < deadline:
      try:
        values = dict(self.client.key_value_dir_get(PREFIX))
      except Exception:  # noqa: BLE001  nothing to wait for without the service
        return
      if all(values.get(PREFIX + str(p), "") == EXITED
             or values.get(PREFIX + str(p), "").startswith(FAILED)
             for p in range(self.count) if p not in (self.me, skip)):
        return
      time.sleep(0.1)

  def _exit_with(self, line: str) -> None:
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    self.close()
    self.wait_for_peers(skip=self._silent)
    os._exit(1)  # the survivors' collectives wait on the dead peer forever: no clean exit

  def _run(self) -> None:
    while not self._stop.wait(self.every_s):
      line = self.check(time.monotonic())
      if line is not None and not self._stop.is_set():
        self.report(line)
        return


_RERUN = ("stop every process and start them all again with the same command; the run "
          "resumes from its last checkpoint")


_WATCH: list[PeerWatch] = []  # this process's, once started


def watch(client, process_index: int, process_count: int) -> PeerWatch | None:
  """Starts a PeerWatch for a run of several processes (None for one process)."""
  if process_count < 2 or client is None:
    return None
  timeout = float(os.environ.get("GRPOJAX_PEER_TIMEOUT_S", TIMEOUT_S))
  _WATCH[:] = [PeerWatch(client, process_index, process_count, timeout_s=timeout,
                         every_s=min(2.0, timeout / 4)).start()]
  return _WATCH[0]


def failed(line: str) -> None:
  """This process stops with an error (`line`, the one it prints): its peers stop
  too, quoting it (a no-op without a watch: one process)."""
  if _WATCH:
    _WATCH[0].close(FAILED + " ".join(line.split())[:300])


def error_line(e: BaseException) -> str:
  """The first line of an exception's message (its type's name when it has none)."""
  return (str(e).strip().splitlines() or [""])[0] or type(e).__name__


def watching() -> bool:
  """Whether this process is one of a multi-process run's (its watch started)."""
  return bool(_WATCH)


def leave(status: int) -> None:
  """Ends a process of a multi-process run that stopped with an error (after its one
  line): at once, without JAX's shutdown, whose barrier waits on peers that are
  gone or going (a C++ abort and its dump); process 0 first lets its peers leave.
  Returns (nothing to do) for one process."""
  if not _WATCH:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  _WATCH[0].wait_for_peers()
  os._exit(status)


@contextlib.contextmanager
def failing_stops_peers():
  """`with failing_stops_peers(): ...`: an exception raised inside stops this
  process's peers at once, quoting its first line, then propagates (the Python
  API's train(); the command line calls `failed` with the line it prints)."""
  try:
    yield
  except Exception as e:
    failed(error_line(e))
    raise
