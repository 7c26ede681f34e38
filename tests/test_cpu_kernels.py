"""The native CPU decode kernels. Attention: against a float64 definition and
against the XLA backend's decode attention. Dense layers: against a float64
product, packing against its definition, and the model's decode weights
through them. generate() on the XLA backend; the fallback without a compiler;
how model.kernels chooses."""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models, ops
from grpojax.models import transformer
from grpojax.models.config import get_preset
from grpojax.ops import cpu as cpu_kernels
from grpojax.sampling import sampler

needs_kernel = pytest.mark.skipif(not cpu_kernels.load(),
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
  out = jax.jit(cpu_kernels.attend)(q, segments)
  ref = reference(q, segments)
  assert np.isfinite(ref).all()
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_large_scores_do_not_overflow():
  """Scores in the hundreds: the online softmax rescales instead of exponentiating them."""
  rng = np.random.default_rng(0)
  q = (rng.normal(size=(4, 2, 2, 16)) * 30).astype(np.float32)
  segments = _segments(rng, 4, 2, 16, [(4, 40), (4, 9)])
  out = cpu_kernels.attend(q, segments)
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
  attention = lambda kernels: jax.jit(  # noqa: E731
      lambda q: ops.decode_attention(q, segments, H**-0.5, kernels))
  fused, xla = attention("cpu")(q), attention("xla")(q)
  np.testing.assert_allclose(fused, xla, atol=2e-6, rtol=1e-5)
  assert "grpojax_decode_attention" in attention("cpu").lower(q).as_text()  # the kernel really ran
  assert "grpojax_decode_attention" not in attention("xla").lower(q).as_text()


@pytest.mark.slow
def test_generate_on_the_xla_path_matches_uncached_argmax():
  """With kernels="xla", decoding takes the XLA paths of attention and of the
  dense layers (as on TPU or without a compiler): still the uncached argmax.
  test_sampler.py checks the same with the kernels. (head_dim 12, which the
  attention kernel does not take, also keeps this model's programs apart.)"""
  from test_sampler import MASK, PROMPTS, _greedy_reference, _real_prompt

  model = models.build_model(get_preset("tiny", head_dim=12, kernels="xla"), seed=1)
  assert not cpu_kernels.supports(jnp.float32, model.config.head_dim)
  weights = transformer.decode_params(model.config, model.param_dict())
  assert not isinstance(weights["layers"][0]["wqkv"], cpu_kernels.PackedWeight)
  out = sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=2,
                         max_new_tokens=20, temperature=0.0, eos_ids=127, pad_id=0)
  refs = _greedy_reference(model, [_real_prompt(b) for b in range(3)], 20, eos=(127,))
  for b in range(3):
    want = refs[b] + [0] * (20 - len(refs[b]))  # pad_id after the EOS
    assert out.tokens[b * 2].tolist() == out.tokens[b * 2 + 1].tolist() == want


def test_without_a_compiler_it_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
  caplog.set_level("INFO", logger="grpojax.ops.cpu")
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  monkeypatch.setenv("GRPOJAX_CACHE_DIR", str(tmp_path))
  cpu_kernels._load.cache_clear()
  try:
    with pytest.warns(UserWarning, match="kernels unavailable"):
      assert cpu_kernels.load() is False
    # The build was announced before it ran (half a minute of g++ is not silent).
    assert any("building grpojax's CPU decode kernels" in r.getMessage()
               for r in caplog.records)
    assert ops.resolve(get_preset("tiny")).kernels == "xla"  # "auto" falls back
    with pytest.raises(ValueError, match="kernels='cpu'"):
      ops.resolve(get_preset("tiny", kernels="cpu"))  # asked for: an error, not a fallback
  finally:
    cpu_kernels._load.cache_clear()


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None or sys.platform != "linux",
                    reason="no C++ compiler")
def test_the_kernels_build_where_there_is_a_compiler():
  """Otherwise a source that stops compiling would only skip the tests above."""
  assert cpu_kernels.load()
  assert ops.resolve(get_preset("tiny")).kernels == "cpu"


def test_kernels_xla_turns_every_cpu_variant_off():
  cfg = ops.resolve(get_preset("tiny", kernels="xla"))
  assert cfg.kernels == "xla"
  weights = transformer.decode_params(cfg, models.build_model(cfg).param_dict())
  assert not isinstance(weights["layers"][0]["wqkv"], cpu_kernels.PackedWeight)
  logits = jnp.zeros((2, 8))
  hlo = jax.jit(lambda r: ops.categorical(r, logits, cfg.kernels)).lower(jax.random.key(0)).as_text()
  assert "cumsum" not in hlo and "reduce_window" not in hlo  # Gumbel-max, not the inverse CDF
  with pytest.raises(ValueError, match="kernels"):
    get_preset("tiny", kernels="fast")


def _pack_reference(w):
  """[N, K] -> [P, K, 64] from the definition: panel p, row k, lane j = w[64p + j, k]."""
  n, k = w.shape
  out = np.zeros((-(-n // 64), k, 64), np.float32)
  for i in range(n):
    out[i // 64, :, i % 64] = w[i]
  return out


@needs_kernel
@pytest.mark.parametrize("M, K, parts", [
    (64, 512, (1024,)),  # the benchmark's qkv: whole panels, whole row tiles + a tail of 4
    (13, 37, (50, 20)),  # two parts meeting inside a panel; N = 70, a partial last panel
    (1, 8, (64,)),
    (6, 1, (1, 2)),  # K = 1, N = 3
    (7, 100, (65, 64, 1)),  # three parts, each boundary on a different lane
])
def test_dense_matches_a_float64_product(M, K, parts):
  rng = np.random.default_rng(M * K)
  x = rng.normal(size=(M, K)).astype(np.float32)
  ws = [rng.normal(size=(n, K)).astype(np.float32) for n in parts]
  packed = jax.jit(cpu_kernels.pack)(*ws)
  w = np.concatenate(ws)
  assert packed.features == len(w)
  np.testing.assert_array_equal(packed.panels, _pack_reference(w))
  # The XLA path other platforms take packs the same panels, in layers too.
  layers = cpu_kernels.pack_layers_xla(*(np.stack([v, -v]) for v in ws))
  np.testing.assert_array_equal(layers[0].panels, packed.panels)
  np.testing.assert_array_equal(layers[1].panels, -packed.panels)
  ref = x.astype(np.float64) @ w.astype(np.float64).T
  for dense in (cpu_kernels.dense, cpu_kernels.dense_xla):
    out = jax.jit(dense)(x, packed)
    assert out.shape == (M, len(w))
    np.testing.assert_allclose(out, ref, atol=1e-5 * np.sqrt(K), rtol=1e-5)


@needs_kernel
def test_pack_layers_gives_each_layer_its_own_weight():
  rng = np.random.default_rng(5)
  a, b = rng.normal(size=(3, 40, 24)), rng.normal(size=(3, 30, 24))
  layers = jax.jit(cpu_kernels.pack_layers)(a, b)
  assert len(layers) == 3
  for i, packed in enumerate(layers):
    np.testing.assert_array_equal(packed.panels,
                                  _pack_reference(np.concatenate([a[i], b[i]]).astype(np.float32)))


@needs_kernel
def test_linear_on_packed_weights_equals_the_einsum():
  """ops.linear on [B, T, I] through the kernel gives x @ w.T."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 5, 48)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(100, 48)), jnp.float32)
  packed = cpu_kernels.pack(w)
  linear = jax.jit(lambda x, w: ops.linear(x, w, "cpu"))
  np.testing.assert_allclose(linear(x, packed), jnp.einsum("bti,oi->bto", x, w),
                             atol=2e-5, rtol=1e-5)
  assert "grpojax_dense" in linear.lower(x, packed).as_text()


@needs_kernel
def test_decode_params_pack_float32_weights_only():
  model = models.build_model(get_preset("qwen2_tiny", kernels="cpu"), seed=0)  # biases, tied
  cfg = model.config
  params = model.param_dict()
  weights = transformer.decode_params(cfg, params)
  layer = weights["layers"][1]
  D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  assert layer["wqkv"].features == (N + 2 * K) * H and layer["wo"].features == D
  wqkv = np.concatenate([np.asarray(params[n][1]).reshape(-1, D) for n in ("wq", "wk", "wv")])
  np.testing.assert_array_equal(layer["wqkv"].panels, _pack_reference(wqkv))
  np.testing.assert_array_equal(layer["wo"].panels,
                                _pack_reference(np.asarray(params["wo"][1]).reshape(D, -1)))
  np.testing.assert_array_equal(weights["unembedding"].panels,
                                _pack_reference(np.asarray(params["embed"])))
  hidden = jnp.asarray(np.random.default_rng(0).normal(size=(3, D)), jnp.float32)
  np.testing.assert_allclose(transformer.unembed(cfg, weights, hidden),
                             transformer.unembed(cfg, params, hidden), atol=2e-5, rtol=1e-5)
  bf16 = get_preset("qwen2_tiny", dtype="bfloat16", kernels="cpu")
  assert not isinstance(transformer.decode_params(bf16, params)["unembedding"],
                        ops.cpu.PackedWeight)
