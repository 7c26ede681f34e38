"""The hardware's ceilings and how near grpojax runs to them: decode against the HBM
roofline, the update's MFU, and the planner's peak memory against the device's own count.

On random weights built in memory (bf16 compute over float32 master weights on an
accelerator), in one process:
  - the ceilings, measured in the same run: the matmul FLOP/s of the compute dtype
    and the copy bandwidth (bytes read + written a second);
  - the update (`train.step.update`: dapo, beta 0.04, one minibatch, AdamW) on a
    random rollout of B x G rows: compiled through `grpojax.plan.measure`, whose peak
    (arguments + outputs + temporaries - aliased, what the planner fits to the
    budget) is set against the device's `peak_bytes_in_use` over the first call,
    less what was resident beside the program's arguments (GPUs and TPUs; a CPU
    keeps no count); then timed, MFU = 6 x params x trained positions (B·P prompt +
    N·T completion: each group's prompt runs once) over the matmul peak, recompute
    under remat not counted;
  - `generate` at each --rows, forced to full length: tokens/s and its share of the
    HBM roofline, the bytes a decode step must move over the copy bandwidth.

Settings by --device: gpu and tpu, Qwen2.5-0.5B's shapes in bf16, 128 and 512 rows
(G=8), P=128, T=256, the update on 16 x 8 rows; cpu, the 'small' Llama in float32,
64 rows, P=32, T=64, the update on 4 x 8; --quick, the 'tiny' preset, 8 rows, P=16,
T=8, the update on 2 x 4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import common
from grpojax import models, plan
from grpojax.core import losses
from grpojax.sampling import sampler
from grpojax.train import rollout as rollout_lib
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib

# (model, dtype, generate rows, G, P, T, update prompts B, reps) by setting.
SETTINGS = {"quick": ("tiny", "float32", "8", 4, 16, 8, 2, 1),
            "cpu": ("small", "float32", "64", 8, 32, 64, 4, 2),
            "gpu": ("qwen2.5-0.5b", "bfloat16", "128,512", 8, 128, 256, 16, 3),
            "tpu": ("qwen2.5-0.5b", "bfloat16", "128,512", 8, 128, 256, 16, 3)}


def add_arguments(parser) -> None:
  parser.add_argument("--rows", help="generate's rows (B x G), comma-separated")
  parser.add_argument("--prompts", type=int, help="the update's B prompts")
  parser.add_argument("--remat", action="store_true", help="per-layer remat in the update")
  parser.add_argument("--reps", type=int, help="timed calls of each; the best counts")


def memory_stats() -> dict:
  """The first device's allocator counts ({} where it keeps none, as a CPU)."""
  try:
    return jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 -- backends without memory stats
    return {}


def update_figures(model, B: int, G: int, P: int, T: int, reps: int, flops_peak: float) -> dict:
  """The update's planned and measured peak, seconds and MFU (see the docstring)."""
  cfg = model.config
  N = B * G
  rng = np.random.default_rng(0)
  state = state_lib.create_train_state(cfg, model.param_dict(), optax.adamw(1e-6),
                                       with_reference=False)
  prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, P)), jnp.int32)
  rollout = rollout_lib.Rollout(
      prompt_tokens=jnp.repeat(prompt, G, axis=0), prompt_mask=jnp.ones((N, P), jnp.int32),
      tokens=jnp.asarray(rng.integers(1, cfg.vocab_size, (N, T)), jnp.int32),
      mask=jnp.ones((N, T), jnp.int32), advantages=jnp.asarray(rng.normal(size=N), jnp.float32),
      ref_logps=jnp.zeros((N, T), jnp.float32))
  key = jax.random.key(0)
  kw = dict(loss_config=losses.LossConfig(loss_type="dapo", beta=0.04), group_size=G)
  planned, _, compiled = plan.measure(lambda: step_lib.update.lower(state, rollout, key, **kw))
  before = memory_stats()
  box = [state]  # each call donates it and returns the next

  def call():
    box[0], metrics = compiled(box[0], rollout, key)
    return metrics

  jax.block_until_ready(call())
  after = memory_stats()
  measured = None
  if after.get("peak_bytes_in_use", 0) > before.get("peak_bytes_in_use", 0):
    # What stayed resident beside the program's own arguments (the model's weights,
    # buffers not yet freed) is not the program's.
    beside = before["bytes_in_use"] - planned["argument_bytes"]
    measured = after["peak_bytes_in_use"] - beside
  seconds = common.best_seconds(call, reps)
  n_params = common.param_count(model.param_dict())
  useful = 6 * n_params * (B * P + N * T)
  return dict(update_rows=N, update_s=seconds, update_mfu=useful / seconds / flops_peak,
              planned_peak_bytes=planned["peak_bytes"], measured_peak_bytes=measured,
              planned_vs_measured=None if measured is None else planned["peak_bytes"] / measured)


def run(args) -> dict:
  name, dtype, rows, G, P, T, B, reps = SETTINGS["quick" if args.quick else args.device]
  rows, B, reps = args.rows or rows, args.prompts or B, args.reps or reps
  model = models.build_model(common.model_config(name, dtype).replace(remat=args.remat), seed=0)
  n_params = common.param_count(model.param_dict())
  flops_peak, bandwidth = common.ceilings(args.quick, jnp.dtype(dtype))
  out = dict(model=name, dtype=dtype, params=n_params, G=G, P=P, T=T, remat=args.remat,
             matmul_peak_flops=flops_peak, bandwidth_bytes_per_s=bandwidth)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {name}, {n_params / 1e6:.1f}M "
        f"params in {dtype}; matmul {flops_peak / 1e12:.2f} TFLOP/s; copy "
        f"{bandwidth / 1e9:,.0f} GB/s", flush=True)
  # First, while nothing else has raised the device's peak.
  out.update(update_figures(model, B, G, P, T, reps, flops_peak))
  measured = out["measured_peak_bytes"]
  print(f"update {B}x{G} rows, P={P}, T={T}, remat {args.remat}: {out['update_s']:.3f} s, MFU "
        f"{out['update_mfu']:.1%}; peak: planned {out['planned_peak_bytes'] / 2**30:.3f} GiB, "
        + ("no device count here" if measured is None else
           f"measured {measured / 2**30:.3f} GiB ({out['planned_vs_measured']:.3f}x)"),
        flush=True)
  rng = np.random.default_rng(1)
  out["generate"] = []
  for n in [int(r) for r in rows.split(",")]:
    b = max(n // G, 1)
    prompts = jnp.asarray(rng.integers(1, model.config.vocab_size, (b, P)), jnp.int32)
    kw = dict(num_samples=G, max_new_tokens=T, temperature=1.0,
              eos_ids=model.config.vocab_size, pad_id=0)  # never sampled: full length
    seconds = common.best_seconds(lambda: sampler.generate(  # noqa: B023
        model, prompts, jnp.ones_like(prompts), rng=jax.random.key(1), **kw).tokens, reps)
    floor = common.decode_floor_bytes(n_params, model.config, b, G, P, T, jnp.dtype(dtype).itemsize)
    r = dict(rows=b * G, tok_s=b * G * T / seconds, ms_per_step=1e3 * seconds / T,
             hbm_roofline=floor / bandwidth / (seconds / T), floor_bytes_per_step=floor)
    out["generate"].append(r)
    print(f"generate {b}x{G} rows, P={P}, T={T}: {r['tok_s']:,.0f} tok/s, {r['ms_per_step']:.2f} "
          f"ms/step, {r['hbm_roofline']:.1%} of the HBM roofline ({floor / 1e9:.3f} GB/step)",
          flush=True)
  return out
