"""The optax chain from the optimizer's settings: clipping, AdamW, warmup + schedule.

Parameters are a flat {name: array} dict (grpojax.models.param_specs names), held
in float32 as master weights whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import optax

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW's settings (the `optim.*` keys; TRL's defaults), checked where they are made.

  schedule: "constant", "cosine" or "linear" (both to 0 at the last step; "linear" is
  TRL's default, lr_scheduler_type), after `warmup_steps` of linear warmup from 0. max_grad_norm: global-norm clip, 0 off. weight_decay: never
  on norms and biases. grad_accum_steps: minibatch gradients per optimizer step.
  """

  learning_rate: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  grad_accum_steps: int = 1

  def __post_init__(self):
    def fail(key, msg):
      raise ValueError(f"{key}={getattr(self, key)!r} {msg}")

    if self.learning_rate <= 0:
      fail("learning_rate", "must be > 0")
    for key in ("warmup_steps", "weight_decay", "max_grad_norm", "eps"):
      if getattr(self, key) < 0:
        fail(key, "must be >= 0")
    if self.schedule not in SCHEDULES:
      fail("schedule", f"is unknown; known: {list(SCHEDULES)}")
    for key in ("b1", "b2"):
      if not 0 <= getattr(self, key) < 1:
        fail(key, "must be in [0, 1)")
    if self.grad_accum_steps < 1:
      fail("grad_accum_steps", "must be >= 1")


def no_decay(name: str) -> bool:
  """Norm scales and biases are not decayed (decay would pull scales to 0). A name may
  carry a prefix ("critic/bq": PPO's critic beside the policy)."""
  name = name.rsplit("/", 1)[-1]
  return "norm" in name or name.startswith("b")


def learning_rate_schedule(learning_rate: float, warmup_steps: int, total_steps: int,
                           schedule: str = "constant") -> optax.Schedule:
  """Linear warmup from 0, then constant, or cosine or linear decay to 0 at `total_steps`
  (transformers' get_scheduler of the same names, step for step)."""
  if schedule not in SCHEDULES:
    raise ValueError(f"optim.schedule={schedule!r} is unknown; known: {list(SCHEDULES)}")
  if schedule == "constant":
    after = optax.constant_schedule(learning_rate)
  elif schedule == "cosine":
    after = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1))
  else:
    after = optax.linear_schedule(learning_rate, 0.0, max(total_steps - warmup_steps, 1))
  if warmup_steps <= 0:
    return after
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(optim_cfg: OptimConfig | Mapping, total_steps: int
                   ) -> optax.GradientTransformation:
  """AdamW with global-norm clipping, masked weight decay and gradient accumulation.

  Args:
    optim_cfg: the settings, or a mapping of OptimConfig's fields (the `optim` section).
    total_steps: optimizer steps in the whole run (for the cosine schedule).

  The same values give the same (cached) transformation object: it is a static
  part of the jitted update, so a resumed or repeated run in one process
  reuses the compiled program instead of tracing it again.
  """
  if not isinstance(optim_cfg, OptimConfig):
    optim_cfg = OptimConfig(**dict(optim_cfg))
  if optim_cfg.schedule == "constant":  # never read: runs of any length share one
    total_steps = 0
  return _make_optimizer(optim_cfg, total_steps)


@functools.lru_cache(maxsize=16)
def _make_optimizer(optim_cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
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
