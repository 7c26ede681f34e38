"""The command line as a new user meets it: user code loads by itself (--import, and a
--config file's sibling modules), a mistyped override is one line, and the main
command works from a non-editable install (the default experiment ships in the package)."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOSSES = '''
import jax
import jax.numpy as jnp
import grpojax


@grpojax.register_loss("clipped_reinforce", aggregation="global_token_mean")
def clipped_reinforce(x, config):
  weight = jax.lax.stop_gradient(jnp.minimum(x.ratio, 1.0 + config.eps_high))
  return -weight * x.advantages * x.logps
'''

CONFIG = '''
from grpojax import default_experiment
import steps_here  # a module next to this file


def get_config(arg=None):
  c = default_experiment.get_config("smoke")
  c.train.steps = steps_here.STEPS
  c.sft.steps = 0
  c.eval.num_prompts = 0
  return c
'''


def _main(args, cwd, **kw):
  return subprocess.run([sys.executable, "-m", "grpojax.main", *args], capture_output=True,
                        text=True, timeout=600, cwd=cwd, **kw)


@pytest.mark.slow
def test_user_modules_load_and_register_before_the_config_is_checked(tmp_path):
  code = tmp_path / "mine"
  code.mkdir()
  (code / "my_losses.py").write_text(LOSSES)
  (code / "steps_here.py").write_text("STEPS = 2\n")
  (code / "my_config.py").write_text(CONFIG)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  args = [f"--config={code / 'my_config.py'}", "--config.loss.loss_type=clipped_reinforce",
          f"--workdir={tmp_path / 'run'}"]
  # Without --import the loss is unknown: one line, before anything compiles.
  proc = _main(args, cwd=elsewhere)
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
  assert "loss.loss_type='clipped_reinforce' is unknown" in proc.stderr
  # With it (found next to the config file, run from another directory): trains.
  proc = _main([*args, "--import=my_losses"], cwd=elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert os.path.isfile(tmp_path / "run" / "hf" / "config.json")


@pytest.mark.slow
def test_a_mistyped_override_is_one_line(tmp_path):
  for flag, words in [("--config.train.stepz=5", 'Did you mean "steps"'),
                      ("--config.train.steps=abc", "invalid literal"),
                      ("--import=no_such_module", "No module named 'no_such_module'")]:
    proc = _main([flag, f"--workdir={tmp_path}"], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr[-1500:]


@pytest.mark.slow
def test_the_main_command_works_from_a_non_editable_install(tmp_path):
  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                  "--target", str(site), ROOT], check=True, capture_output=True, timeout=300)
  env = dict(os.environ, PYTHONPATH=str(site))
  probe = textwrap.dedent("""
      import os, grpojax.main as m
      assert m.__file__.startswith(os.environ["PYTHONPATH"]), m.__file__
      assert os.path.isfile(m._DEFAULT), m._DEFAULT
      print(m._DEFAULT)
  """)
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  # The default experiment parses and validates from there (a full run is the README's job).
  proc = _main(["--config.train.steps=0", f"--workdir={tmp_path / 'w'}"], cwd=tmp_path, env=env)
  assert "train.steps=0 must be >= 1" in proc.stderr, proc.stderr[-2000:]


def test_without_config_another_task_starts_from_the_defaults():
  """The embedded experiment's settings (lr 1e-4, 8-token prompts, 300 SFT steps) are
  for its arithmetic task; naming another task starts from grpojax.config's defaults."""
  from grpojax import config as config_lib
  from grpojax import main

  assert main._base(["main"])[0] == main._base(["main", "--config.task.name=arithmetic"])[0]
  assert main._base(["main"])[0].endswith("default_experiment.py")
  for argv in (["main", "--config.task.name=prompt"], ["main", "--config.task.name", "gsm8k"]):
    path, said = main._base(argv)
    assert path == config_lib.__file__ and "grpojax's defaults" in said


def _prompt_task(tmp_path, *args):
  """The prompt task from the command line, stopped by the rollout beside the update with
  dynamic sampling: the settings' last check, so everything before it (the config
  chosen, the SFT decision, every other check) has run."""
  data = tmp_path / "data.jsonl"
  data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  return _main([*args, "--config.task.name=prompt", f"--config.task.dataset={data}",
                "--config.rewards.functions=trl.rewards:think_format_reward",
                "--config.parallel.rollout_devices=1", "--config.rollout.dynamic_sampling=True",
                f"--workdir={tmp_path / 'run'}"], cwd=tmp_path)


@pytest.mark.slow
def test_the_first_line_says_which_config_and_a_tasks_missing_sft_is_skipped(tmp_path):
  proc = _prompt_task(tmp_path)
  assert "config: grpojax's defaults (docs/configuration.md)" in proc.stdout
  assert proc.stderr.strip().splitlines()[-1].startswith("config: parallel.rollout_devices="), proc.stderr
  experiment = os.path.join(ROOT, "experiments", "arithmetic_tiny.py")
  proc = _prompt_task(tmp_path, f"--config={experiment}")  # sets sft.steps=300
  assert f"config: {experiment}" in proc.stdout
  assert "sft.steps=300 (the experiment's) skipped: task 'prompt' has no SFT target" in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("config: parallel.rollout_devices="), proc.stderr
  proc = _prompt_task(tmp_path, f"--config={experiment}", "--config.sft.steps=5")  # the user's
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      "config: sft.steps=5 is a warm start on reference completions, which task 'prompt' "
      "does not have: set sft.steps=0")
