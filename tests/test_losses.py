"""core/losses.py: hand-worked values, equivalences between loss types, and the
gradients that must equal REINFORCE (or be zero) -- TRL's GRPOTrainer semantics."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.core import losses
from grpojax.core.losses import LossConfig
from grpojax.run.settings import read as read_settings


ALL_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _cfg(loss_type, **kw):
  if loss_type == "cispo":
    kw.setdefault("epsilon_high", 5.0)
  return LossConfig(loss_type=loss_type, **kw)


def _loss(cfg, logps, old, a, mask, **kw):
  return losses.policy_loss(logps, old, a, mask, config=cfg, **kw)


def _value_and_grad(cfg, logps, old, a, mask, **kw):
  f = lambda lp: _loss(cfg, lp, old, a, mask, **kw)[0]
  return jax.value_and_grad(f)(logps)


def _finite(tree):
  return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree))


def _random_batch(seed, n=6, t=5, *, off_policy=True):
  rng = np.random.default_rng(seed)
  logps = jnp.asarray(-rng.uniform(0.1, 3.0, size=(n, t)), jnp.float32)
  old = logps + jnp.asarray(rng.normal(scale=0.4, size=(n, t)), jnp.float32) if off_policy else None
  a = jnp.asarray(rng.normal(size=n), jnp.float32)
  lengths = rng.integers(1, t + 1, size=n)
  lengths[0] = t
  mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None], jnp.float32)
  return logps, old, a, mask


# --- the hand-worked example ---------------------------------------------------
#
# N=2, T=3, mask [[1,1,1],[1,1,0]], A = [+1, -1], epsilon 0.2 (clip to [0.8, 1.2]).
# ratios: row 0 [1.5, 1.0, 0.5]; row 1 [1.5, 0.5, (3.0 at the padded position)].
# token loss -min(r*A, clip(r)*A):
#   row 0 (A=+1): r=1.5 -> -min(1.5, 1.2) = -1.2; r=1 -> -1; r=0.5 -> -min(0.5, 0.8) = -0.5
#                 row sum -2.7 over 3 tokens
#   row 1 (A=-1): r=1.5 -> -min(-1.5, -1.2) = 1.5; r=0.5 -> -min(-0.5, -0.8) = 0.8
#                 row sum 2.3 over 2 tokens
# total -0.4 over 5 tokens.
HAND_MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
HAND_LOGPS = jnp.array([[-1.0, -2.0, -0.5], [-0.7, -1.2, -2.0]])
HAND_RATIOS = np.array([[1.5, 1.0, 0.5], [1.5, 0.5, 3.0]])
HAND_OLD = HAND_LOGPS - jnp.log(jnp.asarray(HAND_RATIOS, jnp.float32))
HAND_ADV = jnp.array([1.0, -1.0])


@pytest.mark.parametrize(
    "loss_type,kw,expected",
    [
        ("grpo", {}, 0.125),  # mean(-2.7/3, 2.3/2) = mean(-0.9, 1.15)
        ("bnpo", {}, -0.08),  # -0.4 / 5
        ("dr_grpo", {}, -0.4 / 6),  # -0.4 / (N=2 * T=3)
        ("dr_grpo", {"max_completion_length": 4}, -0.05),  # -0.4 / (2 * 4)
        ("dapo", {}, -0.08),  # -0.4 / this batch's 5 tokens
    ],
)
def test_hand_worked_values(loss_type, kw, expected):
  loss, _ = _loss(_cfg(loss_type, **kw), HAND_LOGPS, HAND_OLD, HAND_ADV, HAND_MASK)
  assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_hand_worked_dapo_num_items_in_batch():
  # -0.4 / 10 tokens in the whole generation batch.
  loss, _ = _loss(_cfg("dapo"), HAND_LOGPS, HAND_OLD, HAND_ADV, HAND_MASK, num_items_in_batch=10)
  assert float(loss) == pytest.approx(-0.04, abs=1e-6)


def test_hand_worked_grpo_gradient():
  # d/dlogp of -r*A is -r*A where unclipped, 0 where the clipped branch is taken;
  # grpo divides row i by N*|o_i|: row 0 by 6, row 1 by 4.
  #   row 0: r=1.5 clipped -> 0;  r=1 -> -1/6;  r=0.5 -> -0.5/6 = -1/12
  #   row 1: r=1.5 -> +1.5/4 = 0.375;  r=0.5 clipped -> 0;  padded -> 0
  _, g = _value_and_grad(_cfg("grpo"), HAND_LOGPS, HAND_OLD, HAND_ADV, HAND_MASK)
  np.testing.assert_allclose(g, [[0.0, -1 / 6, -1 / 12], [0.375, 0.0, 0.0]], atol=1e-6)


def test_hand_worked_metrics():
  # low: r < 0.8 with A < 0 -> row 1's r=0.5: 1 of 5 tokens.
  # high: r > 1.2 with A > 0 -> row 0's r=1.5: 1 of 5.  region: 2 of 5.
  # ratio/mean over the 5 tokens: (1.5+1+0.5+1.5+0.5)/5 = 1.0 (the padded 3.0 is out).
  ent = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])  # masked mean 15/5 = 3
  ref = HAND_LOGPS - 1.0  # k3 with ref - logp = -1: e^-1 + 1 - 1 = 0.367879
  _, m = _loss(_cfg("grpo"), HAND_LOGPS, HAND_OLD, HAND_ADV, HAND_MASK, ref_logps=ref, entropy=ent)
  assert float(m["clip_ratio/low_mean"]) == pytest.approx(0.2)
  assert float(m["clip_ratio/high_mean"]) == pytest.approx(0.2)
  assert float(m["clip_ratio/region_mean"]) == pytest.approx(0.4)
  assert float(m["ratio/mean"]) == pytest.approx(1.0, abs=1e-6)
  assert float(m["entropy"]) == pytest.approx(3.0)
  assert float(m["kl"]) == pytest.approx(math.exp(-1), abs=1e-6)


def test_metric_keys_for_every_type():
  logps, old, a, mask = _random_batch(0)
  for t in ALL_TYPES:
    _, m = _loss(_cfg(t), logps, old, a, mask, entropy=jnp.ones_like(logps))
    for k in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
              "ratio/mean", "entropy"):
      assert k in m, (t, k)
    assert float(m["kl"]) == 0.0  # no reference given
  _, m = _loss(_cfg("dapo"), logps, old, a, mask)
  assert "entropy" not in m


def test_cispo_clip_metric():
  # cispo counts tokens whose ratio exceeds the cap itself (5) with A > 0:
  # ratios [6, 2] with A=+1, [6, 0.1] with A=-1 (third column padded) -> 1 of 4.
  logps = jnp.full((2, 3), -1.0)
  old = logps - jnp.log(jnp.array([[6.0, 2.0, 9.0], [6.0, 0.1, 9.0]]))
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
  _, m = _loss(_cfg("cispo"), logps, old, jnp.array([1.0, -1.0]), mask)
  assert float(m["clip_ratio/high_mean"]) == pytest.approx(0.25)
  assert float(m["clip_ratio/region_mean"]) == pytest.approx(0.25)
  assert float(m["clip_ratio/low_mean"]) == 0.0


# --- equivalences -----------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_gspo_on_one_token_sequences_equals_token_level(loss_type):
  # One token per row: the mean log-ratio over the row is that token's log-ratio.
  rng = np.random.default_rng(4)
  logps = jnp.asarray(-rng.uniform(0.1, 3.0, size=(6, 5)), jnp.float32)
  # log-ratios -1, -0.1, 0.1, 0.5, 1.8, 2: below 1-eps, inside, above 1+eps, above cispo's cap 5.
  log_r = jnp.array([-1.0, -0.1, 0.1, 0.5, 1.8, 2.0])[:, None]
  old = logps - log_r
  a = jnp.array([-1.0, 0.5, -0.3, 2.0, 1.0, -1.5])
  # Padded to T = 5 with only t = 0 real, so padding must not leak into the mean.
  mask = jnp.zeros((6, 5)).at[:, 0].set(1.0)
  tok = _value_and_grad(_cfg(loss_type), logps, old, a, mask)
  seq = _value_and_grad(_cfg(loss_type, importance_sampling_level="sequence"), logps, old, a, mask)
  np.testing.assert_allclose(seq[0], tok[0], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(seq[1], tok[1], rtol=1e-5, atol=1e-7)
  assert np.abs(np.asarray(tok[1])).max() > 0


def test_gspo_differs_from_token_level_on_longer_sequences():
  # Guard against the sequence flag being ignored.
  logps, old, a, mask = _random_batch(5)
  tok, _ = _loss(_cfg("grpo"), logps, old, a, mask)
  seq, _ = _loss(_cfg("grpo", importance_sampling_level="sequence"), logps, old, a, mask)
  assert abs(float(tok) - float(seq)) > 1e-4


def test_gspo_hand_worked():
  # Row 0: 2 real tokens with log-ratios ln 2 and 0 (padded position: ln 100).
  # Sequence log-ratio = ln(2)/2 -> ratio sqrt(2) = 1.414214 > 1.2, A = -1:
  # -min(-1.414214, -1.2) = 1.414214 on each token; grpo: row mean 1.414214.
  # Both tokens share r, and the row mean of two equal token losses is -r*A, so
  # d/dlogp_t = -A * r * d(mean log-ratio)/dlogp_t = 1.414214 * 1/2 = 0.707107.
  # A second, all-masked row adds 0 to grpo's mean over N = 2 rows, halving both
  # numbers: loss 0.707107, gradient 0.353553.
  logps = jnp.full((2, 3), -1.0)
  old = logps - jnp.log(jnp.array([[2.0, 1.0, 100.0], [5.0, 5.0, 5.0]]))
  mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
  loss, g = _value_and_grad(_cfg("grpo", importance_sampling_level="sequence"), logps, old,
                            jnp.array([-1.0, 1.0]), mask)
  assert float(loss) == pytest.approx(1.414214 / 2, abs=1e-5)
  np.testing.assert_allclose(g, [[0.353553, 0.353553, 0.0], [0.0, 0.0, 0.0]], atol=1e-6)


def test_grpo_bnpo_dr_grpo_dapo_agree_on_full_rows():
  # All rows of length T: row means of T tokens, the batch token mean, and
  # sum / (N*T) are all sum / (N*T).
  logps, old, a, _ = _random_batch(6)
  mask = jnp.ones_like(logps)
  t = logps.shape[1]
  ref_loss, ref_grad = _value_and_grad(_cfg("grpo"), logps, old, a, mask)
  for lt in ("bnpo", "dr_grpo", "dapo"):
    loss, grad = _value_and_grad(_cfg(lt, max_completion_length=t), logps, old, a, mask)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
  # ...and they differ once lengths differ.
  _, _, _, ragged = _random_batch(6)
  l_grpo, _ = _loss(_cfg("grpo"), logps, old, a, ragged)
  l_bnpo, _ = _loss(_cfg("bnpo"), logps, old, a, ragged)
  assert abs(float(l_grpo) - float(l_bnpo)) > 1e-4


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_on_policy_gradient_is_reinforce_with_group_baseline(loss_type):
  # On-policy every ratio is 1 (nothing clipped, cispo's weight 1, sapo's gate
  # slope 1), so d loss / d logp_{i,t} = -A_i / normaliser on real tokens.
  logps, _, a, mask = _random_batch(7, n=6, t=5)
  n, t = mask.shape
  lengths = np.asarray(mask.sum(-1))
  total = float(mask.sum())
  max_len = 7
  normaliser = {
      "grpo": n * lengths[:, None],
      "sapo": n * lengths[:, None],
      "bnpo": total,
      "dapo": total,
      "cispo": total,
      "dr_grpo": n * max_len,
  }[loss_type]
  expected = -np.asarray(a)[:, None] / normaliser * np.asarray(mask)
  cfg = _cfg(loss_type, max_completion_length=max_len)
  _, g = _value_and_grad(cfg, logps, None, a, mask)
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-8)


def test_cispo_and_sapo_on_policy_match_dapo_and_grpo():
  logps, _, a, mask = _random_batch(8)
  pairs = [("cispo", "dapo"), ("sapo", "grpo")]
  for x, y in pairs:
    gx = _value_and_grad(_cfg(x), logps, None, a, mask)[1]
    gy = _value_and_grad(_cfg(y), logps, None, a, mask)[1]
    np.testing.assert_allclose(gx, gy, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_on_policy_gradient_through_a_toy_policy(loss_type):
  # pi_theta(token | position t) = softmax(theta[t]); the policy-gradient
  # theorem's estimate is grad of -sum(A * logp * mask) / normaliser.
  rng = np.random.default_rng(9)
  n, t, v = 6, 5, 7
  theta = jnp.asarray(rng.normal(size=(t, v)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, size=(n, t)))
  a = jnp.asarray(rng.normal(size=n), jnp.float32)
  mask = jnp.asarray(np.arange(t)[None] < np.array([5, 2, 3, 4, 1, 3])[:, None], jnp.float32)
  max_len = 6

  def logps_of(th):
    logp_TV = jax.nn.log_softmax(th, axis=-1)
    return logp_TV[jnp.arange(t)[None, :], tokens]

  cfg = _cfg(loss_type, max_completion_length=max_len)
  g = jax.grad(lambda th: _loss(cfg, logps_of(th), None, a, mask)[0])(theta)

  lengths = mask.sum(-1, keepdims=True)
  def reinforce(th):
    weighted = a[:, None] * logps_of(th) * mask
    if loss_type in ("grpo", "sapo"):
      return -jnp.mean(jnp.sum(weighted / lengths, -1))
    if loss_type == "dr_grpo":
      return -jnp.sum(weighted) / (n * max_len)
    return -jnp.sum(weighted) / jnp.sum(mask)

  np.testing.assert_allclose(g, jax.grad(reinforce)(theta), rtol=1e-5, atol=1e-7)
  assert np.abs(np.asarray(g)).max() > 1e-3


# --- clipping ------------------------------------------------------------------


def _one_token(ratio, a, logp=-1.0):
  logps = jnp.array([[logp]])
  old = logps - jnp.log(jnp.array([[ratio]], jnp.float32))
  return logps, old, jnp.array([a]), jnp.ones((1, 1))


@pytest.mark.parametrize("loss_type", CLIPPED_TYPES)
def test_clip_zero_and_nonzero_gradients(loss_type):
  cfg = _cfg(loss_type, epsilon_low=0.2, epsilon_high=0.28)
  # ratio 1.5 > 1.28, A > 0: the clipped branch (1.28 * A) is taken: no gradient.
  loss, g = _value_and_grad(cfg, *_one_token(1.5, 1.0))
  assert float(g[0, 0]) == 0.0
  assert float(loss) == pytest.approx(-1.28, abs=1e-6)
  # ratio 0.5 < 0.8, A < 0: -min(-0.5, -0.8) = 0.8, clipped: no gradient.
  loss, g = _value_and_grad(cfg, *_one_token(0.5, -1.0))
  assert float(g[0, 0]) == 0.0
  assert float(loss) == pytest.approx(0.8, abs=1e-6)
  # ratio 1.5 > 1.28 but A < 0: pessimism keeps the unclipped 1.5*A; d/dlogp = -r*A = 1.5.
  loss, g = _value_and_grad(cfg, *_one_token(1.5, -1.0))
  assert float(loss) == pytest.approx(1.5, abs=1e-6)
  assert float(g[0, 0]) == pytest.approx(1.5, abs=1e-6)
  # ratio 0.5 < 0.8 with A > 0: unclipped too; d/dlogp = -0.5.
  _, g = _value_and_grad(cfg, *_one_token(0.5, 1.0))
  assert float(g[0, 0]) == pytest.approx(-0.5, abs=1e-6)
  # Inside [0.8, 1.28]: d/dlogp = -r*A = -1.1 * 2.
  _, g = _value_and_grad(cfg, *_one_token(1.1, 2.0))
  assert float(g[0, 0]) == pytest.approx(-2.2, abs=1e-5)


def test_epsilon_high_defaults_to_epsilon_low():
  # ratio 1.25, A=1: clip at 1.2 (eps_high = eps_low = 0.2) -> loss -1.2, no gradient.
  loss, g = _value_and_grad(_cfg("dapo", epsilon_low=0.2), *_one_token(1.25, 1.0))
  assert float(loss) == pytest.approx(-1.2, abs=1e-6) and float(g[0, 0]) == 0.0
  # With epsilon_high 0.28 it is inside: loss -1.25.
  loss, _ = _value_and_grad(_cfg("dapo", epsilon_high=0.28), *_one_token(1.25, 1.0))
  assert float(loss) == pytest.approx(-1.25, abs=1e-6)


def test_delta_caps_the_unclipped_ratio():
  cfg = _cfg("dapo", epsilon_low=0.2, delta=2.0)
  # A = -1, ratio 3 > delta: -min(min(3, 2)*(-1), 1.2*(-1)) = -(-2) = 2, and
  # min(r, delta) is flat in r there: zero gradient.
  loss, g = _value_and_grad(cfg, *_one_token(3.0, -1.0))
  assert float(loss) == pytest.approx(2.0, abs=1e-6)
  assert float(g[0, 0]) == 0.0
  # Without delta the same token costs 3 and has gradient 3.
  loss, g = _value_and_grad(_cfg("dapo"), *_one_token(3.0, -1.0))
  assert float(loss) == pytest.approx(3.0, abs=1e-5)
  assert float(g[0, 0]) == pytest.approx(3.0, abs=1e-5)
  # Below delta it changes nothing: ratio 1.5, A=-1 -> loss 1.5, gradient 1.5.
  loss, g = _value_and_grad(cfg, *_one_token(1.5, -1.0))
  assert float(loss) == pytest.approx(1.5, abs=1e-6)
  assert float(g[0, 0]) == pytest.approx(1.5, abs=1e-6)


def test_cispo_hand_values():
  cfg = _cfg("cispo", epsilon_high=5.0)
  # ratio 6 > cap 5, A = 1, logp = -0.5: loss = -min(6, 5) * 1 * (-0.5) = 2.5; the
  # weight is stopped, so d/dlogp = -5 * A = -5: capped, but the gradient flows.
  loss, g = _value_and_grad(cfg, *_one_token(6.0, 1.0, logp=-0.5))
  assert float(loss) == pytest.approx(2.5, abs=1e-5)
  assert float(g[0, 0]) == pytest.approx(-5.0, abs=1e-5)
  # ratio 2 under the cap, A = -1: loss = -2 * (-1) * (-0.5) = -1; d/dlogp = 2.
  loss, g = _value_and_grad(cfg, *_one_token(2.0, -1.0, logp=-0.5))
  assert float(loss) == pytest.approx(-1.0, abs=1e-5)
  assert float(g[0, 0]) == pytest.approx(2.0, abs=1e-5)


def test_sapo_hand_values():
  # ratio 1.5, A = 1, tau_pos = 1: gate = sigmoid(0.5) * 4 / 1 = 0.622459 * 4 = 2.489836,
  # loss = -2.489836.  d/dlogp = -sigmoid'(0.5) * 4 * r * A
  #   = -(0.622459 * 0.377541) * 4 * 1.5 = -0.235004 * 6 = -1.410025.
  cfg = _cfg("sapo")
  loss, g = _value_and_grad(cfg, *_one_token(1.5, 1.0))
  assert float(loss) == pytest.approx(-2.489836, abs=1e-5)
  assert float(g[0, 0]) == pytest.approx(-1.410025, abs=1e-5)
  # A = -1 uses tau_neg = 1.05: sigmoid(0.525) = 1/(1 + 0.591555) = 0.628315;
  # gate 0.628315 * 4 / 1.05 = 2.393581; loss = +2.393581.
  loss, _ = _value_and_grad(cfg, *_one_token(1.5, -1.0))
  assert float(loss) == pytest.approx(2.393581, abs=1e-5)


# --- KL -------------------------------------------------------------------------


def test_kl_estimators_hand_values():
  logps = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-2.0, -1.0]])
  # log(q/p) = ref - logp = [-1, +1]
  np.testing.assert_allclose(losses.kl_penalty(logps, ref, "k1"), [[1.0, -1.0]], atol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logps, ref, "k2"), [[0.5, 0.5]], atol=1e-6)
  # k3: e^-1 - (-1) - 1 = 0.367879; e^1 - 1 - 1 = 0.718282
  np.testing.assert_allclose(losses.kl_penalty(logps, ref, "k3"), [[0.367879, 0.718282]], atol=1e-6)
  with pytest.raises(ValueError, match="known"):
    losses.kl_penalty(logps, ref, "k4")


def test_k3_nonnegative_and_zero_at_reference():
  rng = np.random.default_rng(10)
  logps = jnp.asarray(-rng.uniform(0, 10, size=(6, 5)), jnp.float32)
  ref = jnp.asarray(-rng.uniform(0, 10, size=(6, 5)), jnp.float32)
  k3 = np.asarray(losses.kl_penalty(logps, ref, "k3"))
  assert k3.min() >= 0.0 and k3.max() > 0.1
  for est in losses.KL_ESTIMATORS:
    np.testing.assert_array_equal(losses.kl_penalty(logps, logps, est), 0.0)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_only_gradient(bias_correction):
  # A = 0: only beta * k3 remains; d/dlogp k3 = d/dlogp [e^(ref-logp) - (ref-logp) - 1]
  # = 1 - e^(ref-logp). With the bias correction the term is r * k3 with r = e^(logp - old)
  # = 1 on-policy, so its gradient adds k3 * dr/dlogp = k3: 1 - e^d + e^d - d - 1 = -d =
  # logp - ref, the reverse KL's score-function gradient. dapo divides by the 4 real tokens.
  logps = jnp.array([[-1.0, -2.0, -1.5], [-0.5, -3.0, -1.0]])
  ref = jnp.array([[-2.0, -1.0, -1.5], [-1.5, -3.0, -0.5]])
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
  beta = 0.1
  cfg = _cfg("dapo", beta=beta, use_bias_correction_kl=bias_correction)
  loss, g = _value_and_grad(cfg, logps, None, jnp.zeros(2), mask, ref_logps=ref)
  d = np.asarray(ref - logps, np.float64)
  m = np.asarray(mask)
  expected = -d if bias_correction else 1 - np.exp(d)
  np.testing.assert_allclose(g, beta * expected / 4 * m, rtol=1e-5, atol=1e-8)
  # Value (r = 1 either way): beta * (0.367879 + 0.718282 + 0.367879 + 0) / 4.
  assert float(loss) == pytest.approx(beta * (2 * 0.367879 + 0.718282) / 4, abs=1e-6)
  # Same through grpo's per-row normaliser N*|o_i| = 4 for both rows.
  _, g2 = _value_and_grad(_cfg("grpo", beta=beta, use_bias_correction_kl=bias_correction),
                          logps, None, jnp.zeros(2), mask, ref_logps=ref)
  np.testing.assert_allclose(g2, g, rtol=1e-5, atol=1e-8)


def test_kl_metric_without_beta_and_no_kl_in_loss():
  # beta = 0 with a reference: kl is reported, the loss does not include it.
  logps, _, a, mask = _random_batch(11)
  ref = logps - 0.5
  l0, m0 = _loss(_cfg("dapo"), logps, None, a, mask, ref_logps=ref)
  l1, _ = _loss(_cfg("dapo"), logps, None, a, mask)
  assert float(l0) == float(l1)
  # k3 at ref - logp = -0.5 everywhere: e^-0.5 + 0.5 - 1 = 0.106531
  assert float(m0["kl"]) == pytest.approx(0.106531, abs=1e-5)


def test_beta_without_reference_raises():
  logps, _, a, mask = _random_batch(12)
  with pytest.raises(ValueError, match="ref_logps"):
    _loss(_cfg("grpo", beta=0.04), logps, None, a, mask)


# --- num_items_in_batch ---------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_minibatch_losses_sum_to_full_batch(loss_type):
  logps, old, a, mask = _random_batch(13)
  total = mask.sum()
  cfg = _cfg(loss_type)
  full, g_full = _value_and_grad(cfg, logps, old, a, mask)
  parts = [
      _value_and_grad(cfg, logps[s], old[s], a[s], mask[s], num_items_in_batch=total)
      for s in (slice(0, 3), slice(3, 6))
  ]
  np.testing.assert_allclose(parts[0][0] + parts[1][0], full, rtol=1e-5)
  np.testing.assert_allclose(np.concatenate([parts[0][1], parts[1][1]]), g_full, rtol=1e-5,
                             atol=1e-8)
  # Without the global count each minibatch normalises by its own tokens.
  own = sum(float(_loss(cfg, logps[s], old[s], a[s], mask[s])[0])
            for s in (slice(0, 3), slice(3, 6)))
  assert abs(own - float(full)) > 1e-4


# --- numerical safety ----------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ALL_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_degenerate_inputs_stay_finite(loss_type, level):
  # One row per hazard: -1e4 at padded positions; an all-masked row; -1e4 at a
  # real position; -inf at padded positions; both; a single real token. The
  # advantages mix 0 (a zero-std group) with non-zero values.
  mask = jnp.asarray(np.array([
      [1, 1, 1, 0, 0],
      [0, 0, 0, 0, 0],
      [1, 1, 1, 1, 1],
      [1, 1, 0, 0, 0],
      [1, 1, 1, 1, 0],
      [1, 0, 0, 0, 0],
  ], np.float32))
  valid = mask > 0
  rng = np.random.default_rng(14)
  base = jnp.asarray(-rng.uniform(0.1, 3.0, size=mask.shape), jnp.float32)
  pad = jnp.array([-1e4, -1e4, 0.0, -jnp.inf, -jnp.inf, -1e4])[:, None]
  logps = jnp.where(valid, base, pad).at[2, 1].set(-1e4).at[4, 3].set(-1e4)
  old = jnp.where(valid, base + 0.3, logps)
  ref = jnp.where(valid, base - 0.2, logps)
  a = jnp.array([0.0, 1.0, -1.0, 0.5, 0.0, -2.0])
  cfg = _cfg(loss_type, beta=0.04, importance_sampling_level=level)
  for o in (old, None):
    f = lambda lp: _loss(cfg, lp, o, a, mask, ref_logps=ref, entropy=jnp.ones(mask.shape))
    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(logps)
    assert _finite((loss, metrics, g)), o is None
    # Padded positions never receive gradient.
    np.testing.assert_array_equal(np.asarray(g)[~np.asarray(valid)], 0.0)
  # An entirely masked batch: loss 0, finite metrics.
  loss, m = _loss(cfg, base, base, a, jnp.zeros(mask.shape), ref_logps=base)
  assert float(loss) == 0.0 and _finite(m)


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_zero_advantages_zero_loss_and_gradient(loss_type):
  # A zero-std group has A = 0: no policy-gradient signal at all.
  logps, old, _, mask = _random_batch(15)
  loss, g = _value_and_grad(_cfg(loss_type), logps, old, jnp.zeros(logps.shape[0]), mask)
  assert float(loss) == 0.0
  np.testing.assert_array_equal(g, 0.0)


# --- config and registry -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"loss_type": "cispo"}, "epsilon_high"),  # no cap given
        ({"loss_type": "cispo", "epsilon_high": 0.28}, "epsilon_high"),  # cap <= 1
        ({"delta": 1.0}, "delta"),
        ({"delta": 0.5}, "delta"),
        ({"beta": -0.01}, "beta"),
        ({"importance_sampling_level": "row"}, "importance_sampling_level"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"sapo_tau_pos": 0.0}, "sapo_tau_pos"),
        ({"sapo_tau_neg": -1.0}, "sapo_tau_neg"),
        ({"importance_sampling_mode": "token"}, "importance_sampling_mode"),
        ({"importance_sampling_clip_max": -1.0}, "importance_sampling_clip_max"),
        ({"importance_sampling_clip_max": 0.0}, "importance_sampling_clip_max"),
        ({"importance_sampling_clip_min": -0.5}, "importance_sampling_clip_min"),
        ({"importance_sampling_clip_min": 2.0, "importance_sampling_clip_max": 1.5},
         "importance_sampling_clip_min"),
        ({"top_entropy_quantile": 1.2}, "top_entropy_quantile"),
        ({"top_entropy_quantile": -0.1}, "top_entropy_quantile"),
        ({"entropy_coef": -0.01}, "entropy_coef"),
        ({"vespo_k_pos": -1.0}, "vespo_k_pos"),
        ({"vespo_lambda_neg": 0.0}, "vespo_lambda_neg"),
    ],
)
def test_loss_config_rejects_bad_values(kw, key):
  with pytest.raises(ValueError, match=f"loss.{key}"):
    LossConfig(**kw)


def test_loss_config_accepts_good_values():
  LossConfig(loss_type="cispo", epsilon_high=5.0)
  LossConfig(epsilon_low=0.0, delta=1.5, beta=0.0, kl_estimator="k1")


def test_unknown_loss_type_lists_known():
  logps, _, a, mask = _random_batch(16)
  with pytest.raises(ValueError) as e:
    _loss(LossConfig(loss_type="dapoo"), logps, None, a, mask)
  msg = str(e.value)
  assert "'dapoo'" in msg
  for known in ALL_TYPES:
    assert known in msg


def test_unknown_aggregation_raises():
  with pytest.raises(ValueError, match="known"):
    losses.register_loss("test_bad_aggregation", aggregation="token_median")
  assert "test_bad_aggregation" not in losses.LOSSES


def test_registered_loss_equals_cispo():
  # A REINFORCE weighted by the stopped ratio capped at 1 + eps_high is cispo
  # with epsilon_high = 1 + eps_high.
  name = "test_capped_reinforce"
  try:

    @losses.register_loss(name)
    def capped_reinforce(x, config):
      weight = jax.lax.stop_gradient(jnp.minimum(x.ratio, 1 + config.eps_high))
      return -weight * x.advantages * x.logps

    logps, old, a, mask = _random_batch(17)
    mine = _value_and_grad(_cfg(name, epsilon_high=1.5), logps, old, a, mask)
    cispo = _value_and_grad(_cfg("cispo", epsilon_high=2.5), logps, old, a, mask)
    np.testing.assert_allclose(mine[0], cispo[0], rtol=1e-6)
    np.testing.assert_allclose(mine[1], cispo[1], rtol=1e-6)
  finally:
    losses.LOSSES.pop(name, None)


# --- jit -------------------------------------------------------------------------------


def test_no_retrace_under_jit():
  chex.clear_trace_counter()
  cfg = _cfg("grpo", beta=0.04)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(logps, old, a, mask, ref):
    return jax.value_and_grad(
        lambda lp: _loss(cfg, lp, old, a, mask, ref_logps=ref), has_aux=True)(logps)

  for seed in (18, 19):
    logps, old, a, mask = _random_batch(seed)
    (loss, _), g = step(logps, old, a, mask, logps - 0.1)
    assert _finite((loss, g))
  with pytest.raises(AssertionError):  # the guard is live
    logps, old, a, mask = _random_batch(20, n=3)
    step(logps, old, a, mask, logps)


def test_a_registered_losss_own_options_reach_it_from_the_config(tmp_path):
  """register_loss(options={...}) declares them; the experiment's loss.options (and a
  command-line override of one) sets them; the loss reads config.options; an option
  it did not declare stops validation in one line."""
  from absl import flags
  from ml_collections import config_flags

  from grpojax import config as config_lib

  name = "test_optioned_reinforce"
  try:

    @losses.register_loss(name, options={"cap": 1.2, "scale": 1.0})
    def optioned(x, config):
      weight = jax.lax.stop_gradient(jnp.minimum(x.ratio, config.options["cap"]))
      return -config.options["scale"] * weight * x.advantages * x.logps

    (tmp_path / "exp.py").write_text(
        "from grpojax import config\n\ndef get_config():\n  c = config.get_config()\n"
        f"  c.loss.loss_type = {name!r}\n  c.loss.options = {{'cap': 2.5}}\n  return c\n")
    values = flags.FlagValues()
    argv = ["x", "--config.loss.options.cap=3.5"]
    cfg = config_flags.DEFINE_config_file("config", str(tmp_path / "exp.py"), flag_values=values,
                                          lock_config=True, sys_argv=argv)
    values(argv)
    got = read_settings(cfg.value).loss
    assert dict(got.options) == {"cap": 3.5, "scale": 1.0}  # the override over the defaults
    # The loss computed with cap 3.5 is cispo's with epsilon_high = 3.5, per token.
    logps, old, a, mask = _random_batch(23)
    mine = _value_and_grad(got, logps, old, a, mask)
    cispo = _value_and_grad(_cfg("cispo", epsilon_high=3.5), logps, old, a, mask)
    np.testing.assert_allclose(mine[0], cispo[0], rtol=1e-6)
    np.testing.assert_allclose(mine[1], cispo[1], rtol=1e-6)
    assert hash(got) == hash(read_settings(cfg.value).loss)  # static under jit
    cfg.value.loss.options = {"cap": 2.0, "kap": 1.0}
    with pytest.raises(ValueError, match=r"loss.options.kap: .*takes \['cap', 'scale'\]"):
      config_lib.validate(cfg.value)
  finally:
    losses.LOSSES.pop(name, None)
