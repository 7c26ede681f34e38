"""DAPO-style GRPO on MBPP with Qwen2.5-Coder-1.5B-Instruct and the sandbox.

Each completion's ```python block runs against the problem's asserts in the
sandbox (grpojax.sandbox); the reward is 1 if all pass. The recipe is
DAPO's (Yu et al. 2025): clip-higher, token-level loss, no KL, dynamic
sampling and the soft overlong punishment.

Setup: download the model once (anything HF-format works), then run:
  huggingface-cli download Qwen/Qwen2.5-Coder-1.5B-Instruct --local-dir ~/models/Qwen2.5-Coder-1.5B-Instruct
  python -m grpojax.main --config experiments/code_qwen2_5_coder.py --workdir runs/code
Elsewhere: --config.model.path=/path/to/Qwen2.5-Coder-1.5B-Instruct.

Memory: 19 GB of float32 weights and Adam state, plus 46 GB for the rollout's
log-probs of 256 rows, or 16 GB for one group's update with per-layer remat
(XLA's estimates): one 80 GB GPU. train.micro_batches and model.remat are "auto": at startup the loop fits the
update to the device (train.memory_budget, 90% of its memory), fewest
micro-batches first, remat only if needed; `python -m grpojax.plan --config
experiments/code_qwen2_5_coder.py --device h100-80gb` shows the choice before a run.

Variants: `:smoke` (a tiny random model on a few local rows, for tests).
"""

import os

from grpojax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/Qwen2.5-Coder-1.5B-Instruct")
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.task.name = "code"
  c.task.dataset = "google-research-datasets/mbpp"  # "full": 374 train, 500 test problems
  # DAPO: 16 samples per prompt at temperature 1, top-p 1. MBPP is small, so
  # 16 prompts per step (DAPO: 512) make an epoch 23 steps.
  c.rollout.prompts_per_step = 16
  c.rollout.group_size = 16
  c.rollout.max_prompt_length = 512  # problem, three asserts, chat template
  c.rollout.max_completion_length = 512  # MBPP functions are a few lines
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  # DAPO: dynamic sampling, training only on groups whose rewards differ.
  c.rollout.dynamic_sampling = True
  # DAPO: soft overlong punishment over the last 4,096 of 20,480 tokens; the
  # same fifth of this config's 512.
  c.rewards.overlong_buffer = c.rollout.max_completion_length // 5
  # DAPO: clip-higher (0.2 / 0.28), token-level loss over the whole generation
  # batch ("dapo"), no KL term and so no reference model.
  c.loss.loss_type = "dapo"
  c.loss.epsilon_low = 0.2
  c.loss.epsilon_high = 0.28
  c.loss.beta = 0.0
  c.advantage.estimator = "grpo"
  # DAPO: AdamW at a constant 1e-6 after a linear warmup of 20 rollout steps;
  # weight decay 0.1 (as in veRL, DAPO's framework).
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 20
  c.optim.weight_decay = 0.1
  # DAPO: 16 optimizer steps per rollout (minibatches of 1/16 of it): the
  # off-policy steps that clip-higher is about. Here one prompt's group each.
  c.train.minibatches = 16
  c.train.num_iterations = 1
  c.train.steps = 230  # 10 epochs of MBPP's 374 training problems
  c.train.eval_every = 23
  c.train.save_every = 23
  c.eval.num_prompts = 500  # MBPP test, greedy
  c.eval.batch_size = 100
  c.rewards.num_workers = 8  # sandboxed runs in parallel: 256 programs per step
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "code_smoke.jsonl"), max_prompt_length=256)
    c.rewards.overlong_buffer = 2  # on, so the smoke run scores it
    c.train.minibatches = 2
    c.optim.warmup_steps = 1
    c.rewards.num_workers = 0
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
