"""The decoder against HF transformers' PyTorch models on the same weights, plus cache and causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import test_models_helpers as H
from grpojax import models
from grpojax.models import transformer

KINDS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{kind: (hf torch model, directory it was saved to)}."""
  out = {}
  for i, kind in enumerate(KINDS):
    model = H.hf_model(kind, seed=i)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    out[kind] = (model, str(path))
  return out


@nnx.jit
def _logits(model, tokens, mask):
  return model(tokens, mask=mask)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(checkpoints, kind):
  hf, path = checkpoints[kind]
  model = models.from_pretrained(path, dtype="float32")
  rng = np.random.default_rng(0)
  # Row 0 is full length, rows 1-2 left-padded: padding must not change real tokens' logits.
  tokens, mask = H.left_padded(rng, [12, 7, 3], 12, hf.config.vocab_size)
  ours = np.asarray(_logits(model, jnp.asarray(tokens), jnp.asarray(mask)))
  ref = H.hf_logits(hf, tokens, mask)
  assert np.abs(ref).max() > 1.0  # weights are not near-zero: the tolerance is meaningful
  np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)
  # Each padded row equals the same tokens run alone, unpadded.
  for b in (1, 2):
    alone = H.hf_logits(hf, tokens[b:b + 1, mask[b]])
    np.testing.assert_allclose(ours[b][mask[b]], alone[0], atol=1e-4, rtol=0)


def test_mlp_weight_gradients_match_transformers(checkpoints):
  """Gradients of the MLP weights (a hand-written backward, transformer._wide_matmul)
  and of the attention weights equal torch autograd's on the same weights."""
  import torch
  hf, path = checkpoints["qwen2"]
  model = models.from_pretrained(path, dtype="float32")
  tokens, mask = H.left_padded(np.random.default_rng(1), [9, 6], 9, hf.config.vocab_size)
  w = np.random.default_rng(2).normal(size=(*tokens.shape, hf.config.vocab_size)).astype(np.float32)
  m = mask[..., None].astype(np.float32)

  def loss(params):
    hidden = transformer.forward(model.config, params, jnp.asarray(tokens), None, jnp.asarray(mask))
    return jnp.sum(transformer.unembed(model.config, params, hidden) * w * m)

  grads = jax.jit(jax.grad(loss))(model.param_dict())
  hf.zero_grad()
  mask_t = torch.tensor(mask, dtype=torch.long)
  logits = hf(torch.tensor(tokens, dtype=torch.long), attention_mask=mask_t,
              position_ids=(mask_t.cumsum(-1) - 1).clamp(min=0)).logits
  (logits * torch.tensor(w * m)).sum().backward()
  layer = hf.model.layers[1]
  for ours, theirs in [(grads["w_gate"][1], layer.mlp.gate_proj.weight),
                       (grads["w_up"][1], layer.mlp.up_proj.weight),
                       (grads["w_down"][1], layer.mlp.down_proj.weight),
                       (grads["wq"][1].reshape(-1, hf.config.hidden_size), layer.self_attn.q_proj.weight)]:
    ref = theirs.grad.numpy()
    assert np.abs(ref).max() > 1e-2
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_llama3_rope_scaling_is_applied(checkpoints):
  """The Llama test above would pass with plain RoPE unless scaling changes the logits."""
  _, path = checkpoints["llama"]
  scaled = models.from_pretrained(path, dtype="float32")
  plain = models.from_pretrained(path, dtype="float32", rope_type="default")
  tokens = jnp.arange(1, 13)[None]
  diff = np.abs(np.asarray(_logits(scaled, tokens, None)) - np.asarray(_logits(plain, tokens, None)))
  assert diff.max() > 1e-2


def test_cached_decoding_matches_full_forward():
  cfg = models.get_preset("tiny", qk_norm=True, qkv_bias=True)
  model = models.build_model(cfg, seed=1)
  rng = np.random.default_rng(1)
  P, new = 6, 5
  prompt, prompt_mask = H.left_padded(rng, [6, 4, 2], P, cfg.vocab_size)
  cont = rng.integers(1, cfg.vocab_size, (3, new)).astype(np.int32)
  full_tokens = np.concatenate([prompt, cont], 1)
  full_mask = np.concatenate([prompt_mask, np.ones_like(cont, bool)], 1)
  full = np.asarray(_logits(model, jnp.asarray(full_tokens), jnp.asarray(full_mask)))

  prefill = nnx.jit(lambda m, t, mk: m.prefill(t, mk, max_new_tokens=new, all_logits=True))
  decode = nnx.jit(lambda m, t, c: m.decode(t, c))
  logits, cache = prefill(model, jnp.asarray(prompt), jnp.asarray(prompt_mask))
  np.testing.assert_allclose(np.asarray(logits)[prompt_mask], full[:, :P][prompt_mask], atol=1e-5)
  for t in range(new):
    logits, cache = decode(model, jnp.asarray(cont[:, t:t + 1]), cache)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, P + t], atol=1e-5)
  assert int(cache.length) == new


def test_prefill_shares_each_prompt_with_its_group():
  cfg = models.get_preset("tiny")
  model = models.build_model(cfg)
  prompt = jnp.asarray([[0, 5, 6], [7, 8, 9]], jnp.int32)
  mask = jnp.asarray([[False, True, True], [True, True, True]])

  @nnx.jit
  def run(model):
    _, cache = model.prefill(prompt, mask, group=3, max_new_tokens=1)
    logits, _ = model.decode(jnp.full((6, 1), 3, jnp.int32), cache)
    full = model(jnp.concatenate([prompt, jnp.full((2, 1), 3, jnp.int32)], 1),
                 mask=jnp.concatenate([mask, jnp.ones((2, 1), bool)], 1))
    return logits, full

  logits, full = run(model)
  np.testing.assert_allclose(logits[:, 0], jnp.repeat(full[:, -1], 3, axis=0), atol=1e-5)


def test_causality_and_padding_by_gradients():
  """d logits[t] / d input[s] is exactly zero for s > t and for padded s; nonzero otherwise."""
  cfg = models.get_preset("tiny")
  params = transformer.init_params(cfg, jax.random.key(0))
  T = 6
  emb = jax.random.normal(jax.random.key(1), (1, T, cfg.hidden_size))
  mask = jnp.asarray([[False, True, True, True, True, True]])

  def out_at(x, t):
    hidden = transformer.forward(cfg, params, None, mask=mask, embeddings=x)
    return transformer.unembed(cfg, params, hidden)[0, t].sum()

  grad = jax.jit(jax.grad(out_at))
  for t in (1, 3, 5):
    g = np.abs(np.asarray(grad(emb, t))[0]).sum(-1)  # [T]
    assert np.all(g[t + 1:] == 0), (t, g)
    assert g[0] == 0, "padding leaked into a real token"
    assert np.all(g[1:t + 1] > 0), (t, g)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, "full", "dots"])
def test_remat_gives_identical_gradients(remat):
  cfg = models.get_preset("tiny")
  tokens = jnp.arange(8)[None] % cfg.vocab_size

  params = models.build_model(cfg, seed=3).param_dict()
  grad = nnx.jit(nnx.grad(lambda m: m(tokens).mean()))
  jaxpr = str(jax.make_jaxpr(lambda p: transformer.forward(cfg.replace(remat=remat), p, tokens))(params))
  assert "checkpoint" in jaxpr or "remat" in jaxpr
  assert ("DotsSaveable" in jaxpr) == (remat == "dots")  # the policy reaches it
  a = grad(models.Transformer(cfg, params=params))
  b = grad(models.Transformer(cfg.replace(remat=remat), params=params))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=1e-6)


def test_hidden_and_unembedding_reproduce_logits():
  model = models.build_model("tiny", tie_embeddings=True)
  tokens = jnp.asarray([[1, 2, 3, 4]])
  hidden, unembedding, logits = nnx.jit(lambda m: (m.hidden(tokens), m.unembedding(), m(tokens)))(model)
  assert hidden.shape == (1, 4, model.config.hidden_size)
  assert unembedding.shape == (model.config.hidden_size, model.config.vocab_size)
  np.testing.assert_allclose(hidden @ unembedding, logits, atol=1e-5)


def test_bfloat16_params_and_compute_keep_float32_logits():
  ref = models.build_model("tiny")
  cfg = ref.config.replace(param_dtype="bfloat16", dtype="bfloat16")
  model = models.Transformer(cfg, params={n: a.astype(jnp.bfloat16) for n, a in ref.param_dict().items()})
  assert model.wq[...].dtype == jnp.bfloat16
  tokens = jnp.asarray([[1, 2, 3, 4, 5]])
  logits = _logits(model, tokens, None)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, _logits(ref, tokens, None), atol=0.05)


def test_clear_errors():
  with pytest.raises(ValueError, match="num_kv_heads"):
    models.ModelConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="rope_type"):
    models.ModelConfig(rope_type="yarn")
  with pytest.raises(ValueError, match="layer_types"):  # one type per layer
    models.ModelConfig(sliding_window=4, layer_types=("sliding_attention",))
  with pytest.raises(ValueError, match="sliding_window is None"):
    models.ModelConfig(layer_types=("sliding_attention", "full_attention"))
  windowed = models.build_model("tiny", sliding_window=4)  # windows: tests/test_models_gemma.py
  with pytest.raises(ValueError, match="tokens must be an int array"):
    _logits(windowed, jnp.zeros((1, 4)), None)
