"""LoRA and QLoRA against full fine-tuning on the device: the update's seconds, and a
decode step's with the adapters merged into the weights or applied at every matmul.

Random weights at a preset's published shapes (bf16 compute), the GSM8K experiment's
loss and optimizer (as bench/device_programs.py builds it), one chip:
  update   `train.step.update` on a random N-row rollout (P prompt, T completion
           tokens, --micro-batches micro-batches), median of --steps after one
           warm-up call; the train state donated and replaced, as the loop does.
  decode   one `transformer.decode_step` of N rows on a prefilled lockstep cache
           (P + T - 1 slots a row), median of --calls after a warm-up:
           - merged: `decode_params` (the run's decode: LoRA's adapters merged into
             the bf16 weights once per generate; a quantised base is never merged)
           - per matmul (lora only): the adapters' two small matmuls at every projection.
Modes: none (full fine-tuning), lora (rank 16, alpha 32, all projections), qlora
(the same over an nf4 base).

  python bench/lora_device.py [--model qwen2.5-0.5b] [--modes none,lora,qlora]
  python bench/lora_device.py --model qwen2_tiny --rows 8 --group 4 --prompt 8 \
      --completion 16 --micro-batches 2 --steps 2 --calls 3 --kernels xla  # the script's own test (CPU)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from grpojax import config as config_lib
from grpojax import models, ops
from grpojax.models import transformer
from grpojax.train import wiring
from grpojax.train.rollout import Rollout
from grpojax.train.state import create_train_state
from grpojax.train.step import update

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# jax is imported (its platforms read) before device_programs' JAX_PLATFORMS=cpu default.
from device_programs import Shapes, _experiment  # noqa: E402


def _median_seconds(fn, n: int) -> float:
  times = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def random_rollout(cfg, key) -> Rollout:
  """A rollout of the experiment's shapes: random tokens, whole masks, N(0, 1)
  advantages and log-probs near a trained policy's (-1 +- 0.1)."""
  r = cfg.rollout
  N, P, T = r.prompts_per_step * r.group_size, r.max_prompt_length, r.max_completion_length
  k1, k2, k3, k4 = jax.random.split(key, 4)
  V = 1000  # any in-vocab ids
  logps = lambda k: -1.0 + 0.1 * jax.random.normal(k, (N, T))  # noqa: E731
  return Rollout(
      prompt_tokens=jax.random.randint(k1, (N, P), 0, V), prompt_mask=jnp.ones((N, P), jnp.int32),
      tokens=jax.random.randint(k2, (N, T), 0, V), mask=jnp.ones((N, T), jnp.int32),
      advantages=jax.random.normal(k3, (N,)),
      old_logps=logps(k4) if wiring.uses_old_logps(cfg) else None,
      ref_logps=logps(k4) if wiring.uses_reference(cfg) else None,
      sampler_logps=logps(k4), zero_std=jnp.zeros((N,), bool))


def measure(mode: str, a) -> dict:
  s = Shapes(a.rows, a.group, a.prompt, a.completion, a.micro_batches)
  cfg = _experiment(a.model, s)
  if mode != "none":
    cfg.model.lora.rank, cfg.model.lora.alpha = 16, 32.0
    cfg.model.lora.quantize = "nf4" if mode == "qlora" else "none"
  model_cfg = ops.resolve(models.get_preset(a.model).replace(dtype="bfloat16", kernels=a.kernels))
  params = transformer.init_params(model_cfg, jax.random.key(0))
  state = create_train_state(model_cfg, params, wiring.optimizer(cfg),
                             with_reference=wiring.uses_reference(cfg),
                             ref_dtype=cfg.model.ref_dtype, lora=config_lib.lora_config(cfg),
                             release=True)
  del params
  row = dict(mode=mode, model=a.model, rows=a.rows, prompt=a.prompt, completion=a.completion,
             micro_batches=a.micro_batches,
             trained=int(sum(x.size for x in jax.tree.leaves(state.params))))
  rollout = random_rollout(cfg, jax.random.key(1))
  kw = wiring.update_settings(cfg, a.micro_batches)
  box = [state]

  def step():
    box[0], metrics = update(box[0], rollout, jax.random.key(2), **kw)
    return metrics

  t = time.perf_counter()
  jax.block_until_ready(step())
  row["update_compile_s"] = time.perf_counter() - t
  row["update_s"] = _median_seconds(step, a.steps)
  state = box[0]
  mcfg, full = state.model_config, state.model_params

  # Decode: one prompt per group, the cache for T - 1 new tokens of N rows.
  B = a.rows // a.group
  tokens = jax.random.randint(jax.random.key(3), (B, a.prompt), 0, 1000)
  prefill = jax.jit(functools.partial(transformer.prefill, mcfg, group=a.group,
                                      max_new_tokens=a.completion - 1))
  last = jnp.zeros((a.rows,), jnp.int32)
  decode = jax.jit(functools.partial(transformer.decode_step, mcfg), donate_argnums=(2,))
  forms = {"merged": jax.jit(functools.partial(transformer.decode_params, mcfg))(full)}
  if mode == "lora":
    per_matmul = dict(full, layers=tuple(transformer._layer_params(mcfg, full, i)
                                         for i in range(mcfg.num_layers)),
                      unembedding=transformer.unembedding(mcfg, full).T)
    forms["per_matmul"] = {k: v for k, v in per_matmul.items()
                           if k not in transformer._layer_names(mcfg, full)}
  calls = min(a.calls, a.completion - 2)
  for name, weights in forms.items():
    # A fresh cache per form: each call fills one of its T - 1 slots.
    box = [prefill(full, tokens, jnp.ones_like(tokens))[1]]

    def one(weights=weights):
      logits, box[0] = decode(weights, last, box[0])
      return logits

    jax.block_until_ready(one())
    row[f"decode_{name}_ms"] = 1e3 * _median_seconds(one, calls)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights))
    row[f"decode_{name}_weight_bytes"] = int(weight_bytes)
  return row


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="qwen2.5-0.5b")
  parser.add_argument("--modes", default="none,lora,qlora")
  parser.add_argument("--rows", type=int, default=64, help="N = prompts x group")
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--completion", type=int, default=512)
  parser.add_argument("--micro-batches", type=int, default=4)
  parser.add_argument("--steps", type=int, default=3, help="timed updates after the first")
  parser.add_argument("--calls", type=int, default=50, help="timed decode steps")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--json", default="", help="also write the rows here")
  a = parser.parse_args(argv)
  rows = []
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {a.model} bf16, N={a.rows}, "
        f"G={a.group}, P={a.prompt}, T={a.completion}, {a.micro_batches} micro-batches",
        flush=True)
  for mode in a.modes.split(","):
    rows.append(measure(mode, a))
    print(json.dumps(rows[-1]), flush=True)
  base = next((r for r in rows if r["mode"] == "none"), None)
  print(f"  {'mode':<6} {'trained':>12} {'update s':>9} {'x full':>7} {'decode ms':>10} "
        f"{'x full':>7} {'per-matmul ms':>14}")
  for r in rows:
    up = r["update_s"] / base["update_s"] if base else float("nan")
    dec = r["decode_merged_ms"] / base["decode_merged_ms"] if base else float("nan")
    pm = r.get("decode_per_matmul_ms")
    print(f"  {r['mode']:<6} {r['trained']:>12,} {r['update_s']:>9.3f} {up:>7.2f} "
          f"{r['decode_merged_ms']:>10.3f} {dec:>7.2f} {'-' if pm is None else f'{pm:.3f}':>14}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
