"""SIGKILL at random moments, then the same command again: does every run resume exactly?

Not collected by pytest (tests/test_train_faults.py kills at fixed moments: mid-save,
mid-export). `python tests/kill_trials.py TRIALS [SEED]` runs the CLI on a 6-step
arithmetic run saving every step: once uninterrupted, then per trial twice killed with
SIGKILL at a uniform random time between 3 s and the uninterrupted run's length (a
kill that comes after its run ended is a miss), then run to the end. A trial resumed
exactly when its metrics (wall clocks aside) equal the uninterrupted run's value for
value and its HF export byte for byte. Prints a line a trial and the counts.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=experiments/arithmetic_tiny.py:smoke", "--config.train.steps=6",
        "--config.train.save_every=1", "--config.train.eval_every=2", "--config.sft.steps=0",
        "--config.eval.num_prompts=8", "--config.eval.batch_size=8", "--config.eval.k=0",
        "--config.rollout.prompts_per_step=4", "--config.rollout.group_size=4"]
TIMING = ("time/", "step_time")


def run(workdir: str, kill_after: float | None = None):
  """The CLI on `workdir`: its exit status, or "killed"."""
  with open(f"{workdir}.err", "a") as err:
    proc = subprocess.Popen([sys.executable, "-m", "grpojax.main", f"--workdir={workdir}", *ARGS],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
      return proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      return "killed"


def rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in f]


def export(workdir: str) -> bytes:
  with open(os.path.join(workdir, "hf", "model.safetensors"), "rb") as f:
    return f.read()


def main(trials: int, seed: int = 0) -> None:
  base = tempfile.mkdtemp(prefix="kill-trials-")
  start = time.monotonic()
  assert run(f"{base}/straight") == 0, f"the uninterrupted run failed: {base}/straight.err"
  length = time.monotonic() - start
  print(f"uninterrupted: {length:.0f} s", flush=True)
  want, want_hf = rows(f"{base}/straight"), export(f"{base}/straight")
  rng = random.Random(seed)
  landed = exact = 0
  for i in range(trials):
    workdir, kills = f"{base}/t{i}", []
    for _ in range(2):
      at = rng.uniform(3, length)
      if run(workdir, at) == "killed":
        kills.append(round(at, 1))
    status = run(workdir)
    ok = status == 0 and rows(workdir) == want and export(workdir) == want_hf
    landed, exact = landed + len(kills), exact + ok
    print(f"trial {i}: killed at {kills} s, then exit {status}, exact: {ok}", flush=True)
  print(f"{trials} trials, {2 * trials} kills planned, {landed} landed, {exact} resumed exactly, "
        f"{trials - exact} lost")
  shutil.rmtree(base)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
