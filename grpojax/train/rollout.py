"""What a rollout is made of: sample G completions per prompt, score them on the host,
turn rewards into advantages, and compute reference / old log-probs if needed.
The strategies that run these (plain, DAPO's dynamic sampling) are train/strategy.py.

Axes: B prompts, G group size, N = B*G rows (groups contiguous), P prompt
length, T completion length, K reward functions.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from grpojax.core import advantages as advantages_lib
from grpojax.core import logprobs as logprobs_lib
from grpojax.core import losses as losses_lib
from grpojax.core import ppo
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.sampling import engine as engine_lib
from grpojax.sampling import sampler
from grpojax.sampling.engine import EngineConfig
from grpojax.sampling.strategies import SamplingParams
from grpojax.train.state import TrainState

Array = jax.Array


@flax.struct.dataclass
class Rollout:
  """One generation batch, everything the update needs.

  prompt_tokens, prompt_mask: [N, P] each row's (left-padded) prompt: the same
    for a group's G consecutive rows (the update runs it once per group).
  tokens, mask: [N, T] completions; mask says the token exists (1 through the
    first EOS): what the forward passes read (attention, positions).
  advantages: [N], or [N, T] per token with PPO's critic (advantage.estimator=gae).
  loss_mask: [N, T] the tokens trained: what the policy loss, its KL and entropy
    terms and every normaliser read (TRL's completion_mask * tool_mask). 0 where
    mask is, and inside it on tokens that joined the completion from outside
    (a tool's response) and on whole rows mask_truncated drops. None: = mask
    (the update reads it so); the rollout programs always fill it.
  old_logps: [N, T] behaviour log-probs, or None when the update is on-policy.
  ref_logps: [N, T] reference log-probs, or None when beta == 0.
  sampler_logps: [N, T] the sampler's own log-probs of the tokens, or None when
    nothing compares the trainer's with them (loss.importance_sampling_correction,
    the off-policy mask and the sampling/* metrics do).
  zero_std: [N] bool, whether the row's group's rewards are all equal (no learning
    signal under group normalisation): what DAPO's dynamic sampling drops.
  values, returns: [N, T] PPO's critic at the rollout (the value of the state
    before each token, and slot row_end the state after the last one) and GAE's
    returns, the value loss's targets (grpojax.core.ppo); None without a critic.
  """

  prompt_tokens: Array
  prompt_mask: Array
  tokens: Array
  mask: Array
  advantages: Array
  loss_mask: Array | None = None
  old_logps: Array | None = None
  ref_logps: Array | None = None
  sampler_logps: Array | None = None
  zero_std: Array | None = None
  values: Array | None = None
  returns: Array | None = None


def completion_hidden(cfg: ModelConfig, params, prompt_tokens, prompt_mask, tokens, mask, *,
                      group_size: int = 1) -> Array:
  """[N, T, D] the final hidden state before each completion token (position t
  predicts token t + 1: the prompt's last position the first token). group_size > 1
  runs each group's prompt once (see completion_logps)."""
  N, p = prompt_tokens.shape
  if group_size > 1:
    if N % group_size:
      raise ValueError(f"{N} rows do not split into groups of {group_size}")
    hp, hc = transformer.forward_shared_prompt(
        cfg, params, prompt_tokens[::group_size], prompt_mask[::group_size], tokens, mask)
    return jnp.concatenate([jnp.repeat(hp[:, -1:], group_size, axis=0), hc[:, :-1]], axis=1)
  full = jnp.concatenate([prompt_tokens, tokens], axis=1)
  full_mask = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
  return transformer.forward(cfg, params, full, None, full_mask)[:, p - 1:-1]


def critic_values(cfg: ModelConfig, params, prompt_tokens, prompt_mask, tokens, mask, *,
                  group_size: int = 1) -> Array:
  """[N, T] float32 a critic's values: slot t the state before completion token t,
  so slot row_end (past the last token) the state after it (TRL's
  `full_value[:, context_length - 1 : -1]`). cfg: a score model, one label."""
  hidden = completion_hidden(cfg, params, prompt_tokens, prompt_mask, tokens, mask,
                             group_size=group_size)
  return transformer.score(cfg, params, hidden)[..., 0]


def completion_logps(cfg: ModelConfig, params, prompt_tokens, prompt_mask, tokens, mask, *,
                     temperature: float = 1.0, chunk_size: int = 1024,
                     with_entropy: bool = False, group_size: int = 1):
  """Log-probs [N, T] (and entropies [N, T]) of completion tokens under `params`.

  One forward over prompt + completion; the completion's log-probs come from
  the hidden states in chunks (never the [N, T, V] logits at once).
  group_size > 1: rows come in groups of that many consecutive rows with the
  same prompt (as a Rollout holds them), and each group's prompt is run once
  (transformer.forward_shared_prompt): the same log-probs for less work.
  """
  hidden = completion_hidden(cfg, params, prompt_tokens, prompt_mask, tokens, mask,
                             group_size=group_size)
  return logprobs_lib.chunked_token_logprobs(
      hidden, transformer.unembedding(cfg, params), tokens, temperature=temperature,
      chunk_size=chunk_size, with_entropy=with_entropy, softcap=cfg.final_logit_softcap)


def chunked_completion_logps(cfg: ModelConfig, params, prompt_tokens, prompt_mask, tokens, mask,
                             *, chunks: int, group_size: int, of=None, **kw) -> Array:
  """completion_logps [N, T] computed over `chunks` row chunks of whole groups in turn
  (lax.map): the forward's activations for N / chunks rows at a time. of: another
  function of the same arguments to chunk instead (critic_values)."""
  of = completion_logps if of is None else of
  N = tokens.shape[0]
  if chunks == 1:
    return of(cfg, params, prompt_tokens, prompt_mask, tokens, mask, group_size=group_size, **kw)
  if N % (chunks * group_size):
    raise ValueError(f"{N} rows do not split into {chunks} chunks of whole groups of {group_size}")
  split = lambda x: x.reshape(chunks, N // chunks, *x.shape[1:])  # noqa: E731
  out = jax.lax.map(lambda a: of(cfg, params, *a, group_size=group_size, **kw),
                    tuple(split(x) for x in (prompt_tokens, prompt_mask, tokens, mask)))
  return out.reshape(N, -1)


def generate_in_chunks(config, state, prompt_tokens, prompt_mask, rng, mesh):
  """(SampleOutput, metrics): the B prompts' B*G completions, generated over
  config.generation_chunks chunks of B/chunks prompts in turn (lax.map), and on
  the engine its `engine_metrics` over the chunks (else {})."""
  kw = dict(num_samples=config.group_size, max_new_tokens=config.max_new_tokens,
            sampling=config.sampling, eos_ids=config.eos_ids, pad_id=config.pad_id, mesh=mesh)
  cfg, params = state.model_config, state.model_params
  if config.engine is None:
    generate = lambda tokens, mask, key: (  # noqa: E731
        sampler.generate_from_params(cfg, params, tokens, mask, rng=key, **kw), None)
  else:
    if config.hook is not None:
      kw["hook"] = config.hook
    generate = lambda tokens, mask, key: engine_lib.generate(  # noqa: E731
        cfg, params, tokens, mask, rng=key, engine=config.engine, with_stats=True, **kw)
  c = config.generation_chunks
  if c == 1:
    out, stats = generate(prompt_tokens, prompt_mask, rng)
    return out, engine_metrics(stats)
  B = prompt_tokens.shape[0]
  if B % c:
    raise ValueError(f"{B} prompts do not split into {c} generation chunks")
  split = lambda x: x.reshape(c, B // c, *x.shape[1:])  # noqa: E731
  keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(c))
  out, stats = jax.lax.map(lambda a: generate(*a),
                           (split(prompt_tokens), split(prompt_mask), keys))
  out = jax.tree.map(lambda x: x.reshape(B * config.group_size, *x.shape[2:]), out)
  return out, engine_metrics(stats)


def engine_metrics(stats) -> dict:
  """What the rollout engine did (engine.EngineStats of one run, or [c] of c runs
  one after another: generation chunks): engine/steps decode steps, /tail_steps those over its
  narrowed tail, /preempted rows restarted for want of pages (raise kv_pages, or
  expected_lengths' quantile, if it is often > 0), /pages_peak the most pages held
  at once (beside rollout.kv_pages: what the pool could lose), and
  /keys_read_per_live the attention's keys read over those the rows attend to."""
  if stats is None:
    return {}
  if stats.steps.ndim:  # chunks ran one after another: their peaks are apart
    stats = jax.tree.map(jnp.sum, stats).replace(pages_peak=jnp.max(stats.pages_peak))
  return {"engine/steps": stats.steps, "engine/tail_steps": stats.tail_steps,
          "engine/preempted": stats.preempted, "engine/pages_peak": stats.pages_peak,
          "engine/keys_read_per_live": stats.keys_read / jnp.maximum(stats.live_keys, 1.0)}


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
  # DAPO: truncated completions (no EOS within max_new_tokens) get an all-zero
  # loss_mask: no loss, not counted by any normaliser; their rewards still count,
  # and their tokens still exist (mask is kept).
  mask_truncated: bool = False
  chunk_size: int = 1024
  # The reference / old log-prob forwards run over this many row chunks of whole
  # groups, one after another (memory for time; the loop sets the update's
  # micro-batch rows, see grpojax.plan.fit).
  logprob_chunks: int = 1
  # Generation over this many chunks of whole prompts, one after another (the
  # cache of 1/chunks of the rows at a time); chunk i samples with
  # fold_in(rng, i), so the draws differ from one chunk's, not their distribution.
  generation_chunks: int = 1
  # The paged engine's sizes (sampling.engine.EngineConfig; the default: every row in
  # a slot, every slot's pages at full length), or None: the lockstep reference sampler.
  engine: EngineConfig | None = EngineConfig()
  # A row-event hook of the engine's (sampling.engine.RowHook: static, hashable), or
  # None. Tokens it puts in rows exist (mask) and are never trained (loss_mask).
  hook: object | None = None
  # Carried rollouts (strategy "carried"): rows unfinished when a rollout has its
  # groups are kept for the next one, drawn on under the new weights, up to this
  # many policy versions old; 0: none kept (every rollout drains, as "plain").
  max_staleness: int = 0
  # How a carried row goes on after an update: "recompute" (its prompt and tokens so
  # far prefilled again under the new weights), "restart" (from its prompt) or "keep"
  # (in its slot, with the keys and values the old weights wrote).
  partial: str = "recompute"
  # Batches of prompts held beside the one a rollout returns: their rows keep the
  # slots busy while a rollout's longest rows finish.
  carried_batches: int = 1
  # PPO (estimator "gae"): the discount, GAE's lambda, TRL's whiten_rewards, and the
  # per-token KL's weight and estimator in the reward (loss.kl_in_reward: loss.beta;
  # 0: no KL in the reward).
  gamma: float = 1.0
  lam: float = 0.95
  whiten_rewards: bool = False
  reward_kl_coef: float = 0.0
  kl_estimator: str = "k1"

  def __post_init__(self):
    if self.hook is not None and self.engine is None:
      raise ValueError("RolloutConfig.hook runs on the rollout engine: give engine too")
    if self.max_staleness < 0 or self.carried_batches < 0:
      raise ValueError(f"RolloutConfig.max_staleness={self.max_staleness} and carried_batches="
                       f"{self.carried_batches} must be >= 0")
    if self.partial not in ("recompute", "restart", "keep"):
      raise ValueError(f"RolloutConfig.partial={self.partial!r}: 'recompute', 'restart' or "
                       "'keep'")

  @property
  def logp_temperature(self) -> float:
    return logp_temperature(self.sampling)


def logp_temperature(sampling: SamplingParams) -> float:
  """The temperature the rows' log-probs are taken at: the sampling's, and greedy
  rollouts (temperature 0) under the untempered policy."""
  return sampling.temperature or 1.0


def trained_lengths(out) -> Array:
  """[N] each sampled row's tokens of its own (TRL counts completion lengths over
  tool_mask: a tool's response is not the policy's length), before any truncation mask."""
  return out.lengths if out.loss_mask is None else jnp.sum(out.mask * out.loss_mask, axis=1)


def rollout_metrics(names, rewards_NK, errors_K, weights, G: int, lengths, truncated) -> dict:
  """A rollout's reward and completion metrics over its N rows (groups of G); lengths [N]
  as `trained_lengths`."""
  metrics = advantages_lib.reward_stats(advantages_lib.combine_rewards(rewards_NK, weights), G)
  for k, name in enumerate(names):
    metrics[f"rewards/{name}/mean"] = jnp.nanmean(rewards_NK[:, k])
    metrics[f"rewards/{name}/errors"] = errors_K[k]
  lengths = lengths.astype(jnp.float32)
  metrics.update({
      "completions/mean_length": jnp.mean(lengths),
      "completions/min_length": jnp.min(lengths),
      "completions/max_length": jnp.max(lengths),
      "completions/clipped_ratio": jnp.mean(truncated.astype(jnp.float32)),
  })
  return metrics


def assemble(config: RolloutConfig, state: TrainState, prompt_tokens, prompt_mask, out,
             rewards_NK, weights) -> Rollout:
  """The Rollout of B prompts [B, P] and their B*G sampled rows (a SampleOutput) with
  their rewards [N, K]: advantages, the loss mask, and the old and reference
  log-probs the update needs."""
  G = config.group_size
  rewards = advantages_lib.combine_rewards(rewards_NK, weights)
  if advantages_lib.needs_critic(config.estimator):  # per token, after the log-probs
    advantages = jnp.zeros(out.tokens.shape, jnp.float32)
  else:
    advantages = advantages_lib.advantages_from_rewards(
        config.estimator, rewards_NK, weights, G, scale=config.advantage_scale,
        eps=config.advantage_eps)
  # The trained tokens, TRL's completion_mask * tool_mask. DAPO's truncated rows
  # leave the loss whole but keep `mask`: their tokens still exist (TRL zeroes its
  # attention mask too, which changes nothing trained: rows do not see each other).
  loss_mask = out.mask if out.loss_mask is None else out.mask * out.loss_mask
  if config.mask_truncated:
    loss_mask = jnp.where(out.truncated[:, None], 0, loss_mask)

  # The sampler's log-probs travel to the update, which compares them with the
  # trainer's (sampling/sampling_logp_difference/*; a large gap means the two
  # programs disagree) and corrects for the gap if loss.importance_sampling_correction.
  rollout = Rollout(prompt_tokens=jnp.repeat(prompt_tokens, G, axis=0),
                    prompt_mask=jnp.repeat(prompt_mask, G, axis=0), tokens=out.tokens,
                    mask=out.mask, loss_mask=loss_mask.astype(out.mask.dtype),
                    advantages=advantages, sampler_logps=out.logps,
                    zero_std=jnp.repeat(zero_std_groups(rewards, G), G))
  rollout = with_logps(config, state, rollout)
  if advantages_lib.needs_critic(config.estimator):
    rollout = with_gae(config, state, rollout, rewards)
  return rollout


def with_logps(config: RolloutConfig, state: TrainState, rollout: Rollout) -> Rollout:
  """`rollout` with the log-probs [N, T] the config asks for: old_logps under the
  state's policy (with_old_logps) and ref_logps under its reference (with_reference)."""
  def logps(cfg, params):
    return chunked_completion_logps(
        cfg, params, rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask,
        chunks=config.logprob_chunks, temperature=config.logp_temperature,
        chunk_size=config.chunk_size, group_size=config.group_size)

  return rollout.replace(
      old_logps=logps(state.model_config, state.model_params) if config.with_old_logps else None,
      ref_logps=logps(*state.reference()) if config.with_reference else None)


def with_gae(config: RolloutConfig, state: TrainState, rollout: Rollout, rewards: Array
             ) -> Rollout:
  """`rollout` with PPO's per-token advantages [N, T] (whitened), the critic's values
  and GAE's returns [N, T], as TRL's PPO makes them: each token's reward is
  -reward_kl_coef x its KL (policy at the rollout against the reference), and the
  row's score `rewards` [N] (NaN, no verdict: 0) goes to the slot after its last
  token (grpojax.core.ppo.token_rewards). Needs old_logps (and ref_logps with a
  KL in the reward)."""
  if state.critic_params is None:
    raise ValueError("advantage.estimator=gae needs a critic in the state (state.with_critic)")
  mask = rollout.loss_mask
  values = chunked_completion_logps(
      state.critic_config, state.critic_model_params, rollout.prompt_tokens, rollout.prompt_mask,
      rollout.tokens, rollout.mask, chunks=config.logprob_chunks,
      group_size=config.group_size, of=critic_values)
  kl = jnp.zeros(values.shape, jnp.float32)
  if config.reward_kl_coef:
    kl = losses_lib.kl_penalty(rollout.old_logps, rollout.ref_logps, config.kl_estimator)
  scores = jnp.where(jnp.isfinite(rewards), rewards, 0.0)
  token_rewards = ppo.token_rewards(scores, kl, mask, config.reward_kl_coef,
                                    whiten=config.whiten_rewards)
  advantages, returns = ppo.gae(token_rewards, values, mask, config.gamma, config.lam)
  return rollout.replace(advantages=advantages, values=values,
                         returns=returns)


def zero_std_groups(rewards: Array, G: int) -> Array:
  """[N / G] bool: groups of G rows [N] whose rewards are all equal (frac_reward_zero_std's
  test, one group at a time, so the two always agree)."""
  return jax.vmap(lambda r: advantages_lib.reward_stats(r, G)["frac_reward_zero_std"])(
      rewards.reshape(-1, G)) > 0
