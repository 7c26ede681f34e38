"""The rollout program: sample G completions per prompt, score them on the host,
turn rewards into advantages, and compute reference / old log-probs if needed.

Axes: B prompts, G group size, N = B*G rows (groups contiguous), P prompt
length, T completion length, K reward functions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from grpojax.core import advantages as advantages_lib
from grpojax.sampling import sampler
from grpojax.sampling.strategies import SamplingParams
from grpojax.train.state import TrainState
from grpojax.train.step import Rollout, completion_logps

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Static settings of the rollout program."""

  group_size: int
  max_new_tokens: int
  sampling: SamplingParams
  eos_ids: tuple[int, ...]
  pad_id: int
  estimator: str = "grpo"
  advantage_scale: str = "group"
  advantage_eps: float = 1e-4
  with_reference: bool = False  # beta > 0
  with_old_logps: bool = False  # num_iterations > 1 or minibatches > 1
  chunk_size: int = 1024

  @property
  def logp_temperature(self) -> float:
    # Greedy rollouts (temperature 0) are scored under the untempered policy.
    return self.sampling.temperature or 1.0


def make_rollout_fn(config: RolloutConfig, host_rewards, *, reward_weights=None,
                    mesh: jax.sharding.Mesh | None = None) -> Callable:
  """The jitted `rollout(state, batch, rng) -> (Rollout, metrics)`.

  Args:
    config: RolloutConfig.
    host_rewards: a grpojax.rewards.host.HostRewards (called from inside jit).
    reward_weights: [K] weights of the reward functions (default: ones).
    mesh: shard rows over ("data", "fsdp") and verify each shard on its own host.

  The batch is a dict: prompt_tokens [B, P] (left-padded), prompt_mask [B, P],
  example_ids [B] (keys into the host-side dataset, for the verifiers).
  """
  estimator = advantages_lib.get_advantage_fn(config.estimator)
  weights = None if reward_weights is None else jnp.asarray(reward_weights, jnp.float32)
  names = tuple(host_rewards.names)
  G = config.group_size

  @jax.jit
  def rollout(state: TrainState, batch: dict, rng: Array) -> tuple[Rollout, dict]:
    out = sampler.generate_from_params(
        state.model_config, state.params, batch["prompt_tokens"], batch["prompt_mask"], rng=rng,
        num_samples=G, max_new_tokens=config.max_new_tokens, sampling=config.sampling,
        eos_ids=config.eos_ids, pad_id=config.pad_id, mesh=mesh)
    example_ids = jnp.repeat(batch["example_ids"], G, axis=0)
    rewards_NK, errors_K = host_rewards(example_ids, out.tokens, out.mask, mesh=mesh)
    rewards = advantages_lib.combine_rewards(rewards_NK, weights)
    advantages = estimator(rewards, G, scale=config.advantage_scale, eps=config.advantage_eps)

    prompt_tokens = jnp.repeat(batch["prompt_tokens"], G, axis=0)
    prompt_mask = jnp.repeat(batch["prompt_mask"], G, axis=0)
    logps = lambda cfg, params: completion_logps(  # noqa: E731
        cfg, params, prompt_tokens, prompt_mask, out.tokens, out.mask,
        temperature=config.logp_temperature, chunk_size=config.chunk_size)

    metrics = advantages_lib.reward_stats(rewards, G)
    for k, name in enumerate(names):
      col = rewards_NK[:, k]
      metrics[f"rewards/{name}/mean"] = jnp.nanmean(col)
      metrics[f"rewards/{name}/errors"] = errors_K[k]
    lengths = out.lengths.astype(jnp.float32)
    metrics.update({
        "completions/mean_length": jnp.mean(lengths),
        "completions/min_length": jnp.min(lengths),
        "completions/max_length": jnp.max(lengths),
        "completions/clipped_ratio": jnp.mean(out.truncated.astype(jnp.float32)),
    })

    old = ref = None
    if config.with_old_logps:
      old = logps(state.model_config, state.params)
      # The sampler's and trainer's log-probs of the same tokens should agree up
      # to numerics; a large gap means the two programs disagree (dtype, masking).
      gap = jnp.where(out.mask > 0, jnp.abs(old - out.logps), 0.0)
      metrics["sampling/logp_diff_mean"] = jnp.sum(gap) / jnp.maximum(jnp.sum(out.mask), 1)
      metrics["sampling/logp_diff_max"] = jnp.max(gap)
    if config.with_reference:
      ref = logps(state.ref_config, state.ref_params)
    result = Rollout(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=out.tokens,
                     mask=out.mask, advantages=advantages, old_logps=old, ref_logps=ref)
    return result, metrics

  return rollout
