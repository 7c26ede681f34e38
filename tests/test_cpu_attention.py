"""The native CPU decode-attention kernel: against a float64 definition and against
segment_attention's XLA path; generate() on that XLA path; the fallback without a compiler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models
from grpojax.models import cpu_attention, transformer
from grpojax.models.config import get_preset
from grpojax.sampling import sampler

needs_kernel = pytest.mark.skipif(not cpu_attention.available(),
                                  reason="no C++ compiler: the XLA path is tested elsewhere")


def reference(q, segments):
  """`attend` in numpy float64, from the definition: one softmax over the concatenated slots."""
  q = np.asarray(q, np.float64)
  N = q.shape[0]
  scores, values = [], []
  for k, v, visible in segments:
    g = N // k.shape[0]
    k = np.repeat(np.asarray(k, np.float64), g, axis=0)
    s = np.einsum("nkmh,nkhs->nkms", q, k)
    scores.append(np.where(np.asarray(visible, bool)[:, None, None, :], s, -np.inf))
    values.append(np.repeat(np.asarray(v, np.float64), g, axis=0))
  s = np.concatenate(scores, axis=-1)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nkms,nksh->nkmh", p, np.concatenate(values, axis=2))


def _segments(rng, N, K, H, specs, p_visible=0.6):
  """(k, v, visible) per (R, S) spec; every query sees slot 0 of the last segment."""
  out = []
  for R, S in specs:
    visible = rng.random((N, S)) < p_visible
    out.append((rng.normal(size=(R, K, H, S)).astype(np.float32),
                rng.normal(size=(R, K, S, H)).astype(np.float32), visible))
  out[-1][2][:, 0] = True
  return out


@needs_kernel
@pytest.mark.parametrize("N, K, M, H, specs", [
    (64, 4, 2, 64, [(8, 32), (64, 16), (64, 16)]),  # the sampler's shape: prompt + 2 chunks
    (6, 2, 3, 24, [(3, 37), (6, 5)]),  # partial blocks of 16, odd M
    (4, 1, 7, 16, [(4, 5)]),  # more queries per kv head than a tile holds
    (12, 2, 1, 8, [(2, 3), (4, 20), (12, 17)]),  # three group sizes
])
def test_attend_matches_the_definition(N, K, M, H, specs):
  rng = np.random.default_rng(N + H)
  q = rng.normal(size=(N, K, M, H)).astype(np.float32)
  segments = _segments(rng, N, K, H, specs)
  if len(segments) > 1:
    segments[0][2][0] = False  # a query that sees nothing in a whole segment
  out = jax.jit(cpu_attention.attend)(q, segments)
  ref = reference(q, segments)
  assert np.isfinite(ref).all()
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_large_scores_do_not_overflow():
  """Scores in the hundreds: the online softmax rescales instead of exponentiating them."""
  rng = np.random.default_rng(0)
  q = (rng.normal(size=(4, 2, 2, 16)) * 30).astype(np.float32)
  segments = _segments(rng, 4, 2, 16, [(4, 40), (4, 9)])
  out = cpu_attention.attend(q, segments)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, reference(q, segments), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_segment_attention_kernel_equals_its_xla_path():
  rng = np.random.default_rng(1)
  N, G, K, Nq, H = 8, 4, 2, 4, 32
  q = jnp.asarray(rng.normal(size=(N, 1, Nq, H)), jnp.float32)
  (pk, pv, _), (ck, cv, _) = _segments(rng, N, K, H, [(N // G, 12), (N, 16)])
  prompt_visible = jnp.asarray(rng.random((N, 1, 12)) < 0.7)
  own_visible = (jnp.arange(16) <= 5)[None, None, :]
  segments = [(pk, pv, prompt_visible, G), (ck, cv, own_visible, 1)]
  fused = jax.jit(lambda q: transformer.segment_attention(q, segments, H**-0.5))(q)
  qs = (q * H**-0.5).reshape(N, 1, K, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, K, Nq // K, H)
  xla = transformer._segment_attention_xla(qs, segments, T=1)
  xla = xla.reshape(N, K, 1, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, 1, Nq, H)
  np.testing.assert_allclose(fused, xla, atol=2e-6, rtol=1e-5)
  hlo = jax.jit(lambda q: transformer.segment_attention(q, segments, H**-0.5)).lower(q).as_text()
  assert "grpojax_decode_attention" in hlo  # the kernel really ran


def test_generate_on_the_xla_path_matches_uncached_argmax():
  """head_dim 12 is not a multiple of 8, so decoding takes segment_attention's XLA
  path on the CPU too (as on TPU or without a compiler): still the uncached argmax.
  test_sampler.py checks the same with the kernel."""
  from test_sampler import MASK, PROMPTS, _greedy_reference, _real_prompt

  model = models.build_model(get_preset("tiny", head_dim=12), seed=1)
  assert not cpu_attention.supports(jnp.float32, model.config.head_dim)
  out = sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=2,
                         max_new_tokens=20, temperature=0.0, eos_ids=127, pad_id=0)
  refs = _greedy_reference(model, [_real_prompt(b) for b in range(3)], 20, eos=(127,))
  for b in range(3):
    want = refs[b] + [0] * (20 - len(refs[b]))  # pad_id after the EOS
    assert out.tokens[b * 2].tolist() == out.tokens[b * 2 + 1].tolist() == want


def test_without_a_compiler_it_falls_back_with_a_warning(monkeypatch, tmp_path):
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  monkeypatch.setenv("GRPOJAX_CACHE_DIR", str(tmp_path))
  cpu_attention._load.cache_clear()
  try:
    with pytest.warns(UserWarning, match="kernel unavailable"):
      assert cpu_attention.available() is False
  finally:
    cpu_attention._load.cache_clear()


def test_disabled_by_environment(monkeypatch):
  monkeypatch.setenv("GRPOJAX_CPU_KERNELS", "0")
  assert cpu_attention.available() is False
