"""Reasoning length: Dr. GRPO on MATH with Qwen2.5-0.5B-Instruct and 4,096-token answers.

The recipe of experiments/math_qwen2_5_1_5b.py (Liu et al. 2025, "Understanding
R1-Zero-Like Training": advantages without std scaling, a constant length
normaliser, no KL) at the length reasoning runs train at: Dr. GRPO itself
allows 3,000 answer tokens, DeepScaleR starts at 8k. Its constant normaliser
gives long and short answers the same per-token weight, which is what a 4k
budget needs; answers cut at 4,096 tokens get no loss (DAPO's overlong
filtering), so a truncated chain of thought is not pushed either way.

Setup: download the model once (anything HF-format works), then run:
  huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir ~/models/Qwen2.5-0.5B-Instruct
  python -m grpojax.main --config experiments/math_qwen2_5_0_5b_4k.py --workdir runs/math4k
Elsewhere: --config.model.path=/path/to/Qwen2.5-0.5B-Instruct.

Memory: planned for one TPU v5e (16 GB) and one H100 with
`python -m grpojax.plan --config experiments/math_qwen2_5_0_5b_4k.py
--config.model.path= --config.model.arch=qwen2.5-0.5b --device tpu-v5e` (or
h100-80gb): full-sequence attention over 4,608 positions is blockwise
(`model.attention_block`: the Pallas kernels on one TPU chip or a GPU), the
update fitted to micro-batches and remat ("auto"), and the rollout generates in
4 chunks of 8 prompts (`rollout.generation_chunks`), holding 64 rows' KV cache at
a time. The planner's figures for it are in bench/RESULTS.md ("An experiment
at reasoning length").

Variants: `:smoke` (a tiny random model on a few local rows, for tests; its
attention runs blockwise and its rollout in two chunks, as the full run's do).
"""

import os

from grpojax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/Qwen2.5-0.5B-Instruct")
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.task.name = "math"
  # problem/solution/answer; 12k train, and MATH-500 as test.
  c.task.dataset = "nlile/hendrycks-MATH-benchmark"
  c.task.train_split = "train"
  c.task.eval_split = "test"
  # Dr. GRPO: 8 samples per problem at temperature 1, top-p 1; 32 problems per
  # rollout (Dr. GRPO: 128) for one device; answers up to 4,096 tokens.
  c.rollout.prompts_per_step = 32
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 512
  c.rollout.max_completion_length = 4096
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.generation_chunks = 4  # 64 rows' KV cache at a time
  # Dr. GRPO: advantages r - mean (no std); token sums divided by a constant
  # (loss.max_completion_length, None: T); beta 0; clip 0.2.
  c.advantage.estimator = "dr_grpo"
  c.loss.loss_type = "dr_grpo"
  c.loss.beta = 0.0
  c.loss.epsilon_low = 0.2
  c.loss.mask_truncated_completions = True  # DAPO: no loss on answers cut at T
  c.optim.learning_rate = 1e-6  # Dr. GRPO and DeepSeekMath, constant
  # Dr. GRPO: 128-sample minibatches, one epoch: 2 updates per rollout.
  c.train.minibatches = 2
  c.train.num_iterations = 1
  c.train.steps = 375  # one pass over the 12,000 training problems
  c.train.eval_every = 25
  c.train.save_every = 25
  c.eval.num_prompts = 500  # MATH-500, greedy
  c.eval.batch_size = 50
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "math_smoke.jsonl"), max_prompt_length=128)
    c.model.attention_block = 32  # P + T = 136 keys: blockwise, as at 4k
    c.rollout.generation_chunks = 2
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
