"""The whole loop on two CPU processes joined by jax.distributed (one device
each): one set of run outputs (metrics.jsonl, config.json: process 0 only)
holding the metrics of a one-process run of the same config and global batch on
the same 2-device mesh. The runs are tests/multihost_loop_worker.py in subprocesses.
And a SIGTERM that reaches one process stops every process at the same step.
"""

import collections
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import test_train_multihost as multihost
from grpojax.train import checkpoint as checkpoint_lib
from grpojax.train import metrics as metrics_lib

WORKER = Path(__file__).with_name("multihost_loop_worker.py")
# Wall clocks, which no two runs share (the streaming rollout's wait for its scorer too).
TIMING = ("time/", "step_time", "dynamic_sampling/scoring_wait_s")
# Tolerances. The same samples give the same rewards, lengths, dynamic-sampling
# decisions and eval answers (up to float32 round-off in means): abs 1e-6.
# Everything downstream of a cross-process reduction (loss, KL, entropy, grad
# norm, the updated weights) differs from one process only by the order of the
# reduction: rel 1e-4 (abs 1e-6 near zero).
SAMPLED = ("reward", "frac_reward", "completions/", "dynamic_sampling/", "eval/")
SAMPLED_TOL = dict(abs=1e-6)
REDUCED_TOL = dict(rel=1e-4, abs=1e-6)


def _rows(workdir):
  return [{k: v for k, v in row.items() if not k.startswith(TIMING)}
          for row in metrics_lib.read_metrics(workdir)]


@pytest.mark.slow
def test_two_processes_run_the_loop_of_one(tmp_path):
  # One device per process: how TPU VMs and multi-node GPU jobs look to JAX, and the
  # layout whose replicated arrays jax's own device_put gets wrong (mesh.put). Two
  # devices per process: tests/test_train_multihost.py.
  port = multihost.free_port()
  envs = [multihost.process_env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)]
  envs.append(multihost.process_env(2))
  workdirs = [tmp_path / "pair", tmp_path / "pair", tmp_path / "one"]
  outs = [tmp_path / f"out{i}.json" for i in range(3)]
  # All three at once: the one-process run overlaps the pair's compiles. About
  # 100 s of CPU in all; the time limit leaves room for a busy machine.
  with multihost.running(tmp_path, "run", [[sys.executable, str(WORKER), str(w), str(o)]
                                           for w, o in zip(workdirs, outs)], envs,
                         timeout_s=480):
    pass
  *pair, one = [json.loads(o.read_text()) for o in outs]
  assert [(p["process"], p["processes"], p["devices"], p["step"]) for p in pair] == [
      (0, 2, 2, 2), (1, 2, 2, 2)]
  assert (one["processes"], one["devices"], one["step"]) == (1, 2, 2)

  # One metrics file, one line per logged step (none from process 1), holding the
  # one-process run's metrics.
  got, want = _rows(workdirs[0]), _rows(workdirs[2])
  assert [row["step"] for row in got] == [0, 1, 2]
  assert want[1]["reward_std"] > 0 and want[1]["grad_norm"] > 0
  for g, w in zip(got, want):
    assert set(g) == set(w), g["step"]
    for key, value in w.items():
      tol = SAMPLED_TOL if key.startswith(SAMPLED) else REDUCED_TOL
      assert g[key] == pytest.approx(value, **tol), (g["step"], key)
  # The timeouts (counted on each host, not on device) are the whole run's, not process 0's.
  assert all(row["rewards/odd_times_out/timeouts"] > 0 for row in want[1:])
  rounds = sum(row["dynamic_sampling/rounds"] for row in want[1:])
  assert rounds > 2  # some zero-std group was dropped and replaced

  # Each process verified only the prompts it fed (its 2 of each batch's 4), the pair
  # together those of the one process. The engine streams (the default decoder):
  # a group is verified once its rows end, so a batch's groups that the step did not
  # reach before it stopped are not.
  # (Counted per completion: the generated data may hold one problem twice.)
  mine = [collections.Counter(p["seen"]) for p in pair]
  assert all(0 < len(m) <= 2 * rounds for m in mine)
  assert mine[0] + mine[1] == collections.Counter(one["seen"])
  with open(workdirs[0] / metrics_lib.CONFIG_FILE) as f:
    assert json.load(f)["task"]["name"] == "arithmetic_dense"

  # The collective saves completed; the exported weights (gathered from both
  # processes) are the one-process run's, to the reduced tolerance.
  ckpt = checkpoint_lib.Checkpointer(str(workdirs[0] / "checkpoints"))
  assert ckpt.all_steps() == [1, 2]
  ckpt.close()
  got, want = (load_file(w / "hf" / "model.safetensors") for w in workdirs[::2])
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=REDUCED_TOL["rel"],
                               atol=REDUCED_TOL["abs"], err_msg=name)


# Process 1 alone gets SIGTERM between two of the loop's per-step checks.
PREEMPTION = """
import json, os, signal, sys
import jax
try:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
except AttributeError:
  pass
from grpojax.parallel import mesh as mesh_lib
from grpojax.train import loop
mesh_lib.initialize_distributed()
preemption = loop._Preemption()
before = preemption.requested()
if jax.process_index() == 1:
  os.kill(os.getpid(), signal.SIGTERM)
after = preemption.requested()
with open(sys.argv[1], "w") as f:
  json.dump([preemption.received, before, after], f)
"""


@pytest.mark.slow
def test_sigterm_to_one_process_stops_every_process(tmp_path):
  port = multihost.free_port()
  envs = [multihost.process_env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)]
  outs = [tmp_path / f"out{i}.json" for i in range(2)]
  with multihost.running(tmp_path, "preempt", [[sys.executable, "-c", PREEMPTION, str(o)]
                                               for o in outs], envs):
    pass
  # (received, requested before, requested after): process 0 stops without a signal.
  assert [json.loads(o.read_text()) for o in outs] == [[False, False, True], [True, False, True]]


# Process 1 dies without a word (SIGKILL) once both are up; process 0 then waits in
# what stands for a collective (a sleep past JAX's own 100 s heartbeat timeout).
SILENT_DEATH = """
import os, signal, sys, time
from grpojax.parallel import mesh as mesh_lib
mesh_lib.initialize_distributed()
import jax
if jax.process_index() == 1:
  os.kill(os.getpid(), signal.SIGKILL)
print("waiting", flush=True)
time.sleep(150)
print("never reported", flush=True)
"""


@pytest.mark.slow
def test_a_peer_that_dies_silently_is_named_in_one_line(tmp_path):
  """The survivor says which process died and what to do, and exits 1, well before
  JAX's abort (its heartbeat timeout, 100 s, then a C++ thread dump)."""
  import subprocess
  import time

  port = multihost.free_port()
  envs = [multihost.process_env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                                GRPOJAX_PEER_TIMEOUT_S="6") for i in range(2)]
  start = time.monotonic()
  procs = [subprocess.Popen([sys.executable, "-c", SILENT_DEATH], env=env, cwd=multihost.REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for env in envs]
  try:
    out, _ = procs[0].communicate(timeout=90)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  took = time.monotonic() - start
  assert procs[1].returncode == -9
  lines = out.strip().splitlines()
  assert procs[0].returncode == 1, out[-3000:]
  assert "waiting" in lines and "never reported" not in out
  assert lines[-1].startswith("error: process 1 of 2 stopped answering"), out[-3000:]
  assert "start them all again" in lines[-1] and "Check failure" not in out
  assert took < 80  # JAX's own abort would come at 100 s


# One process of three stops with an error (the command line's path: its one line,
# then peers.leave); the others wait in what stands for a collective.
ONE_FAILS = """
import sys, time
from grpojax.parallel import mesh as mesh_lib, peers
mesh_lib.initialize_distributed()
import jax
if jax.process_index() == int(sys.argv[1]):
  try:
    with peers.failing_stops_peers():
      raise RuntimeError("the checkpoint folder is full")
  except RuntimeError as e:
    print(f"error: {e}", file=sys.stderr)
    peers.leave(1)
print("waiting", flush=True)
time.sleep(150)
print("never reported", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("failing", [0, 2])
def test_a_process_that_fails_stops_every_process_in_one_line_each(tmp_path, failing):
  """Each process's last line is the error (its own, or its peer's quoted): no JAX
  abort and thread dump, whether the failing process hosts the coordination service
  (0: it waits for its peers to leave first) or not."""
  import subprocess

  port = multihost.free_port()
  envs = [multihost.process_env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                JAX_NUM_PROCESSES="3", JAX_PROCESS_ID=str(i),
                                GRPOJAX_PEER_TIMEOUT_S="20") for i in range(3)]
  procs = [subprocess.Popen([sys.executable, "-c", ONE_FAILS, str(failing)], env=env,
                            cwd=multihost.REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for env in envs]
  try:
    outs = [p.communicate(timeout=90)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  for i, (p, out) in enumerate(zip(procs, outs)):
    last = out.strip().splitlines()[-1]
    assert p.returncode == 1 and "Check failure" not in out and "never" not in out, out[-3000:]
    if i == failing:
      assert last == "error: the checkpoint folder is full"
    else:
      assert last.startswith(f"error: process {failing} of 3 stopped with an error (the "
                             "checkpoint folder is full): fix it, then stop every process")
