"""grpojax.parallel.peers: a silent peer is reported once its heartbeat stands still
for the timeout, never one that said it exited; a coordination service that is gone
is reported too. Driven by hand through a stand-in for JAX's key-value client (the
two-process case: tests/test_train_loop_multihost.py)."""

import pytest

from grpojax.parallel import peers


class Store:
  """JAX's DistributedRuntimeClient's key-value calls, in a dict."""

  def __init__(self):
    self.values, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
    assert allow_overwrite or key not in self.values
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_a_peer_whose_heartbeat_stands_still_is_reported_after_the_timeout():
  store = Store()
  watch = peers.PeerWatch(store, 0, 3, timeout_s=10)
  store.values.update({peers.PREFIX + "1": "1", peers.PREFIX + "2": "1"})
  assert watch.check(0.0) is None
  store.values[peers.PREFIX + "1"] = "2"  # process 1 beats on; process 2 stands still
  assert watch.check(6.0) is None
  store.values[peers.PREFIX + "1"] = "3"
  assert watch.check(10.0) is None  # 10 s still: not past the timeout
  store.values[peers.PREFIX + "1"] = "4"
  line = watch.check(10.5)
  assert line.startswith("process 2 of 3 stopped answering (no heartbeat for 10 s")
  assert "start them all again" in line
  assert store.values[peers.PREFIX + "0"] == "4"  # this process beat at each of its 4 rounds


def test_a_peer_that_said_it_exited_is_never_reported():
  store = Store()
  mine, theirs = peers.PeerWatch(store, 0, 2, timeout_s=5), peers.PeerWatch(store, 1, 2)
  theirs._send()
  assert mine.check(0.0) is None
  theirs.close()  # its atexit: the end of its run, or its own reported error
  assert store.values[peers.PREFIX + "1"] == peers.EXITED
  assert mine.check(1.0) is None and mine.check(100.0) is None


def test_a_coordination_service_that_is_gone_is_reported_unless_this_process_is_exiting():
  store = Store()
  watch = peers.PeerWatch(store, 1, 2)
  store.down = True
  line = watch.check(0.0)
  assert line.startswith("process 0 of 2 (it hosts JAX's coordination service) is gone "
                         "(UNAVAILABLE: failed to connect")
  watch.close()
  assert watch.check(1.0) is None


def test_the_thread_reports_once_and_one_process_runs_no_watch():
  store = Store()
  said = []
  watch = peers.PeerWatch(store, 0, 2, timeout_s=0.2, every_s=0.05, report=said.append)
  watch.start()
  watch._thread.join(timeout=10)
  assert not watch._thread.is_alive()
  assert len(said) == 1 and said[0].startswith("process 1 of 2 stopped answering")
  watch.close()
  assert peers.watch(store, 0, 1) is None


@pytest.mark.parametrize("count", [2, 4])
def test_every_other_process_is_watched(count):
  store = Store()
  watch = peers.PeerWatch(store, 1, count, timeout_s=1)
  assert watch.check(0.0) is None
  line = watch.check(2.0)
  assert line.startswith("process 0 of") and f"of {count}" in line


def test_a_peer_that_failed_is_reported_at_once_with_its_line():
  store = Store()
  mine, theirs = peers.PeerWatch(store, 0, 2, timeout_s=60), peers.PeerWatch(store, 1, 2)
  theirs._send()
  assert mine.check(0.0) is None
  peers._WATCH[:] = [theirs]
  try:
    peers.failed("dataset 'x' has no split 'test'\n(more)")
  finally:
    peers._WATCH.clear()
  line = mine.check(0.5)  # well within the timeout
  assert line.startswith("process 1 of 2 stopped with an error (dataset 'x' has no split "
                         "'test' (more)): fix it, then stop every process")
  peers.failed("no watch: one process")  # a no-op


def test_an_error_inside_failing_stops_peers_marks_this_process_failed_and_propagates():
  store = Store()
  peers._WATCH[:] = [peers.PeerWatch(store, 1, 2)]
  try:
    with pytest.raises(ValueError, match="bad row"):
      with peers.failing_stops_peers():
        raise ValueError("bad row 7\ntraceback detail")
  finally:
    peers._WATCH.clear()
  assert store.values[peers.PREFIX + "1"] == peers.FAILED + "bad row 7"
  assert peers.error_line(KeyError()) == "KeyError"


def test_the_python_api_marks_a_failing_process_so_its_peers_stop(tmp_path, monkeypatch):
  """GRPOTrainer.train() in a process of a multi-process run: its error stops the
  others at once, as the command line's does."""
  api = pytest.importorskip("grpojax.api")
  from grpojax.train import loop  # pylint: disable=import-outside-toplevel

  store = Store()
  peers._WATCH[:] = [peers.PeerWatch(store, 1, 2)]

  def setup(cfg, workdir):
    raise RuntimeError("dataset 'x' has no split 'test'")

  monkeypatch.setattr(loop, "setup", setup)
  trainer = api.GRPOTrainer(model="tiny", reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                args=api.GRPOConfig(output_dir=str(tmp_path), max_steps=1,
                                                        report_to="none"),
                                train_dataset=[{"prompt": "1 + 1 =", "solution": "2"}] * 8)
  try:
    with pytest.raises(RuntimeError, match="no split"):
      trainer.train()
  finally:
    peers._WATCH.clear()
  assert store.values[peers.PREFIX + "1"] == peers.FAILED + "dataset 'x' has no split 'test'"
