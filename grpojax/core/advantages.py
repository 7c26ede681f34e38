"""Group-relative advantages: one scalar per completion, from its group's rewards.

Axes: N = num_groups * G rows, groups contiguous (rows i*G .. i*G+G-1 are
prompt i's completions); K reward functions.

NaN rewards mean "no verdict" (every reward function returned None): such rows
are left out of their group's statistics and get advantage 0, so they push
nothing up or down.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from grpojax.registry import Registry

Array = jax.Array


class AdvantageFn(Protocol):

  def __call__(self, rewards: Array, group_size: int, **kwargs) -> Array:
    ...


ESTIMATORS: Registry[AdvantageFn] = Registry("advantage.estimator")
SCALES = ("group", "batch", "none")
# Estimators that need a learned critic: per-token advantages [N, T] from the
# critic's values and per-token rewards (grpojax.core.ppo), computed by the rollout
# itself rather than from the rewards alone, so they are not registered functions.
CRITIC_ESTIMATORS = ("gae",)
# Estimators that take each reward function's column ([N, K] and the weights)
# instead of their weighted sum.
_PER_FUNCTION: set[str] = set()


def register_advantage(name: str, *, per_function: bool = False, override: bool = False
                       ) -> Callable[[AdvantageFn], AdvantageFn]:
  """Decorator: registers `fn(rewards [N], group_size, **kw) -> [N]` under `name`.

  per_function=True: fn receives the rewards of each function, `[N, K]` with
  NaN for None, and `weights=[K]` too, and combines them itself (as "gdpo").

  Research code adds an estimator without touching grpojax:

    @grpojax.core.advantages.register_advantage("my_estimator")
    def my_estimator(rewards, group_size, **kw): ...

  and selects it with `--config.advantage.estimator=my_estimator`. It is
  called as `fn(rewards, group_size, scale=advantage.scale, eps=advantage.eps)`.
  Another estimator under the same name raises unless `override=True`.
  """

  def decorator(fn: AdvantageFn) -> AdvantageFn:
    fn = ESTIMATORS.register(name, fn, override=override)
    (_PER_FUNCTION.add if per_function else _PER_FUNCTION.discard)(name)
    return fn

  return decorator


def known_estimators() -> list[str]:
  """Every advantage.estimator name: the registered ones and the critic's."""
  return [*ESTIMATORS.names(), *CRITIC_ESTIMATORS]


def needs_critic(name: str) -> bool:
  """Whether the estimator `name` is PPO's, with a learned critic (GAE)."""
  return name in CRITIC_ESTIMATORS


def get_advantage_fn(name: str) -> AdvantageFn:
  return ESTIMATORS.get(name)


def is_per_function(name: str) -> bool:
  """Whether the estimator `name` combines the reward functions itself."""
  return name in _PER_FUNCTION


def advantages_from_rewards(name: str, rewards_NK: Array, weights_K: Array | None,
                            group_size: int, *, scale: str = "group", eps: float = 1e-4) -> Array:
  """[N] advantages of the estimator `name` from the per-function rewards [N, K]."""
  fn = get_advantage_fn(name)
  if is_per_function(name):
    if weights_K is None:
      weights_K = jnp.ones(rewards_NK.shape[-1], jnp.float32)
    return fn(rewards_NK, group_size, weights=weights_K, scale=scale, eps=eps)
  return fn(combine_rewards(rewards_NK, weights_K), group_size, scale=scale, eps=eps)


def combine_rewards(rewards_NK: Array, weights_K: Array | None = None) -> Array:
  """Weighted sum over reward functions, skipping functions that gave no verdict.

  Args:
    rewards_NK: [N, K] float; NaN where a function returned None for that row.
    weights_K: [K] weights (default: all ones).

  Returns:
    [N] rewards; NaN only where all K functions returned None (as TRL: a None
    excludes that function from the row's sum, not the row).
  """
  rewards_NK = jnp.asarray(rewards_NK, jnp.float32)
  if weights_K is None:
    weights_K = jnp.ones(rewards_NK.shape[-1], jnp.float32)
  valid = ~jnp.isnan(rewards_NK)
  total = jnp.sum(jnp.where(valid, rewards_NK * weights_K, 0.0), axis=-1)
  return jnp.where(jnp.any(valid, axis=-1), total, jnp.nan)


def _grouped(rewards: Array, group_size: int) -> tuple[Array, Array, Array]:
  """Reshape [N] -> [num_groups, G]; returns (rewards with NaN/inf zeroed, valid, count)."""
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}")
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(
        f"rewards has {rewards.shape[0]} rows, not a multiple of group_size={group_size}"
    )
  r_BG = rewards.reshape(-1, group_size)
  # +-inf (a broken verifier) is treated like NaN, "no verdict": kept in, it
  # would make its group's mean inf and every advantage in the group NaN.
  valid_BG = jnp.isfinite(r_BG)
  r_BG = jnp.where(valid_BG, r_BG, 0.0)
  count_B1 = jnp.sum(valid_BG, axis=-1, keepdims=True).astype(jnp.float32)
  return r_BG, valid_BG, count_B1


def _masked_mean_std(x: Array, valid: Array, count: Array, axis) -> tuple[Array, Array]:
  """Mean and unbiased (ddof=1) std over `valid` entries; std is 0 for < 2 entries."""
  mean = jnp.sum(x, axis=axis, keepdims=True) / jnp.maximum(count, 1.0)
  sq = jnp.where(valid, (x - mean) ** 2, 0.0)
  var = jnp.sum(sq, axis=axis, keepdims=True) / jnp.maximum(count - 1.0, 1.0)
  return mean, jnp.sqrt(var)


def _nonzero(x: Array) -> Array:
  # std + eps is 0 only with eps=0 and a constant group, whose centred rewards
  # are all 0: dividing them by 1 keeps them 0 instead of 0/0 = NaN.
  return jnp.where(x > 0, x, 1.0)


def group_advantages(
    rewards: Array, group_size: int, *, scale: str = "group", eps: float = 1e-4
) -> Array:
  """GRPO advantages `(r - mean_group) / (std + eps)`.

  The std is unbiased (ddof=1), as TRL's GRPOTrainer (torch.std's default):
  for 10 samples with 6 rewards of 1 and 4 of 0 this gives +0.7746 / -1.1619
  (a population std would give +0.8165 / -1.2247). We follow TRL so that runs
  are numerically comparable with it.

  Args:
    rewards: [N] float, N = num_groups * group_size, groups contiguous. NaN
      marks rows without a verdict: excluded from mean and std, advantage 0.
    group_size: G, completions per prompt.
    scale: "group" (divide by the group's std), "batch" (divide by the std of
      all valid rewards; the group mean is still subtracted), "none".
    eps: added to the std; a zero-std group thus gets advantages 0.

  Returns:
    [N] float32 advantages, never NaN.
  """
  if scale not in SCALES:
    raise ValueError(f"scale={scale!r} is unknown; known: {list(SCALES)}")
  r_BG, valid_BG, count_B1 = _grouped(rewards, group_size)
  mean_B1, std_B1 = _masked_mean_std(r_BG, valid_BG, count_B1, axis=-1)
  centred_BG = r_BG - mean_B1
  if scale == "group":
    centred_BG = centred_BG / _nonzero(std_B1 + eps)
  elif scale == "batch":
    _, std = _masked_mean_std(r_BG, valid_BG, jnp.sum(count_B1), axis=None)
    centred_BG = centred_BG / _nonzero(std + eps)
  return jnp.where(valid_BG, centred_BG, 0.0).reshape(-1)


@register_advantage("grpo")
def grpo_advantages(rewards, group_size, *, scale="group", eps=1e-4):
  """The default estimator: `group_advantages` (mean-centred, std-scaled)."""
  return group_advantages(rewards, group_size, scale=scale, eps=eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards, group_size, **unused):
  """Dr. GRPO (Liu et al., 2025): mean-centred, no std division (it biases
  updates towards groups that are nearly all right or all wrong)."""
  del unused
  return group_advantages(rewards, group_size, scale="none")


@register_advantage("rloo")
def rloo_advantages(rewards, group_size, **unused):
  """REINFORCE leave-one-out: `r_i - mean_{j != i} r_j` over the group's valid rows.

  Equals `k / (k - 1) * (r_i - mean)` for k valid rows; 0 when k < 2.
  """
  del unused
  r_BG, valid_BG, count_B1 = _grouped(rewards, group_size)
  total_B1 = jnp.sum(r_BG, axis=-1, keepdims=True)
  others_mean_BG = (total_B1 - r_BG) / jnp.maximum(count_B1 - 1.0, 1.0)
  adv_BG = jnp.where(valid_BG & (count_B1 > 1), r_BG - others_mean_BG, 0.0)
  return adv_BG.reshape(-1)


@register_advantage("gdpo", per_function=True)
def gdpo_advantages(rewards_NK, group_size, *, weights, eps=1e-4, **unused):
  """GDPO (TRL's multi_objective_aggregation="normalize_then_sum"): each reward
  function is normalised within its group first, `(r_k - mean_k) / (std_k + eps)`,
  then the weighted sum is normalised over the whole batch. Functions that
  dominate the sum's variance no longer drown the others' signal.

  Args:
    rewards_NK: [N, K], NaN (or inf) where a function gave no verdict: left out
      of its statistics and of the row's sum; a row with none gets advantage 0.
    weights: [K].

  Returns:
    [N] float32. `advantage.scale` does not apply (the batch std always does).
  """
  del unused
  r_NK = jnp.asarray(rewards_NK, jnp.float32)
  if r_NK.ndim != 2 or r_NK.shape[0] % group_size:
    raise ValueError(f"rewards must be [N, K] with N a multiple of group_size={group_size}, "
                     f"got shape {r_NK.shape}")
  valid_NK = jnp.isfinite(r_NK)
  r_BGK = jnp.where(valid_NK, r_NK, 0.0).reshape(-1, group_size, r_NK.shape[-1])
  valid_BGK = valid_NK.reshape(r_BGK.shape)
  count_B1K = jnp.sum(valid_BGK, axis=1, keepdims=True).astype(jnp.float32)
  mean, std = _masked_mean_std(r_BGK, valid_BGK, count_B1K, axis=1)
  # TRL's nanstd is NaN for fewer than 2 values, which makes those entries NaN:
  # a function with a single verdict in a group contributes nothing there.
  norm_BGK = jnp.where(valid_BGK & (count_B1K > 1), (r_BGK - mean) / (std + eps), jnp.nan)
  norm_NK = norm_BGK.reshape(r_NK.shape)
  has = ~jnp.isnan(norm_NK)
  total = jnp.sum(jnp.where(has, norm_NK * jnp.asarray(weights, jnp.float32), 0.0), axis=-1)
  any_valid = jnp.any(valid_NK, axis=-1)
  count = jnp.sum(any_valid).astype(jnp.float32)
  batch_mean, batch_std = _masked_mean_std(total, any_valid, count, axis=None)
  adv = (total - batch_mean) / _nonzero(batch_std + eps)
  return jnp.where(any_valid, adv, 0.0)


def reward_stats(rewards: Array, group_size: int) -> dict[str, Array]:
  """TRL-named reward metrics for logging.

  Args:
    rewards: [N] (NaN rows ignored).

  Returns:
    reward (mean), reward_std (mean of the per-group stds, as TRL),
    frac_reward_zero_std (fraction of groups whose std is ~0).
  """
  r_BG, valid_BG, count_B1 = _grouped(rewards, group_size)
  _, std_B1 = _masked_mean_std(r_BG, valid_BG, count_B1, axis=-1)
  total = jnp.maximum(jnp.sum(count_B1), 1.0)
  return {
      "reward": jnp.sum(r_BG) / total,
      "reward_std": jnp.mean(std_B1),
      "frac_reward_zero_std": jnp.mean((std_B1 < 1e-6).astype(jnp.float32)),
  }
