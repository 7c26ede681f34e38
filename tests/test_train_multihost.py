"""Multi-host for real: two CPU processes joined by jax.distributed (gloo collectives)
run two GRPO steps (rollout + update) of the tiny model, each feeding only its own
prompts and verifying only its own rows, and reproduce a single-process run on the
same 4-device mesh (2 processes x 2 devices; fsdp spans both processes).

The work is done by tests/multihost_worker.py in subprocesses, so the processes
get their own JAX runtime (the test session's has 8 fake devices and no coordinator).
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = WORKER.parent.parent
TIMEOUT_S = 240  # each whole launch; a healthy run takes well under a minute


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(devices: int, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
  # The session's compile-time flags (tests/conftest.py: these programs are tiny and
  # compiling them is most of the time), with this process's own device count.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  path = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=path,
             XLA_FLAGS=" ".join([f"--xla_force_host_platform_device_count={devices}", *flags]),
             **extra)
  return env


@contextlib.contextmanager
def running(tmp_path, name, commands, envs, timeout_s=TIMEOUT_S):
  """Starts one process per (command, env); after the block, waits for all of them
  (at most timeout_s from the start) and fails the test with the logs of any that
  exited non-zero. Process i logs to tmp_path/{name}{i}.log."""
  procs, logs = [], []
  try:
    for i, (command, env) in enumerate(zip(commands, envs)):
      logs.append(open(tmp_path / f"{name}{i}.log", "w"))
      procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=logs[-1],
                                    stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    yield
    # Until all are done, one fails (its peers would wait on it forever), or time is up.
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
        break
      time.sleep(0.2)
  finally:
    for p in procs:  # only our own children, by handle
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
  if failed:
    report = "\n".join(f"--- process {i} exited with {code} (negative: killed after a peer "
                       f"failed or {timeout_s} s passed):\n"
                       + (tmp_path / f"{name}{i}.log").read_text()[-2000:] for i, code in failed)
    pytest.fail(report)


def _launch(tmp_path, name, envs) -> list[dict]:
  """One worker per env, run together; returns their outputs."""
  outs = [tmp_path / f"{name}{i}.json" for i in range(len(envs))]
  with running(tmp_path, name, [[sys.executable, str(WORKER), str(o)] for o in outs], envs):
    pass
  return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
def test_two_processes_reproduce_one_process(tmp_path):
  port = free_port()
  multi_envs = [process_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                            JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)]
  # All three at once: the single-process reference overlaps the pair's compiles.
  multi_and_single = _launch(tmp_path, "run", multi_envs + [process_env(4)])
  multi, (single,) = multi_and_single[:2], multi_and_single[2:]

  assert single["processes"] == 1 and not single["distributed"]
  assert [m["process"] for m in multi] == [0, 1]
  assert all(m["processes"] == 2 and m["distributed"] and m["local_devices"] == 2 for m in multi)
  # Each process verified only the prompts it fed (ids 100*step + prompt; 2 per process).
  assert multi[0]["seen"] == [0, 1, 100, 101]
  assert multi[1]["seen"] == [2, 3, 102, 103]
  assert single["seen"] == [0, 1, 2, 3, 100, 101, 102, 103]

  assert len(single["history"]) == 2
  for m in multi:
    for step, (got, want) in enumerate(zip(m["history"], single["history"])):
      assert set(got) == set(want)
      # Same samples: identical tokens, so identical host rewards.
      assert got["tokens_sum"] == want["tokens_sum"], step
      for key in want:
        if key.startswith(("reward", "frac_reward", "completions/")):
          assert got[key] == pytest.approx(want[key], abs=1e-6), (step, key)
        else:
          # Loss, KL, grad norm, ...: cross-process reductions run in another
          # order than in one process, so float32 round-off only.
          assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    assert m["param_norm"] == pytest.approx(single["param_norm"], rel=1e-5)
  # The steps did something: the policy moved and the loss is not trivially zero.
  assert single["history"][1]["loss"] != 0 and single["history"][0]["reward_std"] > 0
  assert abs(single["param_norm"] - single["param_norm_before"]) > 1e-3
