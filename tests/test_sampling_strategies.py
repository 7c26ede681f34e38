"""Sampling strategies: exact allowed sets, and frequencies that match the distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpojax.ops import cpu as cpu_ops
from grpojax.sampling import strategies as S

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = jnp.log(jnp.asarray(PROBS))[None]


def allowed(params, logits=LOGITS):
  return set(np.flatnonzero(np.isfinite(np.asarray(S.filtered_logits(logits, params))[0])))


@pytest.mark.parametrize(
    "params, expected",
    [
        # mass before each token: 0, .5, .8, .95 -> kept while < p
        (S.SamplingParams(top_p=0.7), {0, 1}),
        (S.SamplingParams(top_p=0.8), {0, 1}),
        (S.SamplingParams(top_p=0.81), {0, 1, 2}),
        (S.SamplingParams(top_p=0.01), {0}),
        (S.SamplingParams(top_k=1), {0}),
        (S.SamplingParams(top_k=3), {0, 1, 2}),
        # min_p 0.2: p >= 0.2 * 0.5 = 0.1
        (S.SamplingParams(min_p=0.2), {0, 1, 2}),
        (S.SamplingParams(min_p=0.7), {0}),
        (S.SamplingParams(top_k=3, top_p=0.6), {0, 1}),
        (S.SamplingParams(), {0, 1, 2, 3}),
    ],
)
def test_allowed_sets_by_hand(params, expected):
  assert allowed(params) == expected


def test_temperature_changes_the_nucleus():
  # At T=2 the probs flatten to sqrt(p) / sum: .39, .30, .21, .11 -> top_p .7 keeps 3.
  assert allowed(S.SamplingParams(temperature=2.0, top_p=0.7)) == {0, 1, 2}


def _draw(params, logits, n, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  tokens, logps = jax.jit(jax.vmap(lambda k: S.sample(k, logits, params)))(keys)
  return np.asarray(tokens)[:, 0], np.asarray(logps)[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_first_token_frequencies_match_softmax(temperature):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(1, 12)) * 1.5, jnp.float32)
  n = 20000
  tokens, logps = _draw(S.SamplingParams(temperature=temperature), logits, n)
  z = np.asarray(logits[0], np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  counts = np.bincount(tokens, minlength=12)
  assert stats.chisquare(counts, p * n).pvalue > 1e-3
  # Reported log-probs are the full tempered softmax's.
  np.testing.assert_allclose(logps, np.log(p)[tokens], rtol=1e-5, atol=1e-5)


def test_truncated_sampling_matches_renormalised_distribution_and_never_leaves_the_set():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(1, 30)) * 2.0, jnp.float32)
  params = S.SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05)
  keep = sorted(allowed(params, logits))
  # Independent reference for the allowed set, in float64 numpy.
  z = np.asarray(logits[0], np.float64) / 0.8
  order = np.argsort(-z)[:10]
  pk = np.exp(z[order] - z[order].max())
  pk /= pk.sum()
  before = np.cumsum(pk) - pk
  nucleus = order[before < 0.9]
  pn = np.exp(z[nucleus] - z[nucleus].max())
  ref = sorted(nucleus[pn / pn.max() >= 0.05])
  assert keep == [int(i) for i in ref]

  n = 20000
  tokens, logps = _draw(params, logits, n, seed=3)
  assert set(np.unique(tokens)) <= set(keep)
  q = np.exp(z[keep] - z[keep].max())
  q /= q.sum()
  counts = np.array([(tokens == i).sum() for i in keep])
  assert stats.chisquare(counts, q * n).pvalue > 1e-3
  full = np.exp(z - z.max())
  full /= full.sum()
  np.testing.assert_allclose(logps, np.log(full)[tokens], rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_with_untempered_logp():
  logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
  tokens, logps = S.sample(jax.random.key(0), logits, S.SamplingParams(temperature=0.0))
  assert tokens.tolist() == [1, 0]
  np.testing.assert_allclose(logps, jax.nn.log_softmax(logits)[jnp.arange(2), tokens], rtol=1e-6)


@pytest.mark.parametrize(
    "kw", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0)]
)
def test_bad_params_raise(kw):
  with pytest.raises(ValueError):
    S.SamplingParams(**kw)


def test_categorical_inverse_cdf_edges(monkeypatch):
  """Excluded tokens have empty CDF intervals; a uniform that rounds up to the
  total falls back to the last token with mass, never past it."""
  logits = jnp.array([[0.0, -jnp.inf, 1.0, -jnp.inf, -jnp.inf]] * 2)
  draws = cpu_ops.categorical(jax.random.key(0), jnp.tile(logits, (2000, 1)))
  assert set(np.unique(np.asarray(draws))) == {0, 2}
  monkeypatch.setattr(S.jax.random, "uniform", lambda key, shape: jnp.ones(shape))
  np.testing.assert_array_equal(cpu_ops.categorical(jax.random.key(0), logits), [2, 2])
  monkeypatch.setattr(S.jax.random, "uniform", lambda key, shape: jnp.zeros(shape))
  np.testing.assert_array_equal(cpu_ops.categorical(jax.random.key(0), logits), [0, 0])


def test_categorical_across_blocks_matches_softmax():
  """V = 300 is 19 blocks of 16 with 4 padded slots: mass spread over a few
  tokens in different blocks (and zero-mass blocks between them) is drawn in
  proportion, excluded tokens never, and the edges of the uniform land on the
  first and last tokens with mass."""
  V = 300
  support = np.array([3, 17, 18, 150, 151, 255, 299])
  z = np.full(V, -np.inf)
  z[support] = np.random.default_rng(2).normal(size=support.size)
  logits = jnp.asarray(z, jnp.float32)[None]
  n = 20000
  draws = np.asarray(jax.jit(cpu_ops.categorical)(jax.random.key(4), jnp.tile(logits, (n, 1))))
  assert set(np.unique(draws)) <= set(support.tolist())
  p = np.exp(z[support] - z[support].max())
  p /= p.sum()
  counts = np.array([(draws == t).sum() for t in support])
  assert stats.chisquare(counts, p * n).pvalue > 1e-3


@pytest.mark.parametrize("u, expected", [(1.0, 255), (0.0, 17)])
def test_categorical_across_blocks_edges(monkeypatch, u, expected):
  logits = jnp.full((3, 300), -jnp.inf).at[:, jnp.array([17, 18, 150, 255])].set(0.5)
  monkeypatch.setattr(S.jax.random, "uniform", lambda key, shape: jnp.full(shape, u))
  np.testing.assert_array_equal(cpu_ops.categorical(jax.random.key(0), logits), [expected] * 3)
