"""TinyZero: the base model Qwen2.5-3B learns countdown with GRPO, R1-Zero style.

Countdown: reach the target with + - * / using each given number once; the
reward is 1 for a right equation plus 0.1 for the <think>/<answer> format.
Hyperparameters follow TinyZero's scripts/train_tiny_zero.sh (Pan et al.
2025, on veRL) with GRPO in place of PPO.

Setup: download the model once (anything HF-format works), then run:
  huggingface-cli download Qwen/Qwen2.5-3B --local-dir ~/models/Qwen2.5-3B
  python -m grpojax.main --config experiments/countdown_qwen2_5_3b.py --workdir runs/countdown
Elsewhere: --config.model.path=/path/to/Qwen2.5-3B.

Memory: 43 GB of float32 weights, Adam state and bfloat16 reference (XLA's
estimate); one group's update adds 25 GB with per-layer remat. train.micro_batches and model.remat are "auto": at startup the loop fits the
update to the device (train.memory_budget, 90% of its memory), fewest
micro-batches first, remat only if needed; `python -m grpojax.plan --config
experiments/countdown_qwen2_5_3b.py --device h100-80gb` shows the choice before a run.
The rollout's log-probs of 512 rows at once take 178 GB: TinyZero used two
GPUs; here a mesh over several (mesh.shape fsdp=-1 shards it) with row-chunked
log-probs, which the config cannot switch on yet.

Variants: `:smoke` (a tiny random model on a few local rows, for tests).
"""

import os

from grpojax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/Qwen2.5-3B")
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.task.name = "countdown"
  c.task.dataset = "Jiayi-Pan/Countdown-Tasks-3to4"  # TinyZero's data: 3-4 numbers
  # The dataset has one split, "train"; TinyZero's examples/data_preprocess/countdown.py
  # trains on its first 327,680 rows and holds out the next 1,024.
  c.task.train_split = "train[:327680]"
  c.task.eval_split = "train[327680:328704]"
  # TinyZero: 256 prompts per step, prompts up to 256 tokens, responses up to
  # 1024, sampled at temperature 1 (veRL's default). G = 8 as TRL's default
  # (veRL's GRPO examples use 5); 64 prompts keep 512 rollouts per step.
  c.rollout.prompts_per_step = 64
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 256
  c.rollout.max_completion_length = 1024
  c.rollout.temperature = 1.0
  # TinyZero / veRL GRPO: k3 ("low_var_kl") KL loss at 0.001, PPO clip 0.2,
  # token mean over each minibatch ("bnpo", veRL's token-mean).
  c.loss.loss_type = "bnpo"
  c.loss.beta = 0.001
  c.loss.kl_estimator = "k3"
  c.loss.epsilon_low = 0.2
  c.advantage.estimator = "grpo"
  c.optim.learning_rate = 1e-6  # TinyZero
  # TinyZero: minibatches of half the rollout (128 of 256): 2 updates per step
  # (each accumulated over micro-batches as memory needs: train.micro_batches).
  c.train.minibatches = 2
  c.train.num_iterations = 1
  c.train.steps = 500
  c.train.eval_every = 50
  c.train.save_every = 50
  c.eval.num_prompts = 1024  # TinyZero holds out 1,024 problems
  c.eval.batch_size = 256
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "countdown_smoke.jsonl"), max_prompt_length=192)
    c.task.train_split = "train[:2]"  # TinyZero's layout on the 6 smoke rows
    c.task.eval_split = "train[2:]"
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
