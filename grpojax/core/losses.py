"""Policy losses: clipped surrogates, KL to the reference, aggregation, registry.

Axes: N rows (completions), T completion positions.

A loss type is two pieces: a per-token loss (unreduced, `[N, T]`) and an
aggregation that turns it into a scalar. `policy_loss` builds the importance
ratios, calls the registered per-token loss, adds the KL penalty per token,
aggregates, and computes the metrics every loss type shares. The semantics of
each built-in type follow TRL's GRPOTrainer, so that the same inputs give the
same loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from grpojax.registry import Registry

Array = jax.Array

KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
# The sampler/trainer mismatch correction (TRL's vllm_importance_sampling_mode):
# one ratio per token or per sequence, clipped into [min, max] or zeroed outside it.
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclasses.dataclass(frozen=True)
class Aggregation:
  """How a loss's [N, T] per-token values become the scalar loss of a (mini)batch.

  fn(loss [N, T], mask [N, T], config, num_items_in_batch) -> []. by_batch_tokens:
  divided by the whole generation batch's tokens (num_items_in_batch), not this
  minibatch's, so accumulated minibatch gradients must be summed, not averaged.
  part_weight(part_mask [n, T], whole_mask [N, T]) -> []: the weight w of a part
  (a micro-batch of whole rows) such that sum over parts of w * fn(part) equals
  fn(whole): micro-batching gives the whole minibatch's loss and gradient.
  """

  fn: Callable
  by_batch_tokens: bool = False
  part_weight: Callable = lambda part, whole: part.shape[0] / whole.shape[0]


# |log ratio| beyond this is clamped before exp: e^20 ~ 5e8 is already far
# outside any trust region, and it keeps ratios and k3 finite for the -1e4
# log-probs that masked or pathological positions can carry.
_MAX_LOG_RATIO = 20.0


class Options(Mapping):
  """A registered loss's own hyper-parameters (`loss.options`): a read-only mapping,
  hashable so that LossConfig stays a static argument of the jitted update."""

  def __init__(self, items: Mapping[str, Any] | None = None):
    self._items = dict(sorted(dict(items or {}).items()))
    for key, value in self._items.items():
      if not isinstance(value, (bool, int, float, str, type(None))):
        raise ValueError(f"loss.options.{key}={value!r}: a loss option is a number, a bool or "
                         "a string")

  def __getitem__(self, key: str) -> Any:
    return self._items[key]

  def __iter__(self):
    return iter(self._items)

  def __len__(self) -> int:
    return len(self._items)

  def __hash__(self) -> int:
    return hash(tuple(self._items.items()))

  def __eq__(self, other) -> bool:
    return isinstance(other, Mapping) and dict(self._items) == dict(other)

  def __repr__(self) -> str:
    return f"Options({self._items})"


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Hyperparameters of `policy_loss`; the field names are the `loss.*` config keys.

  Attributes:
    loss_type: a registered loss: grpo | bnpo | dr_grpo | dapo | cispo | sapo | yours.
    epsilon_low: lower clip, the ratio is clipped below at 1 - epsilon_low.
    epsilon_high: upper clip (1 + epsilon_high); None means epsilon_low. For
      cispo it is the absolute cap on the ratio (TRL / ScaleRL recommend 5.0).
    delta: if set, caps the unclipped ratio at delta too (two-sided clipping).
    beta: KL coefficient; 0 means no reference model at all.
    kl_estimator: k1 (log ratio), k2 (half squared log ratio), k3 (Schulman's
      unbiased, non-negative estimator, as GRPO and TRL).
    importance_sampling_level: "token", or "sequence" (GSPO: one ratio per row,
      exp of the mean token log-ratio).
    max_completion_length: dr_grpo's constant normaliser; None means T.
    sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for A > 0 and A <= 0.
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma
      weight phi(w) = e^lambda w^k e^(-lambda w) of the sequence ratio w, for
      A >= 0 and A < 0 (k: how fast w < 1 is damped; lambda: w > 1).
    use_bias_correction_kl: multiply the per-token KL by the (differentiable)
      policy ratio, so that its gradient is the unbiased reverse-KL gradient
      (DeepSeek-V3.2); changes the KL gradient even on-policy. TRL's default.
    importance_sampling_correction: reweight each token's policy loss by
      exp(trainer log-prob - sampler log-prob), the rollout/trainer mismatch
      (TRL's vllm_importance_sampling_correction); needs `sampler_logps`.
    importance_sampling_mode: one of IS_MODES: a ratio per token or per
      sequence (exp of the summed log-prob gap), clipped into [clip_min,
      clip_max] (truncate) or zeroed outside it (mask).
    importance_sampling_clip_max, importance_sampling_clip_min: those bounds;
      None: unbounded on that side.
    decoupled: AReaL's decoupled PPO objective for rows drawn by older policy
      versions (carried rollouts): the ratio is taken against the proximal
      policy (old_logps: the weights at the start of the update) and each token's
      loss is weighted by exp(proximal - behaviour log-prob) (sampler_logps: the
      version that drew it), and left out (weight 0, still counted by the
      normaliser) where that weight exceeds decoupled_clip. Needs sampler_logps;
      it is a correction for the same gap as importance_sampling_correction, so
      the two are not combined.
    decoupled_clip: that cap (AReaL's behav_imp_weight_cap; 5.0 as AReaL); None:
      uncapped.
    off_policy_mask_threshold: drop sequences with A < 0 whose mean per-token
      KL(sampler || policy) exceeds it (DeepSeek-V3.2's off-policy sequence
      mask; the k1 estimate can be negative, and so can the threshold); None: off.
    top_entropy_quantile: keep only the policy loss of tokens whose entropy is
      in this top fraction of the batch's completion tokens (Beyond the 80/20
      Rule recommends 0.2); 1.0: all tokens; 0.0: only the highest.
    entropy_coef: subtract entropy_coef x the mean per-token entropy (over the
      tokens the policy loss keeps) from the loss, whatever the loss type.
    mask_truncated_completions: completions that hit the length limit without
      an EOS get an all-zero loss mask (no loss, not counted by any normaliser);
      the rollout applies it to Rollout.loss_mask (their tokens still exist for
      the forward), their rewards still count in their group (DAPO).
    vf_coef: PPO's critic (advantage.estimator=gae): the value loss's weight in the
      loss, policy + vf_coef x value loss (TRL's PPOConfig.vf_coef, 0.1).
    cliprange_value: the critic's new values are clipped to the rollout's +- this
      in the value loss (TRL's cliprange_value, 0.2).
    kl_in_reward: the classic RLHF recipe (TRL's PPO): beta x the per-token KL to
      the reference is subtracted from each token's reward before GAE, instead of
      being added to the loss. Needs beta > 0 and advantage.estimator=gae; the
      KL is kl_estimator's (TRL's PPO uses k1).
    options: the hyper-parameters of the registered loss itself, as it declared
      them (`register_loss(..., options={name: default})`): the defaults with
      the given ones over them; a name it did not declare is an error.
  """

  loss_type: str = "dapo"
  epsilon_low: float = 0.2
  epsilon_high: float | None = None
  delta: float | None = None
  beta: float = 0.0
  kl_estimator: str = "k3"
  importance_sampling_level: str = "token"
  max_completion_length: int | None = None
  sapo_tau_pos: float = 1.0
  sapo_tau_neg: float = 1.05
  vespo_k_pos: float = 2.0
  vespo_lambda_pos: float = 3.0
  vespo_k_neg: float = 3.0
  vespo_lambda_neg: float = 2.0
  use_bias_correction_kl: bool = True
  importance_sampling_correction: bool = False
  importance_sampling_mode: str = "sequence_mask"
  importance_sampling_clip_max: float | None = 3.0
  importance_sampling_clip_min: float | None = None
  decoupled: bool = False
  decoupled_clip: float | None = 5.0
  off_policy_mask_threshold: float | None = None
  top_entropy_quantile: float = 1.0
  entropy_coef: float = 0.0
  mask_truncated_completions: bool = False
  vf_coef: float = 0.1
  cliprange_value: float = 0.2
  kl_in_reward: bool = False
  options: Options = dataclasses.field(default_factory=Options)

  def __post_init__(self):
    def fail(key, msg):
      raise ValueError(f"loss.{key}={getattr(self, key)!r}: {msg}")

    if self.loss_type not in LOSSES:
      raise ValueError(f"loss.loss_type={self.loss_type!r} is unknown; known: {LOSSES.names()}")
    if self.epsilon_low < 0:
      fail("epsilon_low", "must be >= 0")
    if self.epsilon_high is not None and self.epsilon_high < 0:
      fail("epsilon_high", "must be >= 0 (or None for epsilon_low)")
    if self.loss_type == "cispo" and (self.epsilon_high is None or self.epsilon_high <= 1):
      fail("epsilon_high", "cispo caps the ratio at epsilon_high itself: set it > 1 (5.0 is usual)")
    if self.delta is not None and self.delta <= 1:
      fail("delta", "the two-sided cap on the ratio must be > 1 (or None)")
    if self.beta < 0:
      fail("beta", "must be >= 0")
    if self.kl_estimator not in KL_ESTIMATORS:
      fail("kl_estimator", f"known: {list(KL_ESTIMATORS)}")
    if self.importance_sampling_level not in IS_LEVELS:
      fail("importance_sampling_level", f"known: {list(IS_LEVELS)}")
    if self.max_completion_length is not None and self.max_completion_length < 1:
      fail("max_completion_length", "must be >= 1 (or None for T)")
    if self.sapo_tau_pos <= 0:
      fail("sapo_tau_pos", "must be > 0")
    if self.sapo_tau_neg <= 0:
      fail("sapo_tau_neg", "must be > 0")
    for key in ("vespo_k_pos", "vespo_k_neg"):
      if getattr(self, key) < 0:
        fail(key, "must be >= 0 (the power of the sequence ratio in VESPO's weight)")
    for key in ("vespo_lambda_pos", "vespo_lambda_neg"):
      if getattr(self, key) <= 0:
        fail(key, "must be > 0 (the decay of VESPO's weight for ratios above 1)")
    if self.importance_sampling_mode not in IS_MODES:
      fail("importance_sampling_mode", f"known: {list(IS_MODES)}")
    lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
    if hi is not None and hi <= 0:
      fail("importance_sampling_clip_max", "must be > 0 (or None: no upper bound)")
    if lo is not None and lo < 0:
      fail("importance_sampling_clip_min", "must be >= 0 (or None: no lower bound)")
    if lo is not None and hi is not None and lo > hi:
      fail("importance_sampling_clip_min", f"must be <= importance_sampling_clip_max={hi}")
    if self.decoupled and self.importance_sampling_correction:
      fail("decoupled", "weights each token by exp(proximal - behaviour log-prob) already: "
           "importance_sampling_correction would weigh it by the same gap twice; set one")
    if self.decoupled_clip is not None and self.decoupled_clip <= 0:
      fail("decoupled_clip", "must be > 0 (or None: uncapped)")
    if not 0.0 <= self.top_entropy_quantile <= 1.0:
      fail("top_entropy_quantile", "must be in [0, 1] (1: every token)")
    if self.entropy_coef < 0:
      fail("entropy_coef", "must be >= 0 (the weight of the entropy bonus)")
    if self.vf_coef < 0:
      fail("vf_coef", "must be >= 0 (the weight of the critic's value loss)")
    if self.cliprange_value <= 0:
      fail("cliprange_value", "must be > 0 (how far the critic's values may move from the "
           "rollout's in the value loss)")
    if self.kl_in_reward and self.beta == 0:
      fail("kl_in_reward", "puts beta x the KL in each token's reward: set loss.beta > 0")
    given, declared = Options(self.options), LOSSES.get(self.loss_type).options
    unknown = sorted(set(given) - set(declared))
    if unknown:
      raise ValueError(f"loss.options.{unknown[0]}: loss_type={self.loss_type!r} takes "
                       f"{sorted(declared) or 'no options'}")
    object.__setattr__(self, "options", Options({**declared, **given}))

  @property
  def eps_high(self) -> float:
    return self.epsilon_low if self.epsilon_high is None else self.epsilon_high


class LossInputs(NamedTuple):
  """What a registered per-token loss receives.

  logps: [N, T] policy log-probs (differentiable).
  old_logps: [N, T] behaviour-policy log-probs (no gradient).
  log_ratio: [N, T] (token level) or [N, 1] (sequence level), masked positions 0.
  ratio: exp(log_ratio), same shape.
  advantages: [N, 1] (one per row), or [N, T] per token (GAE).
  mask: [N, T] float, 1 on the tokens trained (the loss mask).
  is_ratio: the sampler/trainer correction, [N, T] or [N, 1], or None when
    importance_sampling_correction is off; `policy_loss` multiplies the
    per-token loss by it unless the loss was registered with
    `applies_is_ratio=True` (it then uses it itself, as vespo does).
  entropy: [N, T] per-token entropies of the policy, or None when not computed.
  """

  logps: Array
  old_logps: Array
  log_ratio: Array
  ratio: Array
  advantages: Array
  mask: Array
  is_ratio: Array | None = None
  entropy: Array | None = None


# fn(inputs, config) -> per-token loss [N, T] (or [N, 1]), or (loss, indicators)
# where indicators maps metric names (e.g. "clip_ratio/high_mean") to [N, T] or
# [N, 1] values that `policy_loss` averages over the completion tokens.
TokenLossFn = Callable[[LossInputs, LossConfig], "Array | tuple[Array, dict[str, Array]]"]


def _seq_mean_token_mean(loss_NT, mask, config, num_items_in_batch):
  per_row = jnp.sum(jnp.where(mask > 0, loss_NT, 0.0), axis=-1)
  return jnp.mean(per_row / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))


def _batch_token_mean(loss_NT, mask, config, num_items_in_batch):
  return jnp.sum(jnp.where(mask > 0, loss_NT, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _seq_mean_token_sum_norm(loss_NT, mask, config, num_items_in_batch):
  length = config.max_completion_length or mask.shape[-1]
  return jnp.sum(jnp.where(mask > 0, loss_NT, 0.0)) / (mask.shape[0] * length)


def _seq_sum_mean(loss_NT, mask, config, num_items_in_batch):
  return jnp.mean(jnp.sum(jnp.where(mask > 0, loss_NT, 0.0), axis=-1))


def _global_token_mean(loss_NT, mask, config, num_items_in_batch):
  if num_items_in_batch is None:
    num_items_in_batch = jnp.sum(mask)
  total = jnp.sum(jnp.where(mask > 0, loss_NT, 0.0))
  return total / jnp.maximum(jnp.asarray(num_items_in_batch, jnp.float32), 1.0)


AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": Aggregation(_seq_mean_token_mean),  # grpo, sapo: mean of row means
    # bnpo: token mean over this batch
    "batch_token_mean": Aggregation(_batch_token_mean, part_weight=lambda part, whole: (
        jnp.maximum(jnp.sum(part), 1.0) / jnp.maximum(jnp.sum(whole), 1.0))),
    # dr_grpo: sum / (N * max_completion_length)
    "seq_mean_token_sum_norm": Aggregation(_seq_mean_token_sum_norm),
    # luspo: mean over rows of each row's token sum (a row weighs its length)
    "seq_sum_mean": Aggregation(_seq_sum_mean),
    # dapo, cispo: sum / num_items_in_batch
    "global_token_mean": Aggregation(_global_token_mean, by_batch_tokens=True,
                                     part_weight=lambda part, whole: 1.0),
}


def aggregation(loss_type: str) -> Aggregation:
  """The Aggregation of the loss registered as `loss_type`."""
  return AGGREGATIONS[LOSSES.get(loss_type).aggregation]


@dataclasses.dataclass(frozen=True)
class _Registered:
  fn: TokenLossFn
  aggregation: str
  applies_is_ratio: bool = False
  options: Options = dataclasses.field(default_factory=Options)


LOSSES: Registry[_Registered] = Registry("loss.loss_type")


def register_loss(name: str, *, aggregation: str = "global_token_mean",
                  applies_is_ratio: bool = False, options: Mapping[str, Any] | None = None,
                  override: bool = False):
  """Decorator: registers a per-token loss under `name` for `loss.loss_type`.

  Example (in research code, outside grpojax):

    @grpojax.core.losses.register_loss("clipped_reinforce", options={"cap": 1.2})
    def clipped_reinforce(x, config):
      weight = jax.lax.stop_gradient(jnp.minimum(x.ratio, config.options["cap"]))
      return -weight * x.advantages * x.logps

  and `--config.loss.loss_type=clipped_reinforce`, with `c.loss.options = {"cap": 1.5}`
  in the experiment (then `--config.loss.options.cap=2.0` overrides it).

  Args:
    name: the loss_type name.
    aggregation: one of AGGREGATIONS; how `[N, T]` becomes a scalar.
    applies_is_ratio: the loss uses `inputs.is_ratio` itself; otherwise
      `policy_loss` multiplies its per-token loss by it.
    options: the loss's own hyper-parameters, {name: default}: `config.options`
      holds them, the config's `loss.options` over the defaults; any other name
      given there is an error at startup.
    override: replace another loss already registered under `name` (without
      it that raises; registering the same function again is a no-op).
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation={aggregation!r} is unknown; known: {list(AGGREGATIONS)}")

  def decorator(fn: TokenLossFn) -> TokenLossFn:
    LOSSES.register(name, _Registered(fn, aggregation, applies_is_ratio, Options(options)),
                    override=override)
    return fn

  return decorator


def get_loss(name: str) -> _Registered:
  return LOSSES.get(name)


def _clipped_surrogate(x: LossInputs, config: LossConfig):
  """PPO's pessimistic clipped objective, with clip-higher and the optional delta cap."""
  clipped = jnp.clip(x.ratio, 1 - config.epsilon_low, 1 + config.eps_high)
  unclipped = x.ratio if config.delta is None else jnp.minimum(x.ratio, config.delta)
  loss = -jnp.minimum(unclipped * x.advantages, clipped * x.advantages)
  low = (x.ratio < 1 - config.epsilon_low) & (x.advantages < 0)
  high = (x.ratio > 1 + config.eps_high) & (x.advantages > 0)
  return loss, {
      "clip_ratio/low_mean": low,
      "clip_ratio/high_mean": high,
      "clip_ratio/region_mean": low | high,
  }


register_loss("grpo", aggregation="seq_mean_token_mean")(_clipped_surrogate)
register_loss("bnpo", aggregation="batch_token_mean")(_clipped_surrogate)
register_loss("dr_grpo", aggregation="seq_mean_token_sum_norm")(_clipped_surrogate)
register_loss("dapo", aggregation="global_token_mean")(_clipped_surrogate)
# LUSPO: GSPO's clipped sequence ratio (importance_sampling_level="sequence"),
# with each row's loss summed over its tokens, so longer rows are not damped.
register_loss("luspo", aggregation="seq_sum_mean")(_clipped_surrogate)


@register_loss("cispo", aggregation="global_token_mean")
def _cispo(x: LossInputs, config: LossConfig):
  """CISPO (MiniMax-M1): REINFORCE weighted by the stopped, capped ratio; every
  token keeps a gradient, clipping only bounds its weight."""
  weight = jax.lax.stop_gradient(jnp.minimum(x.ratio, config.eps_high))
  high = (x.ratio > config.eps_high) & (x.advantages > 0)
  return -weight * x.advantages * x.logps, {
      "clip_ratio/high_mean": high,
      "clip_ratio/region_mean": high,
  }


@register_loss("sapo", aggregation="seq_mean_token_mean")
def _sapo(x: LossInputs, config: LossConfig):
  """SAPO: a smooth gate `sigmoid(tau (r - 1)) * 4 / tau` instead of the hard
  clip; its slope is 1 at r = 1, so on-policy it is plain policy gradient. A
  larger tau for negative advantages damps them faster off-policy."""
  tau = jnp.where(x.advantages > 0, config.sapo_tau_pos, config.sapo_tau_neg)
  gate = jax.nn.sigmoid(tau * (x.ratio - 1.0)) * 4.0 / tau
  return -gate * x.advantages


# VESPO clamps log w below at log(1e-8), as its reference code does.
_VESPO_MIN_LOG_W = math.log(1e-8)


@register_loss("vespo", aggregation="global_token_mean", applies_is_ratio=True)
def _vespo(x: LossInputs, config: LossConfig):
  """VESPO: REINFORCE weighted by a smooth gamma function of the sequence ratio
  w = prod_t pi/pi_old (times the sampler correction, if on):
  phi(w) = e^lambda w^k e^(-lambda w), 1 at w = 1, decaying on both sides;
  phi carries no gradient, it only scales each row's."""
  log_w = jnp.sum(jnp.clip(x.logps - x.old_logps, -_MAX_LOG_RATIO, _MAX_LOG_RATIO) * x.mask,
                  axis=-1, keepdims=True)
  if x.is_ratio is not None:
    # Summed over every position, masked ones included (their ratio is 1), as TRL.
    log_w = log_w + jnp.sum(jnp.clip(jnp.log(x.is_ratio), _VESPO_MIN_LOG_W, _MAX_LOG_RATIO),
                            axis=-1, keepdims=True)
  log_w = jnp.clip(log_w, _VESPO_MIN_LOG_W, _MAX_LOG_RATIO)
  nonneg = x.advantages >= 0
  k = jnp.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
  lam = jnp.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg)
  phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
  phi = jax.lax.stop_gradient(jnp.where(jnp.isfinite(phi), phi, 0.0))
  return -phi * x.advantages * x.logps, {"vespo/phi_seq_mean": phi}


def kl_penalty(logps: Array, ref_logps: Array, estimator: str = "k3") -> Array:
  """Per-token estimate of KL(policy || reference) from samples of the policy.

  Args:
    logps, ref_logps: [N, T].
    estimator: k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - log(q/p) - 1.

  Returns:
    [N, T]; k2 and k3 are >= 0 and all are 0 where the two agree.
  """
  log_qp = jnp.clip(ref_logps - logps, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  if estimator == "k1":
    return -log_qp
  if estimator == "k2":
    return 0.5 * log_qp**2
  if estimator == "k3":
    return jnp.exp(log_qp) - log_qp - 1.0
  raise ValueError(f"loss.kl_estimator={estimator!r} is unknown; known: {list(KL_ESTIMATORS)}")


def _masked_mean(x: Array, mask: Array) -> tuple[Array, Array]:
  """(sum, count) of x over completion tokens; a [N, 1] x over non-empty rows. A
  metric is kept as the pair so that parts of a batch (micro-batches) add up to
  the whole batch's mean exactly, whichever the unit."""
  if x.shape[-1] == 1 and mask.shape[-1] != 1:
    mask = (jnp.sum(mask, axis=-1, keepdims=True) > 0).astype(mask.dtype)
  x = jnp.broadcast_to(x.astype(jnp.float32), mask.shape)
  return jnp.sum(jnp.where(mask > 0, x, 0.0)), jnp.sum(mask).astype(jnp.float32)


def importance_sampling_ratio(old_logps: Array, sampler_logps: Array, mask: Array,
                              config: LossConfig) -> Array:
  """The rollout/trainer mismatch weight exp(trainer - sampler log-prob), as TRL's
  vLLM importance sampling (config.importance_sampling_mode and its bounds).

  Args:
    old_logps: [N, T] the trainer's log-probs of the sampled tokens (no gradient).
    sampler_logps: [N, T] the sampler's log-probs of the same tokens.
    mask: [N, T].

  Returns:
    [N, T] for token_* modes, [N, 1] for sequence_* modes (the summed gap);
    1 where the two agree, clipped or zeroed outside the bounds.
  """
  gap = jnp.where(mask > 0, jnp.nan_to_num(old_logps - sampler_logps), 0.0)
  if config.importance_sampling_mode.startswith("sequence"):
    gap = jnp.sum(gap, axis=-1, keepdims=True)
  # Clamped only where exp would overflow float32; any bound < e^80 acts the same.
  ratio = jnp.exp(jnp.minimum(gap, 80.0))
  lo, hi = config.importance_sampling_clip_min, config.importance_sampling_clip_max
  if config.importance_sampling_mode.endswith("truncate"):
    return jnp.clip(ratio, lo, hi)
  outside = jnp.zeros(ratio.shape, bool)
  if lo is not None:
    outside |= ratio < lo
  if hi is not None:
    outside |= ratio > hi
  return jnp.where(outside, 0.0, ratio)


def behaviour_weight(proximal_logps: Array, behaviour_logps: Array, mask: Array,
                     cap: float | None) -> Array:
  """AReaL's decoupled-PPO weight [N, T]: exp(proximal - behaviour log-prob) of each
  token, 0 where it exceeds `cap` (AReaL masks those tokens, it does not clip them)
  and where mask is 0. All [N, T]."""
  gap = jnp.where(mask > 0, jnp.nan_to_num(proximal_logps - behaviour_logps), 0.0)
  weight = jnp.exp(jnp.minimum(gap, 80.0))
  keep = mask > 0
  if cap is not None:
    keep &= weight <= cap
  return jnp.where(keep, weight, 0.0)


def off_policy_mask(advantages: Array, logps: Array, sampler_logps: Array, mask: Array,
                    threshold: float) -> Array:
  """DeepSeek-V3.2's off-policy sequence mask: [N, 1], 0 for rows with A < 0 whose
  mean per-token KL(sampler || policy) (k1: sampler - policy log-prob) exceeds
  `threshold`, else 1. advantages: [N, 1]; the rest [N, T]."""
  gap = jnp.where(mask > 0, jnp.nan_to_num(sampler_logps - jax.lax.stop_gradient(logps)), 0.0)
  mean_kl = jnp.sum(gap, axis=-1, keepdims=True) / jnp.maximum(
      jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  return ((advantages >= 0) | (mean_kl <= threshold)).astype(jnp.float32)


def entropy_quantile(entropy: Array, mask: Array, quantile: float) -> Array:
  """[]: the entropy above which a token is in the top `quantile` fraction of the
  completion tokens (linear interpolation, as torch.quantile); NaN if none."""
  return jnp.nanquantile(jnp.where(mask > 0, entropy, jnp.nan).astype(jnp.float32),
                         1.0 - quantile)


def policy_loss(
    logps: Array,
    old_logps: Array | None,
    advantages: Array,
    mask: Array,
    *,
    config: LossConfig,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | int | None = None,
    entropy: Array | None = None,
    sampler_logps: Array | None = None,
    entropy_threshold: Array | None = None,
    entropy_tokens: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """The GRPO-family policy loss for one (mini)batch.

  In TRL's order: the registered per-token loss, times the off-policy mask,
  the high-entropy mask and the sampler correction; plus beta x the per-token
  KL; aggregated; minus entropy_coef x the mean entropy.

  Args:
    logps: [N, T] policy log-probs of the completion tokens (differentiable).
    old_logps: [N, T] log-probs under the policy that sampled them; None means
      on-policy, i.e. `stop_gradient(logps)` (ratio 1, no extra forward pass).
    advantages: [N] per-completion advantages, shared by its tokens, or [N, T]
      per token (advantage.estimator=gae).
    mask: [N, T] the loss mask: 1 on the tokens trained, 0 on padding, after EOS
      and on tokens that exist but are not trained (a tool's response: TRL's
      completion_mask * tool_mask). Everything here reads it: the losses, the
      sequence-level ratio, KL, entropy, every normaliser and metric.
    config: a LossConfig.
    ref_logps: [N, T] reference-model log-probs; required when config.beta > 0.
    num_items_in_batch: masked-token count of the whole generation batch (dapo,
      cispo's normaliser, so minibatch losses sum to the batch's token mean);
      None means this batch's count.
    entropy: [N, T] per-token entropies of the policy; differentiable for the
      entropy bonus; required by top_entropy_quantile < 1 and entropy_coef > 0,
      else only for the metric.
    sampler_logps: [N, T] the sampler's log-probs of the tokens; required by
      importance_sampling_correction; the off-policy mask measures the gap to
      them (to old_logps without them).
    entropy_threshold: [] the high-entropy cut (`entropy_quantile`) when this
      batch is part of a larger one (micro-batches); None: this batch's own.
    entropy_tokens: the entropy bonus's normaliser, likewise; None: this
      batch's count of kept tokens.

  Returns:
    (loss scalar, metrics) with metrics `kl` (0 without a reference),
    `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`,
    `ratio/mean`, `entropy` when given, `sampling/sampling_logp_difference/mean`
    and `/max` with sampler_logps, `sampling/importance_sampling_ratio/min`,
    `/mean` and `/max` with the correction, plus whatever the loss type adds.
  """
  policy, bonus, metrics = loss_terms(
      logps, old_logps, advantages, mask, config=config, ref_logps=ref_logps,
      num_items_in_batch=num_items_in_batch, entropy=entropy, sampler_logps=sampler_logps,
      entropy_threshold=entropy_threshold, entropy_tokens=entropy_tokens)
  return policy - config.entropy_coef * bonus, metric_values(metrics)


def loss_terms(logps, old_logps, advantages, mask, *, config: LossConfig, ref_logps=None,
               num_items_in_batch=None, entropy=None, sampler_logps=None,
               entropy_threshold=None, entropy_tokens=None) -> tuple[Array, Array, dict]:
  """`policy_loss` in its two parts: (policy term with KL, entropy bonus, metrics);
  the loss is policy - entropy_coef x bonus. Arguments as `policy_loss`. The
  update weighs the two differently when it sums micro-batches. Metrics are
  name -> (sum, count) pairs (`metric_values` makes them values)."""
  registered = get_loss(config.loss_type)
  if config.beta > 0 and ref_logps is None:
    raise ValueError(f"loss.beta={config.beta} > 0 needs ref_logps (the reference model's log-probs)")
  for key in ("importance_sampling_correction", "decoupled"):
    if getattr(config, key) and sampler_logps is None:
      raise ValueError(f"loss.{key}=True needs sampler_logps (the sampler's log-probs of the "
                       "completion tokens)")
  if (config.top_entropy_quantile < 1.0 or config.entropy_coef > 0) and entropy is None:
    raise ValueError("loss.top_entropy_quantile < 1 and loss.entropy_coef > 0 need the "
                     "per-token entropy")
  mask = mask.astype(jnp.float32)
  valid = mask > 0
  if old_logps is None:
    old_logps = jax.lax.stop_gradient(logps)
  old_logps = jax.lax.stop_gradient(old_logps)
  zero, one = jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)
  metrics = {}
  is_ratio = None
  if sampler_logps is not None:
    sampler_logps = jax.lax.stop_gradient(sampler_logps).astype(jnp.float32)
    gap = jnp.where(valid, jnp.abs(jnp.nan_to_num(old_logps - sampler_logps)), 0.0)
    metrics["sampling/sampling_logp_difference/mean"] = _masked_mean(gap, mask)
    metrics["sampling/sampling_logp_difference/max"] = (jnp.max(gap), one)
    if config.decoupled:
      is_ratio = behaviour_weight(old_logps, sampler_logps, mask, config.decoupled_clip)
    if config.importance_sampling_correction:
      is_ratio = importance_sampling_ratio(old_logps, sampler_logps, mask, config)
    if is_ratio is not None:
      # Token modes: over completion tokens; sequence modes: over every row (as TRL).
      over = mask if is_ratio.shape == mask.shape else jnp.ones(is_ratio.shape, jnp.float32)
      metrics["sampling/importance_sampling_ratio/min"] = (
          jnp.min(jnp.where(over > 0, is_ratio, jnp.inf)), one)
      metrics["sampling/importance_sampling_ratio/mean"] = _masked_mean(is_ratio, over)
      metrics["sampling/importance_sampling_ratio/max"] = (
          jnp.max(jnp.where(over > 0, is_ratio, -jnp.inf)), one)
  # `where`, not `* mask`: padded positions may hold -inf/-1e4 log-probs and
  # 0 * inf would be NaN, in the value and in the gradient.
  log_ratio = jnp.where(valid, logps - old_logps, 0.0)
  if config.importance_sampling_level == "sequence":
    log_ratio = jnp.sum(log_ratio, axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=-1, keepdims=True), 1.0
    )
  log_ratio = jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  advantages = jnp.asarray(advantages, jnp.float32)
  advantages = advantages if advantages.ndim == 2 else advantages.reshape(-1, 1)
  if entropy is not None:
    entropy = jnp.where(valid, entropy.astype(jnp.float32), 0.0)
  inputs = LossInputs(
      logps=jnp.where(valid, logps, 0.0),
      old_logps=jnp.where(valid, old_logps, 0.0),
      log_ratio=log_ratio,
      ratio=jnp.exp(log_ratio),
      advantages=advantages,
      mask=mask,
      is_ratio=is_ratio,
      entropy=entropy,
  )
  out = registered.fn(inputs, config)
  loss_NT, indicators = out if isinstance(out, tuple) else (out, {})
  loss_NT = jnp.broadcast_to(loss_NT, mask.shape)

  if config.off_policy_mask_threshold is not None:
    keep_N1 = off_policy_mask(advantages, logps, old_logps if sampler_logps is None else sampler_logps,
                              mask, config.off_policy_mask_threshold)
    loss_NT = loss_NT * keep_N1
    metrics["off_policy_mask/dropped_tokens"] = _masked_mean(1.0 - keep_N1, mask)
  kept = mask
  if config.top_entropy_quantile < 1.0:
    threshold = jax.lax.stop_gradient(
        entropy_quantile(entropy, mask, config.top_entropy_quantile)
        if entropy_threshold is None else entropy_threshold)
    kept = (valid & (jax.lax.stop_gradient(entropy) >= threshold)).astype(jnp.float32)
    loss_NT = loss_NT * kept
  if is_ratio is not None and not registered.applies_is_ratio:
    loss_NT = loss_NT * is_ratio

  if ref_logps is not None:
    kl_NT = kl_penalty(inputs.logps, jnp.where(valid, ref_logps, 0.0), config.kl_estimator)
    if config.use_bias_correction_kl:
      # The ratio keeps its gradient: d(r k3) = r dk3 + k3 dr, the reverse-KL's
      # score-function term that k3 alone leaves out.
      kl_NT = kl_NT * inputs.ratio
    if config.beta > 0:
      loss_NT = loss_NT + config.beta * kl_NT
    kl = _masked_mean(kl_NT, mask)
  else:
    kl = (zero, one)

  policy = AGGREGATIONS[registered.aggregation].fn(loss_NT, mask, config, num_items_in_batch)
  bonus = zero
  if config.entropy_coef > 0:
    if entropy_tokens is None:
      entropy_tokens = jnp.sum(kept)
    bonus = jnp.sum(entropy * kept) / jnp.maximum(entropy_tokens, 1.0)
  metrics.update({
      "kl": kl,
      "clip_ratio/low_mean": (zero, one),
      "clip_ratio/high_mean": (zero, one),
      "clip_ratio/region_mean": (zero, one),
      "ratio/mean": _masked_mean(inputs.ratio, mask),
  })
  metrics.update({k: _masked_mean(v, mask) for k, v in indicators.items()})
  if entropy is not None:
    metrics["entropy"] = _masked_mean(entropy, mask)
  metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
  return policy, bonus, metrics


def metric_values(parts: dict[str, tuple[Array, Array]]) -> dict[str, Array]:
  """The metrics of `loss_terms` (name -> (sum, count), each [] or [S] over S
  parts of one batch) as values of the whole: names ending in /min and /max are
  the min and max over parts, the rest sum / count."""
  out = {}
  for name, (total, count) in parts.items():
    if name.endswith("/min"):
      out[name] = jnp.min(total)
    elif name.endswith("/max"):
      out[name] = jnp.max(total)
    else:
      out[name] = jnp.sum(total) / jnp.maximum(jnp.sum(count), 1.0)
  return out

