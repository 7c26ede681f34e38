"""core/advantages.py against hand-worked numbers and a float64 numpy reference."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.core import advantages as adv

NAN = float("nan")


def _np_group_reference(rewards, group_size, eps):
  """Plain float64 GRPO advantages: per group, NaN rows skipped, ddof=1."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  out = np.zeros_like(r)
  for g in range(r.shape[0]):
    ok = ~np.isnan(r[g])
    vals = r[g][ok]
    if len(vals) < 2:
      continue  # no spread to normalise by: advantage 0
    out[g][ok] = (vals - vals.mean()) / (vals.std(ddof=1) + eps)
  return out.reshape(-1)


def _finite(x):
  return bool(np.all(np.isfinite(np.asarray(x))))


# --- the literature's worked example ----------------------------------------


def test_worked_example_unbiased_std_not_population_std():
  # 6 rewards of 1, 4 of 0: mean 0.6; deviations +0.4 (x6), -0.6 (x4);
  # sum of squares 6*0.16 + 4*0.36 = 2.4.
  # unbiased: var = 2.4/9 = 0.266667, std = 0.516398 -> +0.4/0.516398 = 0.774597,
  #           -0.6/0.516398 = -1.161895
  # population: var = 2.4/10 = 0.24, std = 0.489898 -> +0.816497 / -1.224745
  r = jnp.array([1.0] * 6 + [0.0] * 4)
  a = np.asarray(adv.group_advantages(r, 10, eps=0.0))
  np.testing.assert_allclose(a[:6], 0.774597, atol=1e-5)
  np.testing.assert_allclose(a[6:], -1.161895, atol=1e-5)
  assert abs(a[0] - 0.816497) > 1e-2 and abs(a[-1] + 1.224745) > 1e-2


def test_worked_example_default_eps():
  # eps=1e-4 is added to the std: 0.4 / (sqrt(0.6*0.4*10/9) + 1e-4) = 0.4/0.516498.
  r = jnp.array([1.0] * 6 + [0.0] * 4)
  a = np.asarray(adv.group_advantages(r, 10))
  expected_pos = 0.4 / (math.sqrt(0.6 * 0.4 * 10 / 9) + 1e-4)
  expected_neg = -0.6 / (math.sqrt(0.6 * 0.4 * 10 / 9) + 1e-4)
  np.testing.assert_allclose(a[:6], expected_pos, rtol=1e-5)
  np.testing.assert_allclose(a[6:], expected_neg, rtol=1e-5)
  assert abs(expected_pos - 0.774597) > 1e-4  # eps is visible at this precision


def test_groups_are_independent_against_numpy_reference():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(4, 4)) * rng.uniform(0.1, 5.0, size=(4, 1)) + rng.normal(size=(4, 1)) * 10
  r = r.reshape(-1)
  got = np.asarray(adv.group_advantages(jnp.asarray(r), 4))
  np.testing.assert_allclose(got, _np_group_reference(r, 4, 1e-4), rtol=1e-4, atol=1e-5)
  # Changing one group leaves the others' advantages untouched.
  r2 = r.copy()
  r2[4:8] = [100.0, -3.0, 2.0, 0.0]
  got2 = np.asarray(adv.group_advantages(jnp.asarray(r2), 4))
  np.testing.assert_array_equal(np.delete(got2, np.s_[4:8]), np.delete(got, np.s_[4:8]))
  # Each group is standardised: mean 0, unbiased std ~1.
  per_group = got.reshape(4, 4)
  np.testing.assert_allclose(per_group.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(per_group.std(-1, ddof=1), 1.0, atol=1e-3)


# --- NaN (no verdict) and degenerate groups ----------------------------------


def test_nan_rewards_excluded_hand_worked():
  # Group [1, NaN, 0, 1]: valid [1, 0, 1], mean 2/3; deviations 1/3, -2/3, 1/3;
  # sum of squares 1/9 + 4/9 + 1/9 = 2/3; var = (2/3)/(3-1) = 1/3, std = 0.577350.
  # A = (1/3)/0.577350 = 0.577350, (-2/3)/0.577350 = -1.154701; NaN row -> 0.
  a = np.asarray(adv.group_advantages(jnp.array([1.0, NAN, 0.0, 1.0]), 4, eps=0.0))
  np.testing.assert_allclose(a, [0.577350, 0.0, -1.154701, 0.577350], atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 1e-4])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_degenerate_groups_never_nan(eps, scale):
  r = jnp.array([
      NAN, NAN, NAN, NAN,  # all NaN
      NAN, 3.0, NAN, NAN,  # one valid reward
      2.0, 2.0, 2.0, 2.0,  # zero std
      0.1, 0.1, 0.1, 0.1,  # zero std, inexact in float32
  ])
  a = np.asarray(adv.group_advantages(r, 4, scale=scale, eps=eps))
  assert _finite(a)
  np.testing.assert_allclose(a[:12], 0.0, atol=0)
  np.testing.assert_allclose(a[12:], 0.0, atol=1e-3)
  for name in ("rloo", "dr_grpo", "grpo"):
    assert _finite(adv.get_advantage_fn(name)(r, 4))


def test_all_nan_batch_is_zero():
  for scale in adv.SCALES:
    a = adv.group_advantages(jnp.full((8,), NAN), 4, scale=scale, eps=0.0)
    np.testing.assert_array_equal(np.asarray(a), 0.0)


def test_infinite_rewards_are_no_verdict():
  # "Never NaN out, whatever goes in": an inf from a broken verifier must not
  # poison its group (inf - inf = NaN); it counts as no verdict, like NaN.
  r = jnp.array([1.0, jnp.inf, 0.0, 1.0, -jnp.inf, 1.0, 0.0, 0.0])
  for scale in adv.SCALES:
    a = np.asarray(adv.group_advantages(r, 4, scale=scale, eps=0.0))
    assert _finite(a)
    assert a[1] == 0.0 and a[4] == 0.0
  a = np.asarray(adv.group_advantages(r, 4, eps=0.0))
  np.testing.assert_allclose(a[:4], [0.577350, 0.0, -1.154701, 0.577350], atol=1e-5)
  assert _finite(adv.get_advantage_fn("rloo")(r, 4))


# --- scales -------------------------------------------------------------------


def test_scale_batch_hand_worked():
  # Groups [1, 0] and [3, 5]. Group means 0.5 and 4 -> centred [0.5, -0.5, -1, 1].
  # Batch std over all four: mean 2.25; squares 1.5625 + 5.0625 + 0.5625 + 7.5625
  # = 14.75; var = 14.75/3 = 4.916667; std = 2.217356.
  # A = centred / 2.217356 = [0.225494, -0.225494, -0.450988, 0.450988].
  r = jnp.array([1.0, 0.0, 3.0, 5.0])
  a = np.asarray(adv.group_advantages(r, 2, scale="batch", eps=0.0))
  np.testing.assert_allclose(a, [0.225494, -0.225494, -0.450988, 0.450988], atol=1e-5)
  # Group scaling differs: each group has std sqrt(0.5) resp. sqrt(2).
  g = np.asarray(adv.group_advantages(r, 2, scale="group", eps=0.0))
  np.testing.assert_allclose(g, [0.707107, -0.707107, -0.707107, 0.707107], atol=1e-5)


def test_scale_batch_against_numpy_with_nan():
  rng = np.random.default_rng(1)
  r = rng.normal(size=8) * 3
  r[[2, 7]] = np.nan
  got = np.asarray(adv.group_advantages(jnp.asarray(r), 4, scale="batch", eps=1e-4))
  ok = ~np.isnan(r)
  std = r[ok].std(ddof=1)
  groups = r.reshape(2, 4)
  means = np.array([np.nanmean(g) for g in groups])
  expected = np.where(ok, (r - np.repeat(means, 4)) / (std + 1e-4), 0.0)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_scale_none_and_dr_grpo_are_centred_rewards():
  # [1, 0, 0, 1] - 0.5 and [4, NaN, 1, 1] - 2 (NaN -> 0).
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 4.0, NAN, 1.0, 1.0])
  expected = [0.5, -0.5, -0.5, 0.5, 2.0, 0.0, -1.0, -1.0]
  np.testing.assert_allclose(adv.group_advantages(r, 4, scale="none"), expected, atol=1e-6)
  np.testing.assert_allclose(adv.get_advantage_fn("dr_grpo")(r, 4), expected, atol=1e-6)


def test_unknown_scale_and_bad_shapes_raise():
  with pytest.raises(ValueError, match="known"):
    adv.group_advantages(jnp.zeros(4), 2, scale="global")
  with pytest.raises(ValueError, match="group_size"):
    adv.group_advantages(jnp.zeros(6), 4)
  with pytest.raises(ValueError, match="1-D"):
    adv.group_advantages(jnp.zeros((2, 4)), 4)


# --- rloo ---------------------------------------------------------------------


def test_rloo_hand_worked():
  # [1, 0, 0, 1]: r_i - mean of the other three: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3.
  # [1, NaN, 0, 1]: k = 3 valid: 1 - 1/2 = 0.5, 0 - 1 = -1, NaN row 0.
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, NAN, 0.0, 1.0])
  a = adv.get_advantage_fn("rloo")(r, 4)
  np.testing.assert_allclose(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5, 0.0, -1.0, 0.5], atol=1e-6)


def test_rloo_identity_k_over_k_minus_1():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(4, 5))
  r[1, 3] = np.nan
  r[2, :4] = np.nan  # one valid row: advantage 0
  got = np.asarray(adv.get_advantage_fn("rloo")(jnp.asarray(r.reshape(-1)), 5)).reshape(4, 5)
  for g in range(4):
    ok = ~np.isnan(r[g])
    k = ok.sum()
    expected = np.zeros(5)
    if k > 1:
      expected[ok] = k / (k - 1) * (r[g][ok] - r[g][ok].mean())
    np.testing.assert_allclose(got[g], expected, rtol=1e-5, atol=1e-6)


# --- registry -----------------------------------------------------------------


def test_register_and_get_custom_estimator():
  name = "test_sign_only"
  try:

    @adv.register_advantage(name)
    def sign_only(rewards, group_size, **unused):
      del unused
      return jnp.sign(adv.group_advantages(rewards, group_size, scale="none"))

    fn = adv.get_advantage_fn(name)
    assert fn is sign_only
    np.testing.assert_array_equal(fn(jnp.array([3.0, 1.0, 2.0, 2.0]), 2), [1, -1, 0, 0])
  finally:
    adv.ESTIMATORS.pop(name, None)
  assert name not in adv.ESTIMATORS


def test_builtin_estimators_registered_and_grpo_is_default():
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
  np.testing.assert_array_equal(
      adv.get_advantage_fn("grpo")(r, 3), adv.group_advantages(r, 3)
  )


def test_unknown_estimator_lists_known():
  with pytest.raises(ValueError) as e:
    adv.get_advantage_fn("grpoo")
  msg = str(e.value)
  assert "'grpoo'" in msg
  for known in ("grpo", "rloo", "dr_grpo"):
    assert known in msg


# --- combine_rewards and reward_stats -----------------------------------------


def test_combine_rewards_weights_and_missing_verdicts():
  r = jnp.array([
      [1.0, 0.5],
      [NAN, 2.0],  # function 0 gave None: only function 1 counts
      [NAN, NAN],  # nobody gave a verdict: the row stays NaN
      [3.0, NAN],
  ])
  # weights [2, 1]: 2*1 + 0.5 = 2.5; 2; NaN; 2*3 = 6.
  got = np.asarray(adv.combine_rewards(r, jnp.array([2.0, 1.0])))
  np.testing.assert_allclose(got[[0, 1, 3]], [2.5, 2.0, 6.0])
  assert np.isnan(got[2])
  # default weights are ones: 1.5, 2, NaN, 3.
  got = np.asarray(adv.combine_rewards(r))
  np.testing.assert_allclose(got[[0, 1, 3]], [1.5, 2.0, 3.0])
  assert np.isnan(got[2])
  # The NaN row flows through the advantages as no verdict.
  a = adv.group_advantages(adv.combine_rewards(r), 4)
  assert _finite(a) and float(a[2]) == 0.0


def test_reward_stats_hand_values():
  # Group 1 [1, 0, 0, 1]: mean 0.5, var (4*0.25)/3, std 0.577350.
  # Group 2 [2, 2, 2, 2]: std 0.  Group 3 [1, NaN, 0, 1]: std 0.577350 (as above).
  # reward = (2 + 8 + 2) / 11 valid = 1.090909; reward_std = 2*0.577350/3 = 0.384900;
  # frac_reward_zero_std = 1/3.
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0, NAN, 0.0, 1.0])
  s = adv.reward_stats(r, 4)
  assert float(s["reward"]) == pytest.approx(12 / 11, rel=1e-6)
  assert float(s["reward_std"]) == pytest.approx(0.384900, abs=1e-5)
  assert float(s["frac_reward_zero_std"]) == pytest.approx(1 / 3, rel=1e-6)


# --- jit ----------------------------------------------------------------------


def test_no_retrace_under_jit():
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(rewards_NK):
    r = adv.combine_rewards(rewards_NK)
    return adv.group_advantages(r, 4), adv.reward_stats(r, 4)

  rng = np.random.default_rng(3)
  a1, _ = step(jnp.asarray(rng.normal(size=(8, 2)), jnp.float32))
  a2, _ = step(jnp.asarray(rng.normal(size=(8, 2)), jnp.float32))
  assert _finite(a1) and _finite(a2)
  # The guard is live: a new shape retraces and is caught.
  with pytest.raises(AssertionError):
    step(jnp.zeros((12, 2), jnp.float32))
