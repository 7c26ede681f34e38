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

HERE = os.path.dirname(os.path.abspath(__file__))


def _experiment(name: str):
  """The module experiments/<name>.py."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg: str | None = None):
  if arg not in (None, "", "smoke", "v5e"):
    raise ValueError(f"unknown variant {arg!r}; known: v5e, smoke")
  # DeepSeekMath's GSM8K recipe as experiments/gsm8k_qwen2_5_0_5b.py holds it: 32
  # prompts x 8 samples, KL 0.04 (k3), per-sequence mean loss, clip 0.2, lr 1e-6, one
  # update per rollout; 256 + 512 tokens, past the sliding layers' 512-token window.
  c = _experiment("gsm8k_qwen2_5_0_5b").get_config("smoke" if arg == "smoke" else None)
  if arg == "smoke":
    c.model.arch = "gemma3_tiny"  # its 8-token window cuts the smoke's prompts
    return c
  c.model.path = os.path.expanduser("~/models/gemma-3-1b-it")
  if arg == "v5e":  # rank 16 on every projection, lr 1e-5 (LoRA Without Regret)
    _experiment("gsm8k_qwen2_5_3b_lora").lora(c)
  return c
