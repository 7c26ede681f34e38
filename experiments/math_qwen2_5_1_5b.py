"""Dr. GRPO, R1-Zero style, on MATH with the base model Qwen2.5-Math-1.5B.

The recipe of "Understanding R1-Zero-Like Training" (Liu et al. 2025, the
Oat-Zero-1.5B run): no std scaling of advantages, a constant length
normaliser, no KL, trained on the 12k MATH problems outside MATH-500.

Setup: download the model once (anything HF-format works), then run:
  huggingface-cli download Qwen/Qwen2.5-Math-1.5B --local-dir ~/models/Qwen2.5-Math-1.5B
  python -m grpojax.main --config experiments/math_qwen2_5_1_5b.py --workdir runs/math
Elsewhere: --config.model.path=/path/to/Qwen2.5-Math-1.5B.

Memory: 19 GB of float32 weights and Adam state (XLA's estimate); one group's
update adds 14 GB with per-layer remat, 160 GB without. train.micro_batches and model.remat are "auto": at startup the loop fits the
update to the device (train.memory_budget, 90% of its memory), fewest
micro-batches first, remat only if needed; `python -m grpojax.plan --config
experiments/math_qwen2_5_1_5b.py --device h100-80gb` shows the choice before a run.
The rollout's log-probs of 256 rows at once take 95 GB, so one 80 GB GPU also
needs them in row chunks, which the config cannot switch on yet.

Variants: `:smoke` (a tiny random model on a few local rows, for tests).
"""

import os

from grpojax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/Qwen2.5-Math-1.5B")
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.task.name = "math"
  # problem/solution/answer; 12k train, and MATH-500 as test. The math task's
  # own splits are MATH-500's only one, "test", for both: train on "train" here.
  c.task.dataset = "nlile/hendrycks-MATH-benchmark"
  c.task.train_split = "train"
  c.task.eval_split = "test"
  # Dr. GRPO: 8 samples per problem at temperature 1, top-p 1, 128 problems per
  # rollout (32 here, for one GPU), prompts up to 1024 tokens and answers up to
  # 3000 (here 512 and DeepSeekMath's 1024, again for one GPU).
  c.rollout.prompts_per_step = 32
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 512
  c.rollout.max_completion_length = 1024
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  # Dr. GRPO: advantages r - mean (no std); token sums divided by a constant,
  # loss.max_completion_length (None: the completion length T); beta 0; clip 0.2.
  c.advantage.estimator = "dr_grpo"
  c.loss.loss_type = "dr_grpo"
  c.loss.beta = 0.0
  c.loss.epsilon_low = 0.2
  c.optim.learning_rate = 1e-6  # Dr. GRPO and DeepSeekMath, constant
  # Dr. GRPO: 128-sample minibatches, one epoch: 2 updates per rollout here
  # (each accumulated over micro-batches as memory needs: train.micro_batches).
  c.train.minibatches = 2
  c.train.num_iterations = 1
  c.train.steps = 375  # one pass over the 12,000 training problems
  c.train.eval_every = 25
  c.train.save_every = 25
  c.eval.num_prompts = 500  # MATH-500, greedy (Dr. GRPO evaluates at temperature 0)
  c.eval.batch_size = 100
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "math_smoke.jsonl"), max_prompt_length=128)
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
