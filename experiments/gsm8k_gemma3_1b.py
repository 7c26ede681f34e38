"""GRPO as in DeepSeekMath on GSM8K with Gemma 3 1B (instruction-tuned).

Gemma 3 is where many Colab TPU users start: 1B parameters, five sliding-window
layers (512 tokens) to each global one, tied embeddings over a 262k vocabulary.
Its windows and per-layer RoPE run on the XLA attention path (docs/architecture.md):
the Pallas kernels take neither yet.

Setup: download the model once (a gated model: accept its licence on the Hub first),
then run:
  huggingface-cli download google/gemma-3-1b-it --local-dir ~/models/gemma-3-1b-it
  python -m grpojax.main --config experiments/gsm8k_gemma3_1b.py --workdir runs/gemma
Elsewhere: --config.model.path=/path/to/gemma-3-1b-it.

Memory: train.micro_batches and model.remat are "auto", fitted at startup to the
device. Planned at Gemma 3 1B's shapes by a TPU v5e's own compiler (libtpu on a
2-core CPU VM, 2026-12-03, commit 26dc486; no weights needed):
  python -m grpojax.plan --config experiments/gsm8k_gemma3_1b.py[:v5e] \
      --config.model.arch=gemma-3-1b --config.model.path= --device tpu-v5e
- full fine-tuning does not fit one 16 GiB v5e chip: the train state alone (float32
  weights and Adam moments, the bfloat16 reference) is 13.04 GiB, and the update
  needs >= 22.8 GiB even at micro_batches=32 with remat;
- `:v5e`, rank-16 LoRA on every projection (lr 1e-5), fits: state 2.01 GiB, the
  update 12.38 GiB at micro_batches=32, remat=dots; the rollout 8.08 GiB.

Variants: `:v5e` (LoRA, for one TPU v5e chip: Colab's), `:smoke` (a tiny random
Gemma 3, gemma3_tiny: a sliding and a global layer, on a few local rows, for tests).
"""

import importlib.util
import os

from grpojax import config as config_lib

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")


def _lora(c):
  """experiments/gsm8k_qwen2_5_3b_lora.py's LoRA settings (rank 16, every projection,
  lr 1e-5), in place."""
  spec = importlib.util.spec_from_file_location("gsm8k_qwen2_5_3b_lora",
                                                os.path.join(HERE, "gsm8k_qwen2_5_3b_lora.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.lora(c)


def get_config(arg: str | None = None):
  c = config_lib.get_config()
  c.model.path = os.path.expanduser("~/models/gemma-3-1b-it")
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32
  c.task.name = "gsm8k"
  c.task.dataset = "openai/gsm8k:main"
  # DeepSeekMath's recipe, as experiments/gsm8k_qwen2_5_0_5b.py: 32 prompts x 8
  # samples, KL 0.04 (k3), per-sequence mean loss, clip 0.2, lr 1e-6, one update
  # per rollout.
  c.rollout.prompts_per_step = 32
  c.rollout.group_size = 8
  c.rollout.max_prompt_length = 256
  # Prompt and answer together pass the 512-token window: the sliding layers' mask cuts.
  c.rollout.max_completion_length = 512
  c.rollout.temperature = 1.0
  c.loss.loss_type = "grpo"
  c.loss.beta = 0.04
  c.loss.kl_estimator = "k3"
  c.loss.epsilon_low = 0.2
  c.advantage.estimator = "grpo"
  c.advantage.scale = "group"
  c.optim.learning_rate = 1e-6
  c.train.minibatches = 1
  c.train.num_iterations = 1
  c.train.steps = 233  # one pass over the 7,473 training questions
  c.train.eval_every = 50
  c.train.save_every = 50
  c.eval.num_prompts = 1319  # the whole test split, greedy
  c.eval.batch_size = 128
  if arg == "smoke":
    config_lib.smoke(c, os.path.join(DATA, "gsm8k_smoke.jsonl"), max_prompt_length=128)
    c.model.arch = "gemma3_tiny"  # its 8-token window cuts the smoke's prompts
  elif arg == "v5e":
    _lora(c)
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; known: v5e, smoke")
  return c
