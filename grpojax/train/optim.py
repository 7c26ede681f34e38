"""The optax chain from the `optim.*` config: clipping, AdamW, warmup + schedule.

Parameters are a flat {name: array} dict (grpojax.models.param_specs names), held
in float32 as master weights whatever the compute dtype.
"""

from __future__ import annotations

import functools
import types

import optax


def no_decay(name: str) -> bool:
  """Norm scales and biases are not decayed (decay would pull scales to 0)."""
  return "norm" in name or name.startswith("b")


def learning_rate_schedule(learning_rate: float, warmup_steps: int, total_steps: int,
                           schedule: str = "constant") -> optax.Schedule:
  """Linear warmup from 0, then constant or cosine decay to 0 at `total_steps`."""
  if schedule == "constant":
    after = optax.constant_schedule(learning_rate)
  elif schedule == "cosine":
    after = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1))
  else:
    raise ValueError(f"optim.schedule={schedule!r} is unknown; known: ['constant', 'cosine']")
  if warmup_steps <= 0:
    return after
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(optim_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with global-norm clipping, masked weight decay and gradient accumulation.

  Args:
    optim_cfg: the `optim` config section.
    total_steps: optimizer steps in the whole run (for the cosine schedule).

  The same values give the same (cached) transformation object: it is a static
  part of the jitted update, so a resumed or repeated run in one process
  reuses the compiled program instead of tracing it again.
  """
  return _make_optimizer(tuple(sorted(optim_cfg.items())), total_steps)


@functools.lru_cache(maxsize=16)
def _make_optimizer(items: tuple, total_steps: int) -> optax.GradientTransformation:
  optim_cfg = types.SimpleNamespace(**dict(items))
  lr = learning_rate_schedule(optim_cfg.learning_rate, optim_cfg.warmup_steps, total_steps,
                              optim_cfg.schedule)
  decay_mask = lambda params: {k: not no_decay(k) for k in params}  # noqa: E731
  chain = []
  if optim_cfg.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(optim_cfg.max_grad_norm))
  chain.append(optax.adamw(lr, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                           weight_decay=optim_cfg.weight_decay, mask=decay_mask))
  tx = optax.chain(*chain)
  if optim_cfg.grad_accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=optim_cfg.grad_accum_steps)
  return tx
