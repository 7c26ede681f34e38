"""Supervised warm start: cross-entropy on reference completions, on the same
parameters the GRPO state then starts from.

Axes: B examples per step, P prompt length, T target length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpojax.data.pipeline import PromptIterator
from grpojax.data.tasks import Task
from grpojax.models.config import ModelConfig
from grpojax.train.state import init_optimizer
from grpojax.train.rollout import completion_logps


def target_batch(iterator: PromptIterator, task: Task, tokenizer, max_length: int) -> dict:
  """The next prompt batch plus its reference completions + EOS, right-padded to max_length.

  targets [b, T] int32, target_mask [b, T] (1 on target tokens and the EOS).
  """
  if task.sft_target is None:
    raise ValueError(f"task {task.name!r} has no SFT target: set sft.steps=0")
  batch = iterator.next()
  targets = np.full((len(batch["example_ids"]), max_length), tokenizer.pad_id, np.int32)
  mask = np.zeros_like(targets)
  for r, i in enumerate(batch["example_ids"]):
    ids = tokenizer.encode(task.sft_target(iterator.lookup(i)))[:max_length - 1]
    ids = ids + [tokenizer.eos_ids[0]]
    targets[r, :len(ids)] = ids
    mask[r, :len(ids)] = 1
  return dict(batch, targets=targets, target_mask=mask)


@functools.partial(jax.jit, static_argnames=("cfg", "tx"), donate_argnums=(1, 2))
def sft_step(cfg: ModelConfig, params, opt_state, batch, *, tx, frozen=None):
  """One cross-entropy step on the target tokens; returns (params, opt_state, loss).
  frozen: LoRA's base, when params are its adapters."""

  def loss_fn(p):
    logps = completion_logps(cfg, {**(frozen or {}), **p}, batch["prompt_tokens"],
                             batch["prompt_mask"], batch["targets"], batch["target_mask"])
    mask = batch["target_mask"].astype(jnp.float32)
    return -jnp.sum(logps * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@functools.lru_cache(maxsize=4)
def sft_optimizer(learning_rate: float, steps: int) -> optax.GradientTransformation:
  # Cached: the transformation is static in sft_step, so equal settings reuse its compile.
  # One step is all decay (a warmup of one would leave no step to decay over: optax refuses).
  warmup = max(steps // 10, 1) if steps > 1 else 0
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps)
  return optax.adamw(schedule, weight_decay=0.0)


def run_sft(cfg: ModelConfig, params, iterator: PromptIterator, task: Task, tokenizer, *,
            steps: int, learning_rate: float, max_length: int, put=lambda b: b,
            on_step=None, frozen=None):
  """`steps` of AdamW on the task's reference completions; returns the new params.

  frozen: LoRA's base model (TrainState.frozen): then params are the adapters, and
  only they are trained.

  put: places a host batch on devices (e.g. sharded over the mesh).
  on_step: optional callback(step, loss) with loss as a device scalar.
  """
  tx = sft_optimizer(learning_rate, steps)
  params = {k: jnp.array(v, copy=True) for k, v in params.items()}
  opt_state = init_optimizer(tx, params)
  for step in range(steps):
    batch = put(target_batch(iterator, task, tokenizer, max_length))
    params, opt_state, loss = sft_step(cfg, params, opt_state, batch, tx=tx, frozen=frozen)
    if on_step is not None:
      on_step(step, loss)
  return params
