"""PPO with a learned critic: per-token rewards, GAE, value loss: pure, jittable.

Axes: N rows (completions), T completion positions.

This is TRL's classic PPO math (trl 0.21, trl/trainer/ppo_trainer.py lines
500-535 and 565-577; masked_mean/var/whiten from trl/core.py), written so the
same inputs give the same numbers. `advantage.estimator=gae` uses it: the
rollout's `with_gae` (train/rollout.py) and the update's value loss (train/step.py);
the clipped policy surrogate is `grpojax.core.losses`.

Masks are TRL's `~padding_mask`: [N, T], 1 on a row's tokens through its EOS, 0
after. TRL gives the critic one slot more than the policy, and so does this
module: `value_mask(mask)` adds the first slot past each row's end
(`~padding_mask_p1`). That slot's value is the state after the last token, the
score is added there (TRL's `actual_end`; on the last token only when the row
fills all T), and the value loss is trained there, while the advantages and
the policy loss stop at the last token. Rows may be empty (length 0): their only
slot is slot 0, the bare prompt's value, which learns the score. (Scoring the
slot after EOS instead of EOS itself is disputed upstream, huggingface/trl
#1893 and #3750; this module keeps TRL's choice so that it matches TRL.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# TRL's whitening epsilon (trl/core.py masked_whiten: rsqrt(var + 1e-8)).
_WHITEN_EPS = 1e-8


def _weights(mask: Array, dtype) -> Array:
  return jnp.asarray(mask).astype(dtype)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
  """Mean of x over the positions where mask is nonzero (weighted by mask).

  x, mask: same shape (e.g. [N, T]). axis=None reduces everything, as TRL.
  An empty mask gives 0, not TRL's 0/0 = NaN: a jitted step cannot raise, and a
  NaN here would poison the update for a batch with nothing to learn from.
  """
  x = jnp.asarray(x)
  w = _weights(mask, x.dtype)
  # where, not x * w: a NaN or inf in x off the mask must not leak into the sum
  # (TRL multiplies, which is the same for finite x).
  total = jnp.sum(jnp.where(w != 0, x, 0) * w, axis=axis)
  count = jnp.sum(w, axis=axis)
  return jnp.where(count > 0, total / jnp.where(count > 0, count, 1), 0)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
  """Variance [] of x over the whole mask (TRL's masked_var, global only).

  unbiased: Bessel's correction n / (n - 1), n = mask.sum(), as TRL. Where TRL
  fails (n = 0: ValueError; n = 1: 0 * inf = NaN) the correction is skipped,
  so the variance of one or no value is 0.
  """
  mean = masked_mean(x, mask)
  var = masked_mean(jnp.square(x - mean), mask)
  if unbiased:
    n = jnp.sum(_weights(mask, var.dtype))
    var = var * jnp.where(n > 1, n / jnp.where(n > 1, n - 1, 1), 1)
  return var


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True) -> Array:
  """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var over the mask.

  x, mask: [N, T] (any shape). shift_mean=False adds the mean back (only the
  scale changes), as TRL does for whiten_rewards. Off the mask the output holds
  the same affine map of x, as TRL's masked_whiten: callers zero it where it
  matters (token_rewards and gae do, as TRL's trainer does). A mask with a
  single position gives 0 there (shift_mean) or x (not), where TRL gives NaN.
  """
  mean, var = masked_mean(x, mask), masked_var(x, mask)
  whitened = (x - mean) * jax.lax.rsqrt(var + _WHITEN_EPS)
  return whitened if shift_mean else whitened + mean


def row_end(mask: Array) -> Array:
  """[N] int: one past each row's last real token (its length for prefix masks)."""
  idx = jnp.arange(mask.shape[-1])
  return jnp.max(jnp.where(jnp.asarray(mask) != 0, idx + 1, 0), axis=-1)


def value_mask(mask: Array) -> Array:
  """[N, T] the critic's slots: the mask plus the first slot past each row's end.

  TRL's `~padding_mask_p1`. A row filling all T gets no extra slot; an empty row
  gets slot 0. Same dtype as mask.
  """
  idx = jnp.arange(mask.shape[-1])
  return (idx[None, :] <= row_end(mask)[:, None]).astype(jnp.asarray(mask).dtype)


def token_rewards(scores: Array, kl: Array, mask: Array, kl_coef: float | Array, *,
                  whiten: bool = False) -> Array:
  """[N, T] per-token rewards: -kl_coef * kl on the tokens, plus each row's score.

  scores: [N] the reward model's (or verifier's) scalar per row.
  kl: [N, T] per-token KL estimate to the reference (TRL's k1 `logp - ref_logp`
    or k3); ignored off the mask, as TRL's logprobs there are INVALID_LOGPROB
    on both sides and their KL is 0.
  mask: [N, T] real completion tokens.
  whiten: TRL's whiten_rewards: scale (not shift) over value_mask(mask), then 0
    outside it.

  The score goes to slot min(end, T-1), end = row_end(mask): the first slot past
  the last token, or the last token when the row fills all T (TRL's
  `actual_end`). So it reaches the tokens through the critic's value there
  (gamma * V[end] in the last token's delta) and the lambda-weighted GAE tail.
  An empty row's score lands on slot 0.
  """
  T = kl.shape[-1]
  rewards = jnp.where(jnp.asarray(mask) != 0, -kl_coef * kl, 0)
  score_slot = jnp.minimum(row_end(mask), T - 1)
  at_score = jnp.arange(T)[None, :] == score_slot[:, None]
  rewards = rewards + jnp.where(at_score, scores[:, None].astype(rewards.dtype), 0)
  if whiten:
    vmask = value_mask(mask)
    rewards = jnp.where(vmask != 0, masked_whiten(rewards, vmask, shift_mean=False), 0)
  return rewards


def gae(rewards: Array, values: Array, mask: Array, gamma: float | Array, lam: float | Array, *,
        whiten: bool = True) -> tuple[Array, Array]:
  """Generalised advantage estimation, TRL's reversed `lastgaelam` recursion.

  rewards: [N, T] from token_rewards; read on value_mask(mask) only.
  values: [N, T] old critic values; values[:, t] is the state before token t
    (TRL's `full_value[:, context_length - 1 : -1]`), so values[:, end] is the
    state after the last token. 0 outside value_mask(mask), as TRL's
    `masked_fill(values, padding_mask_p1, 0)`: past the end nothing is
    bootstrapped, and V[T] = 0.
  mask: [N, T] real completion tokens.
  whiten: whiten the advantages over the mask (TRL always does).

  Returns (advantages [N, T], returns [N, T]). returns = advantages + values
  before whitening, defined on value_mask(mask) (0 outside): value_loss's
  targets. advantages are 0 off the mask, whitened or not.
  """
  vmask = value_mask(mask) != 0
  values = jnp.where(vmask, values, 0)
  rewards = jnp.where(vmask, rewards, 0)
  next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  deltas = rewards + gamma * next_values - values

  def step(later, delta_t):
    adv_t = delta_t + gamma * lam * later
    return adv_t, adv_t

  # Scan over T (time-major); reverse=True still returns outputs in time order.
  _, advantages_TN = jax.lax.scan(step, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
  advantages = advantages_TN.T
  returns = advantages + values
  if whiten:
    advantages = masked_whiten(advantages, mask)
  advantages = jnp.where(jnp.asarray(mask) != 0, advantages, 0)
  return advantages, returns


def value_loss(new_values: Array, old_values: Array, returns: Array, mask: Array,
               cliprange_value: float | Array) -> tuple[Array, Array]:
  """TRL's clipped value loss over value_mask(mask) and the fraction clipped.

  new_values: [N, T] the critic being trained (TRL's vpred).
  old_values: [N, T] the critic at rollout (gae's values); new values are
    clipped to old +- cliprange_value.
  returns: [N, T] gae's returns.
  mask: [N, T] real completion tokens; the loss reads value_mask(mask), TRL's
    `~padding_mask_p1`, i.e. also the slot after each row's last token.

  Returns (loss [], clipfrac []): 0.5 * masked mean of
  max((v - R)^2, (clip(v) - R)^2), and the masked mean of "clipped one larger".
  The total PPO loss is policy loss + vf_coef * loss. The gradient w.r.t.
  new_values is 0 outside value_mask(mask), even where new_values is not finite.
  """
  vmask = value_mask(mask) != 0
  # where, as TRL's masked_fill(vpred, padding_mask_p1, 0): garbage off the
  # value mask (padding slots) must not reach the loss or the gradient.
  vpred = jnp.where(vmask, new_values, 0)
  old = jnp.where(vmask, old_values, 0)
  returns = jnp.where(vmask, returns, 0)
  vpred_clipped = jnp.clip(vpred, old - cliprange_value, old + cliprange_value)
  losses1 = jnp.square(vpred - returns)
  losses2 = jnp.square(vpred_clipped - returns)
  loss = 0.5 * masked_mean(jnp.maximum(losses1, losses2), vmask)
  clipfrac = masked_mean((losses2 > losses1).astype(loss.dtype), vmask)
  return loss, clipfrac
