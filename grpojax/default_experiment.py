"""The embedded default: a tiny decoder learns addition from scratch on a CPU.

`python -m grpojax.main` with no --config runs this file (also as
experiments/arithmetic_tiny.py); it ships inside the package, so the main
command works from any install, editable or not.

A character tokenizer, a 2-layer model built from scratch (~100k parameters), a
short supervised warm start on reference answers (it stops at ~10-20% held-out
accuracy), then GRPO on exact-answer rewards, which raises greedy accuracy by
well over 15 points (README has the seeds). `python -m grpojax.main` runs this
with no flags; about 7 minutes on 2 free CPU cores.

Why these values: 2-digit addition is within a 2-layer model's reach but not
learnt by 300 supervised steps; 32 prompts x 8 samples per step keeps the
policy gradient's noise low enough for lr 1e-4 (3e-4 was noisier, not faster),
and GRPO's gain keeps growing up to 2,000 steps.

Variants: `:smoke` (a few steps, for tests).
"""

from grpojax import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.arch = "tiny"
  c.task.name = "arithmetic"
  c.task.dataset = "arithmetic:2:+"
  c.rollout.prompts_per_step = 32
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 8
  c.rollout.max_completion_length = 6
  c.rollout.temperature = 1.0
  c.loss.loss_type = "dapo"
  c.loss.epsilon_high = 0.28
  c.optim.learning_rate = 1e-4
  c.optim.warmup_steps = 5
  c.train.steps = 2000
  c.train.eval_every = 500
  c.train.save_every = 500
  c.sft.steps = 300
  c.sft.learning_rate = 3e-3
  c.sft.batch_size = 64
  c.eval.num_prompts = 256
  c.eval.batch_size = 128
  c.eval.k = 4
  if arg == "smoke":
    c.rollout.prompts_per_step = 8
    c.train.steps = 4
    c.train.eval_every = 2
    c.train.save_every = 2
    c.sft.steps = 4
    c.eval.num_prompts = 16
    c.eval.batch_size = 16
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
