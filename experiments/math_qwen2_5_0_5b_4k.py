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
update fitted to micro-batches and remat ("auto"), and the rollout runs the
paged engine (`rollout.engine`): decode slots, a slot taking the next row as
soon as its row ends, over a KV pool of pages, both sized by the planner to
the memory budget (`rollout.kv_pages="auto"`, `rollout.decode_slots="auto"`:
on a v5e 4,352 pages and 136 slots). The planner's figures for it are in
bench/RESULTS.md ("An experiment at reasoning length", "The rollout engine").

Variants: `:smoke` (a tiny random model on a few local rows, for tests; its
attention runs blockwise and its rollout on the paged engine, with a pool small
enough that rows are restarted).
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _recipe():
  """experiments/math_qwen2_5_1_5b.py's get_config: the Dr. GRPO recipe on MATH."""
  spec = importlib.util.spec_from_file_location("math_qwen2_5_1_5b",
                                                os.path.join(HERE, "math_qwen2_5_1_5b.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config


def get_config(arg: str | None = None):
  if arg not in (None, "", "smoke"):
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  # Dr. GRPO on MATH as there: 32 x 8 rows at temperature 1, advantages r - mean,
  # a constant normaliser, no KL, lr 1e-6, two updates per rollout.
  c = _recipe()(arg or None)
  # The rollout engine: rows decode in slots, each slot taking the next row when
  # its row ends, and the KV pool holds the live tokens only.
  c.rollout.engine = "paged"
  if arg == "smoke":  # the recipe's smoke shapes; long-sequence paths on
    c.model.attention_block = 32  # P + T = 136 keys: blockwise, as at 4k
    c.rollout.decode_slots = 4
    c.rollout.page_size = 16
    c.rollout.kv_pages = 24  # 3 rows at full length: 4 slots preempt
    return c
  c.model.path = os.path.expanduser("~/models/Qwen2.5-0.5B-Instruct")
  c.rollout.max_prompt_length = 512
  c.rollout.max_completion_length = 4096
  # "auto": the pool the memory budget leaves, and as many slots as it holds rows
  # at full length, so no row is ever restarted (grpojax.plan.fit_engine).
  c.rollout.decode_slots = "auto"
  c.rollout.kv_pages = "auto"
  c.loss.mask_truncated_completions = True  # DAPO: no loss on answers cut at T
  c.eval.batch_size = 50
  return c
