"""Sampling throughput: grpojax `generate` against transformers' `generate`, in one run.

Both sample G completions for each of B prompts from the same random HF checkpoint
(written by the run, loaded by each framework), forced to full length (an EOS id
outside the vocabulary), temperature 1, their runs alternating so that a slow
phase of a shared machine falls on both alike; the best of --reps each. Prints
tokens/s of each and their ratio (transformers' seconds / ours: > 1 is faster),
each one's share of the HBM roofline (the bytes a decode step must move, the same
floor for both, over the copy bandwidth measured in the same run) and ours of the
matmul peak (2 FLOPs per parameter per token).

Settings by --device: cpu, the 27.8M-parameter 'small' Llama in float32, 8 x 8
rows, P=32, T=64, torch on --threads 2; gpu, Qwen2.5-0.5B's shapes in bf16 at
16 x 8 and 64 x 8 rows, P=128, T=256, torch on the same GPU (tpu: ours alone);
--quick, a 2-layer model, 2 x 4 rows, P=8, T=8.
"""

from __future__ import annotations

import tempfile
import time

import common

common.share_gpu_with_torch()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpojax import models  # noqa: E402
from grpojax.sampling import sampler  # noqa: E402

# (rows = B x G list, G, P, T, reps) by setting.
SETTINGS = {"quick": ("8", 4, 8, 8, 1), "cpu": ("64", 8, 32, 64, 4),
            "gpu": ("128,512", 8, 128, 256, 3), "tpu": ("128,512", 8, 128, 256, 3)}


def add_arguments(parser) -> None:
  parser.add_argument("--rows", help="rows (B x G) of each run, comma-separated")
  parser.add_argument("--groups", type=int, help="G samples per prompt")
  parser.add_argument("--prompt-len", type=int, help="P")
  parser.add_argument("--new-tokens", type=int, help="T, forced")
  parser.add_argument("--reps", type=int, help="alternating timed runs; the best of each counts")
  parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
  parser.add_argument("--no-peer", action="store_true", help="time grpojax alone")


def ours_fn(model, prompts, mask, groups: int, new_tokens: int):
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


def hf_fn(path: str, prompts, groups: int, new_tokens: int, threads: int, *, device: str,
          dtype: str):
  """The same for transformers' `generate` (torch on `device` in `dtype`)."""
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


def run(args) -> dict:
  rows_list, G, P, T, reps = SETTINGS["quick" if args.quick else args.device]
  rows_list = [int(r) for r in (args.rows or rows_list).split(",")]
  G, P, T = args.groups or G, args.prompt_len or P, args.new_tokens or T
  reps = args.reps or reps
  name, shape = common.shape_for(args)
  device, dtype = common.peer_device(args.device)
  peer = not args.no_peer and device is not None
  out = dict(model=name, dtype=dtype, G=G, P=P, T=T, runs=[])
  with tempfile.TemporaryDirectory() as path:
    common.write_checkpoint(path, shape)
    model = models.from_pretrained(path, dtype=dtype)
    n_params = common.param_count(model.param_dict())
    flops_peak, bandwidth = common.ceilings(args.quick, jnp.dtype(dtype))
    out.update(params=n_params, matmul_peak_flops=flops_peak, bandwidth_bytes_per_s=bandwidth)
    print(f"{jax.devices()[0].device_kind}: {name} model, {n_params / 1e6:.1f}M params in "
          f"{dtype}; matmul peak {flops_peak / 1e9:,.0f} GFLOP/s, copy {bandwidth / 1e9:,.0f} "
          f"GB/s; G={G}, P={P}, T={T}" + (f", torch on {device}" if peer else ""), flush=True)
    rng = np.random.default_rng(0)
    for rows in rows_list:
      B = max(rows // G, 1)
      # Ids from 1: transformers infers its attention mask from the pad id, 0.
      prompts = jnp.asarray(rng.integers(1, shape["vocab_size"], (B, P)), jnp.int32)
      run_ours = ours_fn(model, prompts, jnp.ones_like(prompts), G, T)
      run_hf = (hf_fn(path, prompts, G, T, args.threads, device=device, dtype=dtype)
                if peer else None)
      times = [(run_ours(), run_hf() if peer else None) for _ in range(reps)]
      del run_hf  # its model, before the next one loads
      ours = min(t[0] for t in times)
      tokens = B * G * T
      # The same floor for both: what the task must move, however a framework does it
      # (transformers repeats each prompt's cache G times; grpojax does not).
      floor_s = T * common.decode_floor_bytes(n_params, model.config, B, G, P, T,
                                              jnp.dtype(dtype).itemsize) / bandwidth
      r = dict(rows=B * G, grpojax_tok_s=tokens / ours, grpojax_s=ours,
               grpojax_hbm_roofline=floor_s / ours,
               grpojax_matmul_share=2 * n_params * tokens / ours / flops_peak)
      line = (f"rows {B * G}: grpojax {r['grpojax_tok_s']:,.0f} tok/s ({ours:.2f} s, "
              f"{r['grpojax_hbm_roofline']:.1%} of the HBM roofline, "
              f"{r['grpojax_matmul_share']:.1%} of the matmul peak)")
      if peer:
        theirs = min(t[1] for t in times)
        r.update(transformers_tok_s=tokens / theirs, transformers_s=theirs,
                 transformers_hbm_roofline=floor_s / theirs, ratio=theirs / ours)
        line += (f"; transformers {r['transformers_tok_s']:,.0f} tok/s ({theirs:.2f} s, "
                 f"{r['transformers_hbm_roofline']:.1%}); ratio {r['ratio']:.2f}x")
      print(line, flush=True)
      out["runs"].append(r)
  return out
