"""What a reward model adds to a GRPO step: seconds per step of the default experiment with its verifier alone (the peer) and with a reward model of the policy's own shape added, scored on the device inside the rollout.

Both runs are `python -m grpojax.main` (the embedded default experiment, no SFT, no
eval) for --steps steps; the second adds `rewards.models` with a randomly initialised
sequence classifier (the policy's preset with a score head, the character
tokenizer) reading each completion with its prompt, `rewards.model_max_length` the
prompt and completion lengths. The figure is the lower quartile of `step_time` over
the steps after the first (which compiles), the steps least slowed by whatever else
the machine runs (a shared VM's step times vary 2x within a run), and the ratio of
the two; the medians and `time/reward` (the host's share: decoding, and tokenizing
for the reward model) are reported beside it. --quick: 3 steps of the `:smoke` variant.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

import numpy as np

import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser) -> None:
  parser.add_argument("--steps", type=int, default=30)


def _reward_model(path: str, cfg) -> str:
  """A random sequence classifier of the policy's preset, saved with the char tokenizer."""
  from grpojax import models
  from grpojax.models.tokenizers import CharTokenizer

  rm = models.build_model(cfg.model.arch, head="score", num_labels=1, seed=1, pad_token_id=0)
  models.save_pretrained(rm, path, tokenizer=CharTokenizer())
  return path


def one_run(workdir: str, steps: int, quick: bool, extra: list[str]) -> dict:
  """The command line on `workdir` to the end: its wall seconds and metrics rows."""
  out = common.run_main(workdir, [
      f"--config.train.steps={steps}", "--config.sft.steps=0", "--config.eval.num_prompts=0",
      "--config.train.log_every=1", f"--config.train.save_every={steps}", *extra], quick=quick)
  return {"wall_s": out["wall_s"], "rows": [r for r in out["rows"] if r["step"] >= 1]}


def run(args) -> dict:
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
    arms = {"verifier": [], "verifier+rm": [f"--config.rewards.models={rm}",
                                            f"--config.rewards.model_max_length={length}"]}
    for name, extra in arms.items():
      out = one_run(os.path.join(root, name.replace("+", "_")), steps, args.quick, extra)
      rows = out["rows"][1:]
      times = [r["step_time"] for r in rows]
      figures[f"{name}_step_s"] = float(np.quantile(times, 0.25))
      figures[f"{name}_median_step_s"] = statistics.median(times)
      figures[f"{name}_reward_s"] = statistics.median(r["time/reward"] for r in rows)
      print(f"{name}: {figures[f'{name}_step_s']:.3f} s per step after the first (lower "
            f"quartile; median {figures[f'{name}_median_step_s']:.3f} s; host reward time "
            f"{figures[f'{name}_reward_s']:.4f} s), {out['wall_s']:.0f} s in all", flush=True)
    figures["rm_scored"] = "rewards/rm/mean" in out["rows"][-1]
  finally:
    shutil.rmtree(root, ignore_errors=True)
  figures["step_ratio"] = figures["verifier+rm_step_s"] / figures["verifier_step_s"]
  print(f"with a reward model of the policy's shape: {figures['step_ratio']:.3f}x the seconds "
        f"per step ({100 * (figures['step_ratio'] - 1):+.1f}%)", flush=True)
  return figures
