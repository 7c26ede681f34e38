"""LoRA and QLoRA against full fine-tuning: the update's seconds, and a decode step's with
the adapters merged into the weights or applied at every matmul.

Random weights at a preset's published shapes (bf16 compute), the GSM8K
experiment's loss and optimizer (as the device_programs workload builds it), one chip:
  update   `train.step.update` on a random N-row rollout (P prompt, T completion
           tokens, --micro-batches micro-batches), median of --steps after one
           warm-up call; the train state donated and replaced, as the loop does.
  decode   one `decode_step` of N rows on a prefilled lockstep cache (P + T - 1
           slots a row), median of --calls after a warm-up:
           - merged: `decode_params` (the run's decode: LoRA's adapters merged into
             the bf16 weights once per generate; a quantised base is never merged);
           - per matmul (lora only): the adapters' two small matmuls at every projection.
Modes: none (full fine-tuning), lora (rank 16, alpha 32, all projections), qlora
(the same over an nf4 base). The ratios are each mode's against full fine-tuning's.

Settings by --device: gpu and tpu, Qwen2.5-0.5B, N=64 (G=8), P=128, T=512, 4
micro-batches, 3 steps, 50 decode calls; cpu and --quick, qwen2_tiny, N=8 (G=4),
P=8, T=16, 2 micro-batches, 2 steps, 3 calls, XLA's kernels. --dry-run: each mode's
programs traced, none compiled or run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import common
from grpojax import models, ops
from grpojax.models import transformer
from grpojax.run import settings as settings_lib
from grpojax.train import wiring
from grpojax.train.rollout import Rollout
from grpojax.train.state import create_train_state
from grpojax.train.step import update
from workloads.device_programs import Shapes, experiment

# (model, rows, group, prompt, completion, micro-batches, steps, calls, kernels) by setting.
SMALL = ("qwen2_tiny", 8, 4, 8, 16, 2, 2, 3, "xla")
SETTINGS = {"quick": SMALL, "cpu": SMALL,
            "gpu": ("qwen2.5-0.5b", 64, 8, 128, 512, 4, 3, 50, "auto")}
SETTINGS["tpu"] = SETTINGS["gpu"]


def add_arguments(parser) -> None:
  parser.add_argument("--model", help="a grpojax.models preset")
  parser.add_argument("--modes", default="none,lora,qlora")


def random_rollout(run: settings_lib.Settings, key) -> Rollout:
  """A rollout of the experiment's shapes: random tokens, whole masks, N(0, 1)
  advantages and log-probs near a trained policy's (-1 +- 0.1)."""
  r = run.rollout
  N, P, T = r.prompts_per_step * r.group_size, r.max_prompt_length, r.max_completion_length
  k1, k2, k3, k4 = jax.random.split(key, 4)
  V = 100  # ids every preset's vocabulary holds
  logps = lambda k: -1.0 + 0.1 * jax.random.normal(k, (N, T))  # noqa: E731
  return Rollout(
      prompt_tokens=jax.random.randint(k1, (N, P), 0, V), prompt_mask=jnp.ones((N, P), jnp.int32),
      tokens=jax.random.randint(k2, (N, T), 0, V), mask=jnp.ones((N, T), jnp.int32),
      advantages=jax.random.normal(k3, (N,)),
      old_logps=logps(k4) if run.uses_old_logps else None,
      ref_logps=logps(k4) if run.uses_reference else None,
      sampler_logps=logps(k4), zero_std=jnp.zeros((N,), bool))


class Mode:
  """One mode's train state, random rollout, update settings and decode programs."""

  def __init__(self, mode: str, model: str, s: Shapes, kernels: str):
    cfg = experiment(model, s)
    if mode != "none":
      cfg.model.lora.rank, cfg.model.lora.alpha = 16, 32.0
      cfg.model.lora.quantize = "nf4" if mode == "qlora" else "none"
    model_cfg = ops.resolve(models.get_preset(model).replace(dtype="bfloat16", kernels=kernels))
    params = transformer.init_params(model_cfg, jax.random.key(0))
    run = settings_lib.read(cfg)
    self.state = create_train_state(model_cfg, params, wiring.optimizer(run),
                                    with_reference=run.uses_reference,
                                    ref_dtype=run.model.ref_dtype, lora=run.model.lora,
                                    release=True)
    del params
    self.mode, self.s = mode, s
    self.rollout = random_rollout(run, jax.random.key(1))
    self.kw = wiring.update_settings(run, s.micro_batches)
    mcfg = self.state.model_config
    # Decode: one prompt per group, the cache for T - 1 new tokens of N rows.
    self.tokens = jax.random.randint(jax.random.key(3), (s.prompts, s.prompt), 0, 100)
    self.prefill = jax.jit(functools.partial(transformer.prefill, mcfg, group=s.group,
                                             max_new_tokens=s.completion - 1))
    self.last = jnp.zeros((s.rows,), jnp.int32)
    self.decode = jax.jit(functools.partial(transformer.decode_step, mcfg), donate_argnums=(2,))
    self.merge = jax.jit(functools.partial(transformer.decode_params, mcfg))

  def forms(self, params) -> dict:
    """The decode weights: merged as `generate` takes them; with LoRA, also the adapters
    applied at every matmul."""
    out = {"merged": self.merge(params)}
    if self.mode == "lora":
      out["per_matmul"] = common.unmerged_decode_weights(self.state.model_config, params)
    return out

  def trace(self) -> None:
    """The update and the decode programs traced on abstract inputs, none compiled."""
    update.lower(self.state, self.rollout, jax.random.key(2), **self.kw)
    params = self.state.model_params
    cache = jax.eval_shape(self.prefill, params, self.tokens, jnp.ones_like(self.tokens))[1]
    for weights in jax.eval_shape(self.forms, params).values():
      self.decode.lower(weights, self.last, cache)

  def measure(self, steps: int, calls: int) -> dict:
    trained = sum(x.size for x in jax.tree.leaves(self.state.params))
    row = dict(mode=self.mode, trained=int(trained))
    box = [self.state]

    def step():
      box[0], metrics = update(box[0], self.rollout, jax.random.key(2), **self.kw)
      return metrics

    jax.block_until_ready(step())
    row["update_s"] = common.median_seconds(step, steps)
    full = box[0].model_params
    for name, weights in self.forms(full).items():
      # A fresh cache per form: each call fills one of its T - 1 slots.
      cache = [self.prefill(full, self.tokens, jnp.ones_like(self.tokens))[1]]

      def one(weights=weights):
        logits, cache[0] = self.decode(weights, self.last, cache[0])
        return logits

      jax.block_until_ready(one())
      calls = min(calls, self.s.completion - 2)
      row[f"decode_{name}_ms"] = 1e3 * common.median_seconds(one, calls)
    return row


def settings(args):
  model, rows, group, prompt, completion, micro, steps, calls, kernels = SETTINGS[
      "quick" if args.quick else args.device]
  return (args.model or model, Shapes(rows, group, prompt, completion, micro), steps, calls,
          kernels)


def dry_run(args) -> dict:
  model, s, _, _, kernels = settings(args)
  for mode in args.modes.split(","):
    Mode(mode, model, s, kernels).trace()
    print(f"  {mode}: traced", flush=True)
  return {"traced": args.modes.split(",")}


def run(args) -> dict:
  model, s, steps, calls, kernels = settings(args)
  print(f"{jax.devices()[0].device_kind}: {model} bf16, N={s.rows}, G={s.group}, P={s.prompt}, "
        f"T={s.completion}, {s.micro_batches} micro-batches", flush=True)
  out = dict(model=model, rows=s.rows, prompt=s.prompt, completion=s.completion, modes={})
  for mode in args.modes.split(","):
    out["modes"][mode] = Mode(mode, model, s, kernels).measure(steps, calls)
  base = out["modes"].get("none")
  print(f"  {'mode':<6} {'trained':>12} {'update s':>9} {'x full':>7} {'decode ms':>10} "
        f"{'x full':>7} {'per-matmul ms':>14}")
  for mode, r in out["modes"].items():
    if base:
      r["update_vs_full"] = r["update_s"] / base["update_s"]
      r["decode_vs_full"] = r["decode_merged_ms"] / base["decode_merged_ms"]
    pm = r.get("decode_per_matmul_ms")
    print(f"  {mode:<6} {r['trained']:>12,} {r['update_s']:>9.3f} "
          f"{r.get('update_vs_full', float('nan')):>7.2f} {r['decode_merged_ms']:>10.3f} "
          f"{r.get('decode_vs_full', float('nan')):>7.2f} "
          f"{'-' if pm is None else f'{pm:.3f}':>14}", flush=True)
  return out
