"""Sampler throughput: grpojax `generate` vs transformers' `generate`, in one run.

Both sample G completions for each of B prompts from the same random 'small'
Llama checkpoint (saved in HF format by this script), forced to full length.
Prints tokens/s of each, their ratio, and the fraction of the machine's
measured matmul peak that our decode reaches.

  python bench/sampler.py            # CPU: B=8, G=8, prompt 32, 64 new tokens
  python bench/sampler.py --rows 64,256,1024 --dtype bfloat16 --qwen  # accelerator
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpojax import models
from grpojax.sampling import sampler

SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=4096, max_position_embeddings=2048)
QWEN_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 max_position_embeddings=4096)


def matmul_peak(dtype=jnp.float32, n=2048, reps=10) -> float:
  """FLOP/s of a large jitted square matmul: the machine's practical peak."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(reps):
    out = f(a)
  out.block_until_ready()
  return 2 * n**3 * reps / (time.perf_counter() - t)


def param_count(model) -> int:
  return sum(int(np.prod(a.shape)) for a in model.param_dict().values())


def ours_fn(model, prompts, mask, groups, new_tokens):
  """A callable that runs one `generate` (compiled here) and returns its seconds."""
  kw = dict(num_samples=groups, max_new_tokens=new_tokens, temperature=1.0,
            eos_ids=model.config.vocab_size, pad_id=0)  # an id never sampled: full length
  sampler.generate(model, prompts, mask, rng=jax.random.key(0), **kw).tokens.block_until_ready()
  seed = iter(range(1, 1 << 30))

  def run() -> float:
    t = time.perf_counter()
    out = sampler.generate(model, prompts, mask, rng=jax.random.key(next(seed)), **kw)
    out.tokens.block_until_ready()
    elapsed = time.perf_counter() - t
    assert int(out.lengths.min()) == new_tokens
    return elapsed

  return run


def hf_fn(path, prompts, groups, new_tokens, threads, *, device="cpu", dtype="float32"):
  """The same for transformers' `generate` (torch on `device` in `dtype`, with `threads`
  CPU threads)."""
  import torch
  import transformers

  torch.set_num_threads(threads)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
  hf = hf.to(device).eval()
  ids = torch.tensor(np.asarray(prompts), dtype=torch.long, device=device)
  # CUDA runs asynchronously: the call has ended when the device is done with it.
  sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
  kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=groups,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
  with torch.no_grad():
    hf.generate(ids[:1], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})

  def run() -> float:
    with torch.no_grad():
      t = time.perf_counter()
      out = hf.generate(ids, **kw)
      sync()
      elapsed = time.perf_counter() - t
    assert out.shape == (ids.shape[0] * groups, ids.shape[1] + new_tokens)
    return elapsed

  return run


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--groups", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--reps", type=int, default=4, help="timed runs of each; the best is reported")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--qwen", action="store_true", help="Qwen2.5-0.5B shapes instead of 'small'")
  p.add_argument("--rows", default="", help="accelerator sweep: comma-separated B*G, ours only")
  a = p.parse_args()

  import transformers  # only to write the HF-format checkpoint both sides load
  import torch

  torch.manual_seed(0)
  shape = QWEN_0_5B if a.qwen else SMALL
  cfg = (transformers.Qwen2Config if a.qwen else transformers.LlamaConfig)(**shape)
  hf = transformers.AutoModelForCausalLM.from_config(cfg)
  with tempfile.TemporaryDirectory() as path:
    hf.save_pretrained(path)
    del hf
    model = models.from_pretrained(path, dtype=a.dtype)
    n_params = param_count(model)
    peak = matmul_peak(jnp.dtype(a.dtype))
    print(f"devices: {jax.devices()}; params {n_params / 1e6:.1f}M; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s ({a.dtype})")
    rng = np.random.default_rng(0)
    sweeps = [int(r) for r in a.rows.split(",")] if a.rows else [a.prompts * a.groups]
    for rows in sweeps:
      b = max(rows // a.groups, 1)
      prompts = jnp.asarray(rng.integers(1, shape["vocab_size"], (b, a.prompt_len)), jnp.int32)
      mask = jnp.ones_like(prompts)
      run_ours = ours_fn(model, prompts, mask, a.groups, a.new_tokens)
      if a.rows:
        ours = min(run_ours() for _ in range(a.reps))
      else:
        # Alternate the two frameworks' runs so that a slow phase of a shared
        # machine falls on both alike; the best run of each.
        run_hf = hf_fn(path, prompts, a.groups, a.new_tokens, a.threads)
        times = [(run_ours(), run_hf()) for _ in range(a.reps)]
        ours, theirs = min(t[0] for t in times), min(t[1] for t in times)
        print("runs (grpojax, transformers): " + ", ".join(f"({o:.2f}, {h:.2f})" for o, h in times))
      tokens = b * a.groups * a.new_tokens
      # Decode FLOPs: 2 per parameter per token (attention over <100 positions is small).
      util = 2 * n_params * tokens / ours / peak
      line = (f"rows {b * a.groups}: grpojax {tokens / ours:,.0f} tok/s "
              f"({ours:.2f} s, {util:.1%} of matmul peak)")
      if not a.rows:
        line += (f"; transformers {tokens / theirs:,.0f} tok/s ({theirs:.2f} s); "
                 f"ratio {theirs / ours:.2f}x")
      print(line, flush=True)


if __name__ == "__main__":
  main()
