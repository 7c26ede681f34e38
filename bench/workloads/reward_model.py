"""What a reward model adds to a GRPO step: seconds per step of the default experiment with its verifier alone (the peer) and with a reward model of the policy's own shape added, scored on the device inside the rollout.

Both arms are the embedded default experiment (no SFT, no eval) set up as the
command line sets it up (train/loop.py's `setup`), in one process, taking turns
step by step (rollout, then update, each waited for) for --steps steps: whatever
else the machine runs slows both alike. The second adds `rewards.models` with a
randomly initialised sequence classifier (the policy's preset with a score head,
the character tokenizer) reading each completion with its prompt,
`rewards.model_max_length` the prompt and completion lengths. The figure is the
lower quartile of the step seconds after the first (which compiles) and the ratio
of the two arms'; medians, the rollout's and the update's, and the host's reward
time (decoding, verifying, and tokenizing for the reward model) beside it.
--quick: 3 steps of the `:smoke` variant.
"""

from __future__ import annotations

import os
import shutil
import time
import tempfile

import numpy as np


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser) -> None:
  parser.add_argument("--steps", type=int, default=40, help="steps of each arm")


def _reward_model(path: str, cfg) -> str:
  """A random sequence classifier of the policy's preset, saved with the char tokenizer."""
  from grpojax import models
  from grpojax.models.tokenizers import CharTokenizer

  rm = models.build_model(cfg.model.arch, head="score", num_labels=1, seed=1, pad_token_id=0)
  models.save_pretrained(rm, path, tokenizer=CharTokenizer())
  return path


def _setup(cfg, workdir: str, extra: dict):
  """The run's Run (train/loop.py's setup) with `extra` config values."""
  from grpojax import config as config_lib
  from grpojax.train import loop

  cfg = config_lib.apply(cfg, {"sft.steps": 0, "eval.num_prompts": 0, "train.loggers": "",
                               **extra})
  return loop.setup(config_lib.validate(cfg), workdir)


def _step(job, key) -> tuple[float, float, dict]:
  """One GRPO step of `job` (rollout, then update), waited for: (rollout s, update s,
  the rollout's metrics)."""
  import jax

  from grpojax.train.step import update

  t0 = time.perf_counter()
  rollout, metrics = job.strategy(job.state, job.source, key)
  jax.block_until_ready(rollout)
  t1 = time.perf_counter()
  job.state, _ = update(job.state, rollout, key, **job.update_kw)
  jax.block_until_ready(job.state)
  return t1 - t0, time.perf_counter() - t1, metrics


def run(args) -> dict:
  import jax

  from grpojax import default_experiment

  steps = 3 if args.quick else args.steps
  if steps < 2:
    raise SystemExit("--steps >= 2 (the first compiles)")
  cfg = default_experiment.get_config("smoke" if args.quick else None)
  length = cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length
  root = tempfile.mkdtemp(prefix="grpojax-reward-model-")
  figures = {"steps": steps, "model_max_length": length}
  try:
    rm = _reward_model(os.path.join(root, "rm"), cfg)
    arms = {"verifier": {}, "verifier+rm": {"rewards.models": rm,
                                            "rewards.model_max_length": length}}
    jobs = {name: _setup(cfg, os.path.join(root, name.replace("+", "_")), extra)
            for name, extra in arms.items()}
    times = {name: {"rollout": [], "update": [], "reward": []} for name in arms}
    # The arms take turns step by step, in one process: whatever else the machine runs
    # then slows both alike (one run after the other put a busy spell on one side).
    for i in range(steps):
      key = jax.random.key(i)
      for name, job in jobs.items():
        reward_s0 = job.host.seconds
        rollout_s, update_s, metrics = _step(job, key)
        if i:  # the first step compiles
          times[name]["rollout"].append(rollout_s)
          times[name]["update"].append(update_s)
          times[name]["reward"].append(job.host.seconds - reward_s0)
        if name == "verifier+rm":
          figures["rm_scored"] = "rewards/rm/mean" in metrics
    for name, t in times.items():
      step_s = np.add(t["rollout"], t["update"])
      figures[f"{name}_step_s"] = float(np.quantile(step_s, 0.25))
      figures[f"{name}_median_step_s"] = float(np.median(step_s))
      figures[f"{name}_rollout_s"] = float(np.median(t["rollout"]))
      figures[f"{name}_update_s"] = float(np.median(t["update"]))
      figures[f"{name}_reward_s"] = float(np.median(t["reward"]))
      print(f"{name}: {figures[f'{name}_step_s']:.3f} s per step (lower quartile of "
            f"{len(step_s)}; median {figures[f'{name}_median_step_s']:.3f} s: rollout "
            f"{figures[f'{name}_rollout_s']:.3f}, update {figures[f'{name}_update_s']:.3f}, "
            f"host reward time {figures[f'{name}_reward_s']:.4f} s)", flush=True)
    for job in jobs.values():
      job.host.close()
      job.ckpt.close()
  finally:
    shutil.rmtree(root, ignore_errors=True)
  figures["step_ratio"] = figures["verifier+rm_step_s"] / figures["verifier_step_s"]
  figures["median_ratio"] = (figures["verifier+rm_median_step_s"]
                             / figures["verifier_median_step_s"])
  print(f"with a reward model of the policy's shape: {figures['step_ratio']:.3f}x the seconds "
        f"per step ({100 * (figures['step_ratio'] - 1):+.1f}%; medians "
        f"{figures['median_ratio']:.3f}x)", flush=True)
  return figures
