"""core/logprobs.py against float64 numpy, hand values, the plain version
(for the chunked one), and the compiler's memory accounting."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.core import logprobs as lp


def _np_log_softmax(logits, temperature):
  x = np.asarray(logits, np.float64) / temperature
  m = np.max(x, axis=-1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _np_entropy(logits, temperature):
  logp = _np_log_softmax(logits, temperature)
  p = np.exp(logp)
  return -np.sum(np.where(p > 0, p * logp, 0.0), axis=-1)


def _finite(tree):
  return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree))


RNG = np.random.default_rng(0)
LOGITS = jnp.asarray(RNG.normal(scale=3.0, size=(2, 3, 11)), jnp.float32)
TARGETS = jnp.asarray(RNG.integers(0, 11, size=(2, 3)))


def test_token_logprobs_and_entropy_vs_numpy_at_temperature():
  got = lp.token_logprobs(LOGITS, TARGETS, temperature=0.7)
  ref = np.take_along_axis(_np_log_softmax(LOGITS, 0.7), np.asarray(TARGETS)[..., None], -1)[..., 0]
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(lp.entropy(LOGITS, temperature=0.7), _np_entropy(LOGITS, 0.7),
                             rtol=1e-5, atol=1e-5)
  # The temperature matters: at 1.0 the values differ.
  assert np.abs(np.asarray(lp.token_logprobs(LOGITS, TARGETS)) - ref).max() > 1e-2
  both = lp.token_logprobs_and_entropy(LOGITS, TARGETS, temperature=0.7)
  np.testing.assert_allclose(both[0], got, rtol=1e-6)
  np.testing.assert_allclose(both[1], lp.entropy(LOGITS, temperature=0.7), rtol=1e-6)


def test_hand_values():
  # logits [0, ln 3]: softmax [1/4, 3/4] -> log p(1) = ln 0.75 = -0.287682.
  # At temperature 0.5 the logits become [0, 2 ln 3] = [0, ln 9]: softmax [1/10, 9/10]
  # -> ln 0.9 = -0.105361.
  logits = jnp.array([[[0.0, math.log(3.0)]]])
  y = jnp.array([[1]])
  assert float(lp.token_logprobs(logits, y)[0, 0]) == pytest.approx(-0.287682, abs=1e-6)
  assert float(lp.token_logprobs(logits, y, temperature=0.5)[0, 0]) == pytest.approx(
      -0.105361, abs=1e-6)
  # Entropy of [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335.
  assert float(lp.entropy(logits)[0, 0]) == pytest.approx(0.562335, abs=1e-6)
  # Uniform over 4: ln 4 = 1.386294, whatever the temperature.
  assert float(lp.entropy(jnp.zeros((1, 1, 4)), temperature=0.3)[0, 0]) == pytest.approx(
      1.386294, abs=1e-6)


def test_bf16_logits_give_float32_statistics():
  got = lp.token_logprobs(LOGITS.astype(jnp.bfloat16), TARGETS, temperature=0.7)
  assert got.dtype == jnp.float32
  ref = np.take_along_axis(
      _np_log_softmax(np.asarray(LOGITS.astype(jnp.bfloat16).astype(jnp.float32)), 0.7),
      np.asarray(TARGETS)[..., None], -1)[..., 0]
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_entropy_with_minus_inf_logits():
  # Top-k style masking: -inf logits are outside the support; the entropy is
  # that of the remaining tokens, and finite (0 * -inf must not leak as NaN).
  logits = LOGITS.at[..., 3:7].set(-jnp.inf)
  ent = lp.entropy(logits, temperature=0.7)
  assert _finite(ent)
  np.testing.assert_allclose(ent, _np_entropy(np.delete(np.asarray(LOGITS), np.s_[3:7], -1), 0.7),
                             rtol=1e-5, atol=1e-5)
  # Same for the fused version, and the gradients of both outputs (an entropy
  # bonus differentiates through this) are finite.
  targets = jnp.where((TARGETS >= 3) & (TARGETS < 7), 0, TARGETS)
  f = lambda x: sum(jnp.sum(o) for o in lp.token_logprobs_and_entropy(x, targets, temperature=0.7))
  val, g = jax.value_and_grad(f)(logits)
  assert _finite((val, g))
  np.testing.assert_array_equal(np.asarray(g)[..., 3:7], 0.0)
  assert _finite(jax.grad(lambda x: jnp.sum(lp.entropy(x)))(logits))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_non_positive_temperature_raises(temperature):
  h = jnp.zeros((1, 2, 4))
  for fn in (
      lambda: lp.token_logprobs(LOGITS, TARGETS, temperature=temperature),
      lambda: lp.entropy(LOGITS, temperature=temperature),
      lambda: lp.token_logprobs_and_entropy(LOGITS, TARGETS, temperature=temperature),
      lambda: lp.chunked_token_logprobs(h, jnp.zeros((4, 11)), TARGETS[:1, :2],
                                        temperature=temperature),
  ):
    with pytest.raises(ValueError, match="temperature"):
      fn()


# --- chunked ------------------------------------------------------------------

N, T, D, V = 3, 5, 8, 13
H = jnp.asarray(RNG.normal(size=(N, T, D)), jnp.float32)
W = jnp.asarray(RNG.normal(scale=0.5, size=(D, V)), jnp.float32)
Y = jnp.asarray(RNG.integers(0, V, size=(N, T)))
# Arbitrary cotangents so every position and both outputs matter in the gradient.
C1 = jnp.asarray(RNG.normal(size=(N, T)), jnp.float32)
C2 = jnp.asarray(RNG.normal(size=(N, T)), jnp.float32)


def _plain(h, w, with_entropy):
  logits = jnp.einsum("ntd,dv->ntv", h, w)
  if with_entropy:
    return lp.token_logprobs_and_entropy(logits, Y, temperature=0.7)
  return lp.token_logprobs(logits, Y, temperature=0.7)


def _objective(out):
  if isinstance(out, tuple):
    return jnp.sum(out[0] * C1) + jnp.sum(out[1] * C2)
  return jnp.sum(out * C1)


@pytest.mark.parametrize(
    "chunk_size,with_entropy",
    [(4, False), (4, True), (1024, True)],  # 4 does not divide N*T = 15; 1024 > N*T
)
def test_chunked_equals_plain(chunk_size, with_entropy):
  chunked = lambda h, w: lp.chunked_token_logprobs(
      h, w, Y, temperature=0.7, chunk_size=chunk_size, with_entropy=with_entropy)
  plain = lambda h, w: _plain(h, w, with_entropy)

  def outputs_and_grads(f):
    # One jitted program each: cheaper on CPU than the eager gradient's many kernels.
    vg = jax.value_and_grad(lambda h, w: (_objective(f(h, w)), f(h, w)), argnums=(0, 1),
                            has_aux=True)
    (_, out), grads = jax.jit(vg)(H, W)
    return out, grads

  (got, g_chunked), (ref, g_plain) = outputs_and_grads(chunked), outputs_and_grads(plain)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert g.shape == (N, T) and g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  for g, r in zip(g_chunked, g_plain):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(r)).max() > 1e-3
  # Un-jitted, the values agree too.
  for g, r in zip(jax.tree.leaves(chunked(H, W)), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_chunked_vs_numpy_float64():
  logits = np.einsum("ntd,dv->ntv", np.asarray(H, np.float64), np.asarray(W, np.float64))
  ref = np.take_along_axis(_np_log_softmax(logits, 0.7), np.asarray(Y)[..., None], -1)[..., 0]
  got, ent = lp.chunked_token_logprobs(H, W, Y, temperature=0.7, chunk_size=4, with_entropy=True)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, _np_entropy(logits, 0.7), rtol=1e-5, atol=1e-5)


def test_chunked_never_holds_the_full_logits():
  # N=64, T=512, V=32768: one [N, T, V] float32 buffer is 4 GiB. Compile only.
  n, t, d, v = 64, 512, 64, 32768
  full = n * t * v * 4
  h = jax.ShapeDtypeStruct((n, t, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)
  y = jax.ShapeDtypeStruct((n, t), jnp.int32)
  c = jax.ShapeDtypeStruct((n, t), jnp.float32)

  def chunked(h, w, y, c):
    return jnp.sum(lp.chunked_token_logprobs(h, w, y, chunk_size=1024) * c)

  def plain(h, w, y, c):
    return jnp.sum(lp.token_logprobs(jnp.einsum("ntd,dv->ntv", h, w), y) * c)

  def temp_bytes(f):
    return jax.jit(f).lower(h, w, y, c).compile().memory_analysis().temp_size_in_bytes

  chunked_fwd = temp_bytes(chunked)
  chunked_bwd = temp_bytes(jax.grad(chunked, argnums=(0, 1)))
  plain_fwd = temp_bytes(plain)
  assert chunked_fwd < full / 8, chunked_fwd
  assert chunked_bwd < full / 8, chunked_bwd
  assert plain_fwd >= full, plain_fwd  # the measurement can see a full buffer
