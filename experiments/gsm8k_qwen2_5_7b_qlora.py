"""QLoRA: GRPO on GSM8K with Qwen2.5-7B-Instruct on one H100, or (`:v5e`) one 16 GB TPU v5e.

experiments/gsm8k_qwen2_5_3b_lora.py (the DeepSeekMath GSM8K recipe at 2,048
completion tokens, 16 prompts x 8 samples, rank-16 adapters on every
projection, alpha 32, lr 1e-5) with the 7B model, whose frozen base is stored
as QLoRA's 4-bit NormalFloat (model.lora.quantize="nf4"; Dettmers et al. 2023):
half a byte per weight plus a float32 scale per block of 64, dequantised to
bfloat16 one layer at a time at each matmul. Its bfloat16 base alone (14.2
GiB) would leave a v5e nothing for activations; in nf4 the 6.5B quantised
weights take 3.4 GiB, beside 2.0 GiB of bfloat16 embeddings and output head and
0.45 GiB of adapters (40.4M) with their Adam moments: 5.90 GiB in all. The KL
reference is the quantised base with the adapters off.

Setup: download the model once (anything HF-format works; quantised on load), then run:
  huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir ~/models/Qwen2.5-7B-Instruct
  python -m grpojax.main --config experiments/gsm8k_qwen2_5_7b_qlora.py --workdir runs/gsm8k7b
Elsewhere: --config.model.path=/path/to/Qwen2.5-7B-Instruct.

Memory: train.micro_batches and model.remat are "auto" (the loop fits the
update to the device at startup); the rollout generates in 4 chunks of 32 rows
and eval decodes 32 prompts at a time. Planned on a CPU by each device's own
compiler (libtpu 0.0.42.1, the CUDA plugin jax-cuda12-pjrt 0.10.2; no device was
lent), with the update at its most frugal setting (one group per micro-batch,
full remat), which the run's "auto" fit can only improve on:
- h100-80gb (1 GPU, 79.11 GiB), this file's shapes without eval: fits; rollout
  13.25 GiB, update 15.48 GiB per device (58432b2; the cell "7B qlora-nf4" of
  bench/HISTORY.md issue 35, whose command is
  `python -m grpojax.plan --config experiments/gsm8k_qwen2_5_0_5b.py
  --config.model.arch=qwen2.5-7b --config.model.path= --config.rollout.prompts_per_step=16
  --config.rollout.group_size=8 --config.rollout.max_prompt_length=256
  --config.rollout.max_completion_length=2048 --config.rollout.generation_chunks=4
  --config.train.micro_batches=16 --config.model.remat=True --config.eval.num_prompts=0
  --config.model.lora.rank=16 --config.model.lora.quantize=nf4 --device h100-80gb`).
- tpu-v5e (1 chip, 16 GiB) at 2,048 tokens (the same command, --device tpu-v5e):
  does not fit; the TPU's compiler refuses the rollout (>= 16.11 GiB) and the
  update (>= 16.91 GiB).
- tpu-v5e, the `:v5e` variant (1,024 completion tokens), eval included:
    python -m grpojax.plan --config experiments/gsm8k_qwen2_5_7b_qlora.py:v5e \
        --config.model.path= --config.model.arch=qwen2.5-7b \
        --config.train.micro_batches=16 --config.model.remat=True --device tpu-v5e
  printed (5b53e44): fits; load (start-up) 10.63 GiB, rollout 14.33 GiB,
  update 13.73 GiB (within the run's 14.4 GiB budget), eval 11.83 GiB per device,
  train state 5.90 GiB: tight, 1.7 GiB to spare.
Start-up: the base is quantised as it is read (hf.load_params), one stacked weight at a
time, each bfloat16 original freed before the next is read, so the bf16 base (14.19
GiB) never exists whole. The planner's "load" is the largest weight's quantiser
(w_gate: 6.18 GiB) beside the rest of the quantised base (4.45 GiB).

Variants: `:v5e` (1,024 completion tokens: what one TPU v5e chip's programs fit),
`:smoke` (a tiny random model on a few local rows with rank-4 adapters over an
nf4 base, for tests).
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _lora_3b():
  """experiments/gsm8k_qwen2_5_3b_lora.py: the recipe and its LoRA settings."""
  spec = importlib.util.spec_from_file_location("gsm8k_qwen2_5_3b_lora",
                                                os.path.join(HERE, "gsm8k_qwen2_5_3b_lora.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg: str | None = None):
  if arg not in (None, "", "smoke", "v5e"):
    raise ValueError(f"unknown variant {arg!r}; known: smoke, v5e")
  m = _lora_3b()
  if arg == "smoke":  # the recipe's smoke shapes and tiny model, rank 4 over nf4
    return m.lora(m.recipe("smoke"), rank=4, quantize="nf4")
  c = m.lora(m.reasoning_length(m.recipe(), "Qwen2.5-7B-Instruct"), quantize="nf4")
  if arg == "v5e":  # at 2,048 tokens one group's update needs >= 16.9 GiB on a v5e
    c.rollout.max_completion_length = 1024
  return c
