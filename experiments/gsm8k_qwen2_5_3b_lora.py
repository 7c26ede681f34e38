"""LoRA: GRPO on GSM8K with Qwen2.5-3B-Instruct on one 16 GB TPU v5e chip or one H100.

The DeepSeekMath recipe of experiments/gsm8k_qwen2_5_0_5b.py (KL 0.04 with the
k3 estimator, per-sequence mean loss, clip 0.2, one update per rollout) at
reasoning length: 16 prompts x 8 samples, 2,048 completion tokens, trained
through rank-16 LoRA adapters on every projection (q, k, v, o, gate, up, down;
alpha 32) over a frozen bfloat16 base. The KL reference is that base with the
adapters off, so no second copy of the weights is kept. Learning rate 1e-5: 10x
full fine-tuning's 1e-6, as "LoRA Without Regret" (Schulman et al., Thinking
Machines 2025) finds LoRA's best rate to be, RL included. The end of the run
writes hf/ as a PEFT adapter directory (model.lora.export_merged also writes the
merged model).

Setup: download the model once (anything HF-format works), then run:
  huggingface-cli download Qwen/Qwen2.5-3B-Instruct --local-dir ~/models/Qwen2.5-3B-Instruct
  python -m grpojax.main --config experiments/gsm8k_qwen2_5_3b_lora.py --workdir runs/gsm8k3b
Elsewhere: --config.model.path=/path/to/Qwen2.5-3B-Instruct.

Memory: the train state is the 3.1B-parameter base in bfloat16 (5.75 GiB) plus
29.9M float32 adapter parameters with their Adam moments (0.33 GiB): 6.08 GiB.
The rollout generates in 4 chunks of 32 rows (rollout.generation_chunks: the KV
cache of 32 rows at 2,304 positions, 2.5 GiB); train.micro_batches and model.remat are "auto" (the
loop fits the update to the device at startup), and eval decodes 32 prompts at
a time.

Planned on a CPU by each device's own compiler (libtpu 0.0.42.1, the CUDA plugin
jax-cuda12-pjrt 0.10.2; no device was lent), at this file's shapes with the update
at its most frugal setting (one group per micro-batch, full remat), which the
run's "auto" fit can only improve on, and without the eval program: the cells
"3B lora" in bench/HISTORY.md (issue 35), whose command is
  python -m grpojax.plan --config experiments/gsm8k_qwen2_5_0_5b.py \
      --config.model.arch=qwen2.5-3b --config.model.path= \
      --config.rollout.prompts_per_step=16 --config.rollout.group_size=8 \
      --config.rollout.max_prompt_length=256 --config.rollout.max_completion_length=2048 \
      --config.rollout.generation_chunks=4 --config.train.micro_batches=16 \
      --config.model.remat=True --config.eval.num_prompts=0 \
      --config.model.lora.rank=16 --device tpu-v5e      (or h100-80gb)
It printed, per device, train state included:
- tpu-v5e (1 chip, 16 GiB): fits; rollout 13.66 GiB, update 12.07 GiB (a57045a).
- h100-80gb (1 GPU, 79.11 GiB): fits; rollout 15.54 GiB, update 12.77 GiB (58432b2).
The rollout is the largest program because decoding merges the adapters into a fused
bfloat16 copy of the weights (models/transformer.py decode_params): one more 5.75 GiB.
Full fine-tuning at the same shape does not fit a v5e (its train state alone is 40.2
GiB) and needs 68.6 GiB of an H100. On this file itself (eval included), the same
check is
  python -m grpojax.plan --config experiments/gsm8k_qwen2_5_3b_lora.py \
      --config.model.path= --config.model.arch=qwen2.5-3b \
      --config.train.micro_batches=16 --config.model.remat=True --device tpu-v5e
(not run for these figures).

Variants: `:smoke` (a tiny random model on a few local rows with rank-4
adapters, for tests).
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def recipe(arg: str | None = None):
  """experiments/gsm8k_qwen2_5_0_5b.py's get_config(arg): the DeepSeekMath GSM8K recipe."""
  spec = importlib.util.spec_from_file_location("gsm8k_qwen2_5_0_5b",
                                                os.path.join(HERE, "gsm8k_qwen2_5_0_5b.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def lora(c, *, rank: int = 16, quantize: str = "none"):
  """Trains through LoRA adapters on every projection over a frozen base (in place)."""
  c.model.lora.rank = rank
  c.model.lora.alpha = 32.0
  c.model.lora.targets = "all"  # every projection: LoRA Without Regret's advice
  c.model.lora.quantize = quantize
  c.optim.learning_rate = 1e-5  # 10x full fine-tuning's
  return c


def reasoning_length(c, model: str):
  """The recipe's model, batch and lengths at reasoning length (in place)."""
  c.model.path = os.path.expanduser(f"~/models/{model}")
  c.rollout.prompts_per_step = 16
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 256
  c.rollout.max_completion_length = 2048
  c.rollout.generation_chunks = 4  # the KV cache of 32 rows at a time
  c.train.steps = 467  # one pass over the 7,473 training questions
  c.eval.batch_size = 32
  return c


def get_config(arg: str | None = None):
  if arg not in (None, "", "smoke"):
    raise ValueError(f"unknown variant {arg!r}; known: smoke")
  if arg == "smoke":  # the recipe's smoke shapes and tiny model, with rank-4 adapters
    return lora(recipe("smoke"), rank=4)
  return lora(reasoning_length(recipe(), "Qwen2.5-3B-Instruct"))
