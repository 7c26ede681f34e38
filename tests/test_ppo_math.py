"""core/ppo.py against hand-worked numbers and TRL 0.21's PPO trainer code (torch).

Axes: N rows (completions), T completion positions. Masks are [N, T], 1 on a
row's tokens through its EOS; value_mask adds the slot after (TRL's
~padding_mask_p1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.core import ppo

# Float32 (grpojax) against float64 (the torch oracle): O(1) values, T = 7.
ATOL = 1e-5

# Most tests call the functions jitted: one compile each per shape, where eager
# dispatch compiles every op. The hand-worked tests call them eagerly, and
# test_every_function_jits checks that both agree.
token_rewards = jax.jit(ppo.token_rewards, static_argnames="whiten")
gae = jax.jit(ppo.gae, static_argnames="whiten")
value_loss = jax.jit(ppo.value_loss)
masked_whiten = jax.jit(ppo.masked_whiten, static_argnames="shift_mean")


def _lengths_mask(lengths, T):
  return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _finite(*xs):
  return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in xs)


# --- hand-worked -------------------------------------------------------------


def test_hand_worked_rewards_and_gae():
  # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72), kl_coef = 0.5, T = 3.
  # Row 0, length 3 (fills T): kl [0.2, 0.4, -0.2], score 1.0, V [0.5, 0.4, 0.3].
  #   rewards -0.5 * kl = [-0.1, -0.2, 0.1]; no slot after the end, so the score
  #   goes on the last token: [-0.1, -0.2, 1.1].
  #   deltas r_t + 0.9 V_{t+1} - V_t: t2 1.1 - 0.3 = 0.8;
  #     t1 -0.2 + 0.27 - 0.4 = -0.33; t0 -0.1 + 0.36 - 0.5 = -0.24.
  #   A2 = 0.8; A1 = -0.33 + 0.72 * 0.8 = 0.246; A0 = -0.24 + 0.72 * 0.246 = -0.06288.
  #   returns A + V = [0.43712, 0.646, 1.1].
  # Row 1, length 2: kl [0.0, 0.2, 5.0 (padding: ignored)], score 2.0,
  #   V [0.2, 0.6, 0.9] (slot 2 is the state after the last token: kept).
  #   rewards [0, -0.1, 0] and the score on slot 2 (TRL's actual_end = length):
  #   [0.0, -0.1, 2.0].
  #   deltas: t2 2.0 - 0.9 = 1.1; t1 -0.1 + 0.81 - 0.6 = 0.11; t0 0 + 0.54 - 0.2 = 0.34.
  #   A2 = 1.1; A1 = 0.11 + 0.72 * 1.1 = 0.902; A0 = 0.34 + 0.72 * 0.902 = 0.98944.
  #   returns [1.18944, 1.502, 2.0].
  # (lam = 1 would give row 0's A1 = -0.33 + 0.9 * 0.8 = 0.39, far outside 1e-6.)
  mask = jnp.array([[1, 1, 1], [1, 1, 0]], jnp.float32)
  kl = jnp.array([[0.2, 0.4, -0.2], [0.0, 0.2, 5.0]])
  scores = jnp.array([1.0, 2.0])
  values = jnp.array([[0.5, 0.4, 0.3], [0.2, 0.6, 0.9]])

  rewards = ppo.token_rewards(scores, kl, mask, 0.5)
  np.testing.assert_allclose(rewards, [[-0.1, -0.2, 1.1], [0.0, -0.1, 2.0]], atol=1e-6)

  adv, ret = ppo.gae(rewards, values, mask, 0.9, 0.8, whiten=False)
  raw = np.array([[-0.06288, 0.246, 0.8], [0.98944, 0.902, 0.0]])
  np.testing.assert_allclose(adv, raw, atol=1e-6)
  np.testing.assert_allclose(ret, [[0.43712, 0.646, 1.1], [1.18944, 1.502, 2.0]], atol=1e-6)

  # Whitened over the 5 real tokens with the unbiased variance; the padding slot
  # (row 1, slot 2) is 0 although its raw advantage was 1.1.
  real = raw[np.asarray(mask) == 1]
  want = (raw - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) * np.asarray(mask)
  adv_w, ret_w = ppo.gae(rewards, values, mask, 0.9, 0.8)
  np.testing.assert_allclose(adv_w, want, atol=1e-6)
  np.testing.assert_allclose(ret_w, ret, atol=1e-6)


def test_hand_worked_value_loss():
  # One row of length 1, T = 3: the value mask is slots 0 and 1 (1 = after the end).
  # cliprange 0.2. Slot 0: v 1.0 clipped into [0.3, 0.7] -> 0.7, R 1.2:
  #   unclipped 0.04, clipped 0.25 -> 0.25, clipped larger.
  # Slot 1: v 0.0 inside [0.0, 0.4], R -0.3: both 0.09 -> 0.09, not larger.
  # Slot 2 (v = 9) is off the value mask.
  # loss = 0.5 * (0.25 + 0.09) / 2 = 0.085; clipfrac 1/2. (The plain mask would
  # give 0.125 and 1.0.)
  mask = jnp.array([[1, 0, 0]], jnp.float32)
  loss, clipfrac = ppo.value_loss(jnp.array([[1.0, 0.0, 9.0]]), jnp.array([[0.5, 0.2, 0.0]]),
                                  jnp.array([[1.2, -0.3, 7.0]]), mask, 0.2)
  np.testing.assert_allclose(loss, 0.085, atol=1e-6)
  np.testing.assert_allclose(clipfrac, 0.5, atol=1e-6)


# --- TRL's own code, in torch ------------------------------------------------

INVALID_LOGPROB = 1.0  # trl/trainer/ppo_trainer.py line 81


def _trl_masked_mean(values, mask, axis=None):
  # trl 0.21 trl/core.py lines 43-48
  if axis is not None:
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
  return (values * mask).sum() / mask.sum()


def _trl_masked_var(values, mask, unbiased=True):
  # trl/core.py lines 51-67
  mean = _trl_masked_mean(values, mask)
  centered_values = values - mean
  variance = _trl_masked_mean(centered_values**2, mask)
  if unbiased:
    mask_sum = mask.sum()
    if mask_sum == 0:
      raise ValueError("The sum of the mask is zero")
    bessel_correction = mask_sum / (mask_sum - 1)
    variance = variance * bessel_correction
  return variance


def _trl_masked_whiten(values, mask, shift_mean=True):
  # trl/core.py lines 70-76
  import torch
  mean, var = _trl_masked_mean(values, mask), _trl_masked_var(values, mask)
  whitened = (values - mean) * torch.rsqrt(var + 1e-8)
  if not shift_mean:
    whitened += mean
  return whitened


def _trl_ppo_reference(logprobs, ref_logprobs, values, scores, vpred, sequence_lengths, *,
                       kl_coef, kl_estimator, whiten_rewards, gamma, lam, cliprange_value):
  """TRL 0.21's PPOTrainer.train, trl/trainer/ppo_trainer.py lines 500-535 (rewards,
  advantages, returns) and 565-577 (value loss), line by line; `args.` dropped and
  the minibatch indexing left out (the whole batch is one minibatch).
  sequence_lengths: TRL's, i.e. each row's length - 1 (its EOS index)."""
  import torch
  responses_shape = logprobs.shape
  response_idxs = torch.arange(responses_shape[1]).repeat(responses_shape[0], 1)
  padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
  logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
  ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
  sequence_lengths_p1 = sequence_lengths + 1
  padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
  values = torch.masked_fill(values, padding_mask_p1, 0)

  logr = ref_logprobs - logprobs
  kl = -logr if kl_estimator == "k1" else (logr.exp() - 1) - logr
  non_score_reward = -kl_coef * kl
  rewards = non_score_reward.clone()
  actual_start = torch.arange(rewards.size(0))
  actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1,
                           sequence_lengths)
  # TRL writes rewards[[actual_start, actual_end]]: a list index that torch >= 2.9
  # reads as one tensor index; the tuple is what TRL 0.21 meant and got.
  rewards[(actual_start, actual_end)] += scores

  if whiten_rewards:
    rewards = _trl_masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
    rewards = torch.masked_fill(rewards, padding_mask_p1, 0)

  lastgaelam = 0
  advantages_reversed = []
  gen_length = responses_shape[1]
  for t in reversed(range(gen_length)):
    nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
    delta = rewards[:, t] + gamma * nextvalues - values[:, t]
    lastgaelam = delta + gamma * lam * lastgaelam
    advantages_reversed.append(lastgaelam)
  advantages = torch.stack(advantages_reversed[::-1], axis=1)
  returns = advantages + values
  advantages = _trl_masked_whiten(advantages, ~padding_mask)
  advantages = torch.masked_fill(advantages, padding_mask, 0)

  vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
  vpredclipped = torch.clamp(vpred, values - cliprange_value, values + cliprange_value)
  vf_losses1 = torch.square(vpred - returns)
  vf_losses2 = torch.square(vpredclipped - returns)
  vf_loss_max = torch.max(vf_losses1, vf_losses2)
  vf_loss = 0.5 * _trl_masked_mean(vf_loss_max, ~padding_mask_p1)
  vf_clipfrac = _trl_masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
  return dict(rewards=rewards, advantages=advantages, returns=returns, vf_loss=vf_loss,
              vf_clipfrac=vf_clipfrac)


def _random_batch(seed, N=6, T=7):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, T + 1, N)
  lengths[0], lengths[1] = 0, T  # an empty row and a row with no slot after it
  logprobs = -rng.uniform(0.1, 3.0, (N, T))
  ref_logprobs = logprobs + rng.normal(0, 0.3, (N, T))
  values = rng.normal(0, 1, (N, T))
  return dict(lengths=lengths, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
              scores=rng.normal(0, 2, N), vpred=values + rng.normal(0, 0.3, (N, T)))


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_matches_trl_ppo_trainer(kl_estimator, whiten_rewards, gamma, lam):
  torch = pytest.importorskip("torch")
  b = _random_batch(seed=4 * (kl_estimator == "k3") + 2 * whiten_rewards + (gamma == 1.0))
  kl_coef, cliprange_value = 0.05, 0.2
  t = {k: torch.tensor(v, dtype=torch.float64) for k, v in b.items() if k != "lengths"}
  ref = _trl_ppo_reference(
      t["logprobs"], t["ref_logprobs"], t["values"], t["scores"], t["vpred"],
      torch.tensor(b["lengths"] - 1), kl_coef=kl_coef, kl_estimator=kl_estimator,
      whiten_rewards=whiten_rewards, gamma=gamma, lam=lam, cliprange_value=cliprange_value)

  T = b["logprobs"].shape[1]
  mask = jnp.asarray(_lengths_mask(b["lengths"], T))
  # The KL on every slot, padding included: token_rewards must ignore it there.
  logr = jnp.asarray(b["ref_logprobs"] - b["logprobs"], jnp.float32)
  kl = -logr if kl_estimator == "k1" else jnp.expm1(logr) - logr
  f32 = {k: jnp.asarray(v, jnp.float32) for k, v in b.items()}
  rewards = token_rewards(f32["scores"], kl, mask, kl_coef, whiten=whiten_rewards)
  adv, ret = gae(rewards, f32["values"], mask, gamma, lam)
  loss, clipfrac = value_loss(f32["vpred"], f32["values"], ret, mask, cliprange_value)

  np.testing.assert_allclose(rewards, ref["rewards"].numpy(), atol=ATOL)
  np.testing.assert_allclose(adv, ref["advantages"].numpy(), atol=ATOL)
  np.testing.assert_allclose(ret, ref["returns"].numpy(), atol=ATOL)
  np.testing.assert_allclose(loss, ref["vf_loss"].item(), atol=ATOL)
  np.testing.assert_allclose(clipfrac, ref["vf_clipfrac"].item(), atol=ATOL)
  # The batch must exercise what it claims: some values clipped, some not.
  assert 0 < ref["vf_clipfrac"].item() < 1
  np.testing.assert_array_equal(ppo.value_mask(mask), _lengths_mask(b["lengths"] + 1, T))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_trl(shift_mean):
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(1)
  x = rng.normal(1.5, 2.0, (4, 5))
  mask = rng.uniform(size=(4, 5)) < 0.6
  want = _trl_masked_whiten(torch.tensor(x), torch.tensor(mask), shift_mean=shift_mean)
  got = masked_whiten(jnp.asarray(x, jnp.float32), jnp.asarray(mask), shift_mean=shift_mean)
  # Off the mask too: both leave the affine map there.
  np.testing.assert_allclose(got, want.numpy(), atol=ATOL)
  for unbiased in (True, False):
    np.testing.assert_allclose(
        ppo.masked_var(jnp.asarray(x, jnp.float32), jnp.asarray(mask), unbiased),
        _trl_masked_var(torch.tensor(x), torch.tensor(mask), unbiased).item(), rtol=1e-6)
  np.testing.assert_allclose(
      ppo.masked_mean(jnp.asarray(x, jnp.float32), jnp.asarray(mask), axis=1),
      _trl_masked_mean(torch.tensor(x), torch.tensor(mask), axis=1).numpy(), atol=ATOL)


# --- edge cases --------------------------------------------------------------


def test_empty_row_changes_no_other_row_and_gives_no_nan():
  rng = np.random.default_rng(2)
  T = 5
  lengths = np.array([3, 5, 0, 2])
  kl = jnp.asarray(rng.normal(0, 1, (4, T)), jnp.float32)
  values = jnp.asarray(rng.normal(0, 1, (4, T)), jnp.float32)
  scores = jnp.array([1.0, -0.5, 3.0, 0.25])
  mask = jnp.asarray(_lengths_mask(lengths, T))

  rewards = token_rewards(scores, kl, mask, 0.1, whiten=False)
  adv, ret = gae(rewards, values, mask, 0.95, 0.9)
  keep = np.array([0, 1, 3])
  rewards_k = token_rewards(scores[keep], kl[keep], mask[keep], 0.1)
  adv_k, ret_k = gae(rewards_k, values[keep], mask[keep], 0.95, 0.9)

  assert _finite(rewards, adv, ret)
  # Nothing of the empty row enters the advantages' whitening statistics.
  np.testing.assert_allclose(adv[keep], adv_k, atol=1e-6)
  np.testing.assert_allclose(ret[keep], ret_k, atol=1e-6)
  np.testing.assert_array_equal(adv[2], 0)
  # TRL's empty row: the score on slot 0 (its KL ignored), the bare prompt's
  # value there, so its return is the score; nothing after.
  np.testing.assert_allclose(rewards[2], [3.0, 0, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(ret[2], [3.0, 0, 0, 0, 0], atol=1e-6)

  # A batch of only empty rows: advantages 0, value loss over the slots 0.
  empty = jnp.zeros((2, T))
  r0 = token_rewards(scores[:2], kl[:2], empty, 0.1, whiten=True)
  a0, ret0 = gae(r0, values[:2], empty, 0.95, 0.9)
  loss0, frac0 = value_loss(values[:2], values[:2], ret0, empty, 0.2)
  assert _finite(r0, a0, ret0, loss0, frac0)
  np.testing.assert_array_equal(a0, 0)
  # An empty mask averages to 0, not TRL's 0/0.
  assert float(ppo.masked_mean(kl[:2], empty)) == 0.0


def test_whiten_single_token_gives_no_nan():
  x = jnp.array([[0.3, -1.0, 2.0, 4.0], [7.0, 1.5, -2.0, 0.5]])
  mask = jnp.zeros((2, 4)).at[1, 2].set(1)
  w = masked_whiten(x, mask)
  assert _finite(w)
  # One value: its mean is itself and its variance 0, so it whitens to 0
  # (shift_mean) or stays itself (not). TRL: Bessel's 1/0 makes it NaN.
  assert float(w[1, 2]) == 0.0
  assert float(masked_whiten(x, mask, shift_mean=False)[1, 2]) == -2.0
  assert float(ppo.masked_var(x, mask)) == 0.0
  adv, _ = gae(x, x, mask, 0.9, 0.8)
  assert _finite(adv)
  np.testing.assert_array_equal(adv, 0)
  # A NaN off the mask reaches neither the statistics nor the masked positions.
  dirty = x.at[0, 0].set(jnp.nan)
  mask2 = mask.at[1, 0].set(1)
  assert _finite(ppo.masked_mean(dirty, mask2), ppo.masked_var(dirty, mask2))
  assert _finite(masked_whiten(dirty, mask2)[mask2 != 0])


def test_whiten_single_token_trl_gives_nan():
  torch = pytest.importorskip("torch")
  # The deviation documented above, seen in TRL's own formula.
  w = _trl_masked_whiten(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False]]))
  assert torch.isnan(w[0, 0])


def test_every_function_jits():
  # The hand-worked tests' shapes, so eager dispatch reuses their compiled ops.
  rng = np.random.default_rng(3)
  N, T = 2, 3
  mask = jnp.asarray(_lengths_mask([0, 2], T))
  x, v, v2 = (jnp.asarray(rng.normal(0, 1, (N, T)), jnp.float32) for _ in range(3))
  scores = jnp.asarray(rng.normal(0, 1, N), jnp.float32)
  calls = [
      (ppo.masked_mean, (x, mask), dict(axis=1), ("axis",)),
      (ppo.masked_var, (x, mask), dict(unbiased=True), ("unbiased",)),
      (ppo.masked_whiten, (x, mask), dict(shift_mean=False), ("shift_mean",)),
      (ppo.row_end, (mask,), {}, ()),
      (ppo.value_mask, (mask,), {}, ()),
      (ppo.token_rewards, (scores, x, mask, 0.1), dict(whiten=True), ("whiten",)),
      (ppo.gae, (x, v, mask, 0.99, 0.95), dict(whiten=True), ("whiten",)),
      (ppo.value_loss, (v2, v, x, mask, 0.2), {}, ()),
  ]
  for fn, args, kwargs, static in calls:
    eager = fn(*args, **kwargs)
    jitted = jax.jit(fn, static_argnames=static)(*args, **kwargs)
    for e, j in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
      np.testing.assert_allclose(j, e, atol=1e-6, err_msg=fn.__name__)


def test_value_loss_gradient_finite_and_zero_off_the_value_mask():
  rng = np.random.default_rng(4)
  N, T = 4, 5
  lengths = np.array([2, 5, 0, 3])
  mask = jnp.asarray(_lengths_mask(lengths, T))
  vmask = np.asarray(ppo.value_mask(mask))
  old = jnp.asarray(rng.normal(0, 1, (N, T)), jnp.float32)
  ret = jnp.asarray(rng.normal(0, 1, (N, T)), jnp.float32)
  new = old + jnp.asarray(rng.normal(0, 0.5, (N, T)), jnp.float32)
  # Garbage on the padding slots must change neither the loss nor the gradient.
  dirty = jnp.where(vmask != 0, new, jnp.nan)

  def loss_fn(values, cliprange):
    return value_loss(values, old, ret, mask, cliprange)[0]

  np.testing.assert_allclose(loss_fn(dirty, 0.2), loss_fn(new, 0.2), atol=1e-6)
  for cliprange in (0.2, 1e3):
    grad = jax.grad(loss_fn)(dirty, cliprange)
    assert _finite(grad)
    np.testing.assert_array_equal(np.asarray(grad)[vmask == 0], 0)
  # Unclipped, every value slot is trained, the one after each row's end included
  # (TRL's padding_mask_p1): (v - R) / (number of value slots).
  grad = jax.grad(loss_fn)(new, 1e3)
  np.testing.assert_allclose(grad, vmask * (new - ret) / vmask.sum(), atol=1e-6)
  assert float(grad[0, 2]) != 0.0 and float(grad[2, 0]) != 0.0
