"""Tool-integrated reasoning: GRPO on MATH with Qwen2.5-1.5B-Instruct calling Python.

The policy may write a call to the built-in Python tool in Qwen2.5's tool format
(`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`); the
rollout engine pauses that row, runs the code in the sandbox (an interpreter per
completion, its state kept across the completion's calls), feeds the output back as
the template's tool turn, and the row answers on. Only the model's own tokens are
trained (docs/rollout.md, "Tool turns"). The reward is the math task's verifier on
the completion's last answer.

Setup: download the model once (anything HF-format whose chat template renders
tools works), then run:
  huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir ~/models/Qwen2.5-1.5B-Instruct
  python -m grpojax.main --config experiments/math_tools_qwen2_5_1_5b.py --workdir runs/tools
Elsewhere: --config.model.path=/path/to/Qwen2.5-1.5B-Instruct.

Variants: `:smoke` (a tiny random model with a tokenizer that speaks Qwen2.5's tool
format, on a few local rows, for tests).
"""

import os

from grpojax import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/Qwen2.5-1.5B-Instruct")
  c.model.dtype = "bfloat16"
  c.task.name = "math"
  c.task.dataset = "nlile/hendrycks-MATH-benchmark"
  c.task.train_split = "train"
  c.task.eval_split = "test"
  c.rollout.prompts_per_step = 32
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 768  # the question and the tool's schema
  # Room for a few calls: each turn's code, its output (up to tool_response_tokens)
  # and the answer.
  c.rollout.max_completion_length = 2048
  c.rollout.temperature = 1.0
  c.rollout.tools = "grpojax.tools:PythonTool"
  c.rollout.max_tool_calling_iterations = 4
  c.rollout.tool_response_tokens = 256
  c.advantage.estimator = "dr_grpo"
  c.loss.loss_type = "dr_grpo"
  c.loss.beta = 0.0
  c.optim.learning_rate = 1e-6
  c.train.minibatches = 2
  c.train.steps = 375
  c.train.eval_every = 25
  c.train.save_every = 25
  c.eval.num_prompts = 500
  c.eval.batch_size = 100
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "math_smoke.jsonl"), max_prompt_length=640)
    c.model.tokenizer = os.path.join(DATA, "tool_tokenizer")
    c.rollout.max_completion_length = 96  # a tool turn of this tokenizer is ~35 tokens
    c.rollout.tool_response_tokens = 48
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  return c
