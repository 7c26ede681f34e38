"""How far QLoRA's quantised base moves a real model's logits: int8 and nf4 against the
float32 model, on SmolLM2-135M-Instruct (bash ../shared/models/smollm2.sh /tmp/smollm2).

Prints, for bf16 weights and compute, then for each quantiser (float32 compute, so the
quantiser's error alone): the logits' relative RMS error, top-1 agreement with the
float32 model and KL(float32 || quantised) per token, on four short texts; and the
quantiser's relative weight error e = ||W - Q(W)|| / ||W|| over the seven projections.

  python bench/quant_error.py --model /tmp/smollm2
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer

from grpojax import models
from grpojax.models import lora as lora_lib
from grpojax.models import transformer as T

TEXTS = [
    "The quick brown fox jumps over the lazy dog because it was in a hurry to get home.",
    "What is 37 + 48? Answer: 37 + 48 = 85. What is 12 * 7? Answer: 12 * 7 = 84. What is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib",
    "Paris is the capital of France, Berlin is the capital of Germany, and Madrid is the",
]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="an HF-format model directory")
  a = parser.parse_args()
  model = models.from_pretrained(a.model, dtype="float32")
  cfg, params = model.config, model.param_dict()
  tokenizer = AutoTokenizer.from_pretrained(a.model)
  ids = [tokenizer(t)["input_ids"] for t in TEXTS]
  n = min(len(i) for i in ids)
  tokens = jnp.array([i[:n] for i in ids])
  logits = jax.jit(lambda c, p, t: T.unembed(c, p, T.forward(c, p, t)), static_argnums=0)
  base = np.asarray(logits(cfg, params, tokens))

  def report(name, other, extra=""):
    rel = np.sqrt(np.mean((other - base) ** 2)) / np.sqrt(np.mean(base**2))
    top1 = np.mean(other.argmax(-1) == base.argmax(-1))
    lp, lq = jax.nn.log_softmax(base), jax.nn.log_softmax(other)
    kl = float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))
    print(f"{name:<22} logits rel RMS {rel:.4f}  top-1 {top1:.3f}  KL {kl:.4f}{extra}")

  bf16 = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
  report("bf16 weights+compute", np.asarray(logits(cfg.replace(dtype="bfloat16"), bf16, tokens)))
  for kind in ("int8", "nf4"):
    frozen = lora_lib.frozen_base(params, lora_lib.LoraConfig(rank=1, quantize=kind), "float32")
    names = lora_lib.TARGETS.values()
    err = sum(float(jnp.sum((frozen[w].dequantize(jnp.float32) - params[w]) ** 2)) for w in names)
    e = np.sqrt(err / sum(float(jnp.sum(params[w] ** 2)) for w in names))
    report(f"{kind} base", np.asarray(logits(cfg, frozen, tokens)), f"  (weights: e = {e:.4f})")


if __name__ == "__main__":
  main()
