"""A workdir remembers its run's config: resuming it under a config that changes
what a step computes stops at startup with one line naming the keys; cadence keys
may change; an explicit flag continues anyway."""

import json
import os
import subprocess
import sys

import pytest

from grpojax import config as config_lib
from grpojax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_train_loop import tiny_config  # noqa: E402

BASE = {"sft.steps": 0, "eval.num_prompts": 0}


def test_resume_differences_names_the_training_keys_only():
  before = config_lib.get_config()
  now = config_lib.get_config()
  now.train.seed, now.loss.beta, now.train.steps, now.eval.num_prompts = 1, 0.04, 7, 3
  previous = json.loads(json.dumps(before.to_dict(), default=str))  # as config.json holds it
  assert config_lib.resume_differences(previous, now) == [
      "loss.beta (0.0 -> 0.04)", "train.seed (0 -> 1)"]
  assert config_lib.resume_differences(previous, before) == []


@pytest.mark.slow
def test_a_changed_seed_stops_the_resume_and_cadence_does_not(tmp_path):
  workdir = str(tmp_path / "w")
  loop.train(tiny_config(2, **BASE), workdir)
  with pytest.raises(config_lib.ConfigError) as err:
    loop.train(tiny_config(3, **BASE, **{"train.seed": 1}), workdir)
  message = str(err.value)
  assert "train.seed (0 -> 1)" in message and "--config.train.allow_config_change=True" in message
  assert "\n" not in message and "train.steps" not in message
  # Only the cadence changes: the run resumes from step 2.
  out = loop.train(tiny_config(3, **BASE, **{"train.save_every": 1}), workdir)
  assert out["step"] == 3
  # The explicit flag continues a changed run.
  out = loop.train(tiny_config(4, **BASE, **{"train.seed": 1,
                                             "train.allow_config_change": True}), workdir)
  assert out["step"] == 4


@pytest.mark.slow
def test_the_cli_says_it_in_one_line(tmp_path):
  workdir = str(tmp_path / "w")
  loop.train(tiny_config(1, **BASE), workdir)  # the smoke config the CLI runs below, 1 step
  cfg = os.path.join(ROOT, "experiments", "arithmetic_tiny.py") + ":smoke"
  proc = subprocess.run(
      [sys.executable, "-m", "grpojax.main", f"--config={cfg}", "--config.train.seed=5",
       "--config.sft.steps=0", "--config.eval.num_prompts=0", "--config.train.steps=1",
       "--config.rollout.prompts_per_step=4", "--config.rollout.group_size=4",
       "--config.train.eval_every=2", "--config.train.save_every=2", f"--workdir={workdir}"],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert proc.returncode == 1, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "train.seed (0 -> 5)" in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
