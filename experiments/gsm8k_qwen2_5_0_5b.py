"""GRPO as in DeepSeekMath on GSM8K with Qwen2.5-0.5B-Instruct.

Setup: download the model once (anything HF-format works), then run:
  huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir ~/models/Qwen2.5-0.5B-Instruct
  python -m grpojax.main --config experiments/gsm8k_qwen2_5_0_5b.py --workdir runs/gsm8k
Elsewhere: --config.model.path=/path/to/Qwen2.5-0.5B-Instruct.

Memory: train.micro_batches and model.remat are "auto": at startup the loop fits
the update to the device (train.memory_budget, 90% of its memory), fewest
micro-batches first, remat only if needed; `python -m grpojax.plan --config
experiments/gsm8k_qwen2_5_0_5b.py --device h100-80gb` shows the choice before a
run. Planned at Qwen2.5-0.5B's shapes by each device's own compiler (docs/speed.md's
table, `bench/run.py plan_figures`):
[plan-figures] h100-80gb (1 device): fits, micro_batches=16, remat=False, update 44.77
GiB per device; tpu-v5e (1 device): fits, micro_batches=32, remat=dots, update 13.10 GiB
per device. [/plan-figures]

Variants: `:smoke` (a tiny random model on a few local rows, for tests).
"""

import os

from grpojax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/Qwen2.5-0.5B-Instruct")
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.task.name = "gsm8k"
  c.task.dataset = "openai/gsm8k:main"  # the "main" subset (the other is "socratic")
  # 32 prompts x 8 = 256 completions per step. DeepSeekMath: batches of 1024,
  # 64 samples per question; G = 8 is TRL's default and Dr. GRPO's, and fits one GPU.
  c.rollout.prompts_per_step = 32
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 256  # GSM8K questions in the chat template
  c.rollout.max_completion_length = 512  # DeepSeekMath: 1024; GSM8K solutions are short
  c.rollout.temperature = 1.0  # TRL's default; DAPO samples at 1.0 too
  # DeepSeekMath (Shao et al. 2024, sec. 4.2): KL 0.04 with the k3 estimator,
  # per-sequence mean loss ("grpo"), lr 1e-6, one update per rollout; clip 0.2
  # as PPO and TRL.
  c.loss.loss_type = "grpo"
  c.loss.beta = 0.04
  c.loss.kl_estimator = "k3"
  c.loss.epsilon_low = 0.2
  c.advantage.estimator = "grpo"
  c.advantage.scale = "group"
  c.optim.learning_rate = 1e-6
  # One optimizer update per rollout (DeepSeekMath): one minibatch, whose
  # gradient train.micro_batches="auto" accumulates over as many micro-batches
  # as the device's memory needs (the whole batch's gradient either way).
  c.train.minibatches = 1
  c.train.num_iterations = 1
  c.train.steps = 233  # one pass over the 7,473 training questions
  c.train.eval_every = 50
  c.train.save_every = 50
  c.eval.num_prompts = 1319  # the whole test split, greedy
  c.eval.batch_size = 128
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "gsm8k_smoke.jsonl"), max_prompt_length=128)
    c.train.micro_batches = 2  # the accumulation path runs in the smoke test too
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
