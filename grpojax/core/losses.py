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
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from grpojax.registry import Registry

Array = jax.Array

KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
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

  def __post_init__(self):
    def fail(key, msg):
      raise ValueError(f"loss.{key}={getattr(self, key)!r}: {msg}")

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

  @property
  def eps_high(self) -> float:
    return self.epsilon_low if self.epsilon_high is None else self.epsilon_high


class LossInputs(NamedTuple):
  """What a registered per-token loss receives.

  logps: [N, T] policy log-probs (differentiable).
  old_logps: [N, T] behaviour-policy log-probs (no gradient).
  log_ratio: [N, T] (token level) or [N, 1] (sequence level), masked positions 0.
  ratio: exp(log_ratio), same shape.
  advantages: [N, 1].
  mask: [N, T] float, 1 on completion tokens.
  """

  logps: Array
  old_logps: Array
  log_ratio: Array
  ratio: Array
  advantages: Array
  mask: Array


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


LOSSES: Registry[_Registered] = Registry("loss.loss_type")


def register_loss(name: str, *, aggregation: str = "global_token_mean", override: bool = False):
  """Decorator: registers a per-token loss under `name` for `loss.loss_type`.

  Example (in research code, outside grpojax):

    @grpojax.core.losses.register_loss("clipped_reinforce")
    def clipped_reinforce(x, config):
      weight = jax.lax.stop_gradient(jnp.minimum(x.ratio, 1 + config.eps_high))
      return -weight * x.advantages * x.logps

  Args:
    name: the loss_type name.
    aggregation: one of AGGREGATIONS; how `[N, T]` becomes a scalar.
    override: replace another loss already registered under `name` (without
      it that raises; registering the same function again is a no-op).
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation={aggregation!r} is unknown; known: {list(AGGREGATIONS)}")

  def decorator(fn: TokenLossFn) -> TokenLossFn:
    LOSSES.register(name, _Registered(fn, aggregation), override=override)
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


def _masked_mean(x: Array, mask: Array) -> Array:
  """Mean of x over completion tokens; a [N, 1] x is averaged over non-empty rows."""
  if x.shape[-1] == 1 and mask.shape[-1] != 1:
    mask = (jnp.sum(mask, axis=-1, keepdims=True) > 0).astype(mask.dtype)
  x = jnp.broadcast_to(x.astype(jnp.float32), mask.shape)
  return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


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
) -> tuple[Array, dict[str, Array]]:
  """The GRPO-family policy loss for one (mini)batch.

  Args:
    logps: [N, T] policy log-probs of the completion tokens (differentiable).
    old_logps: [N, T] log-probs under the policy that sampled them; None means
      on-policy, i.e. `stop_gradient(logps)` (ratio 1, no extra forward pass).
    advantages: [N] per-completion advantages, shared by its tokens.
    mask: [N, T] 1 on completion tokens, 0 on padding and after EOS.
    config: a LossConfig.
    ref_logps: [N, T] reference-model log-probs; required when config.beta > 0.
    num_items_in_batch: masked-token count of the whole generation batch (dapo,
      cispo's normaliser, so minibatch losses sum to the batch's token mean);
      None means this batch's count.
    entropy: optional [N, T] per-token entropies, only for the metric.

  Returns:
    (loss scalar, metrics) with metrics `kl` (0 without a reference),
    `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`,
    `ratio/mean`, `entropy` when given, plus whatever the loss type adds.
  """
  registered = get_loss(config.loss_type)
  if config.beta > 0 and ref_logps is None:
    raise ValueError(f"loss.beta={config.beta} > 0 needs ref_logps (the reference model's log-probs)")
  mask = mask.astype(jnp.float32)
  valid = mask > 0
  if old_logps is None:
    old_logps = jax.lax.stop_gradient(logps)
  old_logps = jax.lax.stop_gradient(old_logps)
  # `where`, not `* mask`: padded positions may hold -inf/-1e4 log-probs and
  # 0 * inf would be NaN, in the value and in the gradient.
  log_ratio = jnp.where(valid, logps - old_logps, 0.0)
  if config.importance_sampling_level == "sequence":
    log_ratio = jnp.sum(log_ratio, axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=-1, keepdims=True), 1.0
    )
  log_ratio = jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  inputs = LossInputs(
      logps=jnp.where(valid, logps, 0.0),
      old_logps=jnp.where(valid, old_logps, 0.0),
      log_ratio=log_ratio,
      ratio=jnp.exp(log_ratio),
      advantages=jnp.asarray(advantages, jnp.float32).reshape(-1, 1),
      mask=mask,
  )
  out = registered.fn(inputs, config)
  loss_NT, indicators = out if isinstance(out, tuple) else (out, {})
  loss_NT = jnp.broadcast_to(loss_NT, mask.shape)

  if ref_logps is not None:
    kl_NT = kl_penalty(inputs.logps, jnp.where(valid, ref_logps, 0.0), config.kl_estimator)
    if config.beta > 0:
      loss_NT = loss_NT + config.beta * kl_NT
    kl = _masked_mean(kl_NT, mask)
  else:
    kl = jnp.zeros((), jnp.float32)

  loss = AGGREGATIONS[registered.aggregation].fn(loss_NT, mask, config, num_items_in_batch)
  zero = jnp.zeros((), jnp.float32)
  metrics = {
      "kl": kl,
      "clip_ratio/low_mean": zero,
      "clip_ratio/high_mean": zero,
      "clip_ratio/region_mean": zero,
      "ratio/mean": _masked_mean(inputs.ratio, mask),
  }
  metrics.update({k: _masked_mean(v, mask) for k, v in indicators.items()})
  if entropy is not None:
    metrics["entropy"] = _masked_mean(entropy, mask)
  metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
  return loss, metrics
