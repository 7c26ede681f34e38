"""Gemma 2 and 3 (models/gemma.py) against transformers' PyTorch models on the same weights.

The tiny configs (test_models_helpers) have 4-token windows that 12-token sequences
outrun, both layer kinds, Gemma 2's caps set low enough to bind and Gemma 3's two
RoPE bases, so each feature must be right for the logits to agree.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_models_helpers as H
from grpojax import config as config_lib
from grpojax import models, ops
from grpojax import plan as plan_lib
from grpojax.models import lora as lora_lib
from grpojax.models import transformer
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import engine, sampler, strategies
from grpojax.train import rollout
from grpojax.run.settings import read as read_settings

torch, transformers = H.torch, H.transformers
KINDS = ["gemma2", "gemma3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{kind: (hf torch model, the directory transformers saved it to)}."""
  out = {}
  for i, kind in enumerate(KINDS):
    hf = H.hf_model(kind, seed=20 + i)
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(path)
    out[kind] = (hf, str(path))
  return out


def _logits(cfg, params, tokens, mask):
  return jax.jit(lambda p, t, m: transformer.unembed(cfg, p, transformer.forward(cfg, p, t, None, m))
                 )(params, jnp.asarray(tokens), jnp.asarray(mask))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_and_round_trip(checkpoints, kind, tmp_path):
  """HF-saved checkpoint in, logits as HF's (dense scores for Gemma 3, blockwise for
  Gemma 2: windows and caps in both attention paths), and our save loads back in HF."""
  hf, path = checkpoints[kind]
  block = 4 if kind == "gemma2" else 1024
  model = models.from_pretrained(path, dtype="float32", attention_block=block)
  tokens, mask = H.left_padded(np.random.default_rng(0), [12, 7, 3], 12, hf.config.vocab_size)
  ref = H.hf_logits(hf, tokens, mask)
  assert np.abs(ref).max() > 0.9 * hf.config.final_logit_softcapping  # the final cap binds
  ours = np.asarray(_logits(model.config, model.param_dict(), tokens, mask))
  np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)

  models.save_pretrained(model, str(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
  assert type(back) is type(hf) and back.config.layer_types == hf.config.layer_types
  theirs, again = hf.state_dict(), back.state_dict()
  assert set(theirs) == set(again)
  for name, value in theirs.items():
    assert torch.equal(value, again[name]), name
  np.testing.assert_allclose(H.hf_logits(back, tokens, mask)[mask], ref[mask], atol=1e-5, rtol=0)


def test_blockwise_gradients_equal_dense_through_windows_and_caps():
  """The blockwise attention's hand-written backward (the softcap's derivative, the window
  mask) against autodiff of the dense scores."""
  cfg = models.ModelConfig(arch="gemma2", num_layers=2, sliding_window=3,
                           layer_types=("sliding_attention", "full_attention"),
                           attn_logit_softcap=2.0, final_logit_softcap=5.0,
                           query_pre_attn_scalar=8, tie_embeddings=True)
  params = models.build_model(cfg, seed=3).param_dict()
  params = {n: v + 0.2 * (n.endswith("norm")) for n, v in params.items()}  # norms != identity
  tokens, mask = H.left_padded(np.random.default_rng(4), [9, 6], 9, cfg.vocab_size)
  w = np.random.default_rng(5).normal(size=(*tokens.shape, cfg.vocab_size)).astype(np.float32)

  def grads(block):
    c = cfg.replace(attention_block=block)
    loss = lambda p: jnp.sum(  # noqa: E731
        transformer.unembed(c, p, transformer.forward(c, p, tokens, None, mask)) * w * mask[..., None])
    return jax.jit(jax.grad(loss))(params)

  dense, blockwise = grads(0), grads(4)
  for name in ("wq", "wk", "wv", "attn_norm"):
    ref = np.asarray(dense[name])
    assert np.abs(ref).max() > 1e-3
    np.testing.assert_allclose(np.asarray(blockwise[name]), ref, atol=1e-4 * np.abs(ref).max())


def test_cached_and_paged_decoding_match_the_forward():
  """Sampled completions' log-probs from prefill + decode_step (the lockstep sampler) and
  from the paged engine (pages of 4 tokens: whole pages fall out of the window) equal the
  teacher-forced forward's (itself HF's, above). One config with every Gemma feature at
  once (capped scores, windows, two RoPE bases: no HF class has them all), on the
  backend `auto` picks here: the native CPU kernels, and their XLA fallbacks."""
  cfg = models.ModelConfig(arch="gemma3", num_layers=3, qk_norm=True, tie_embeddings=True,
                           sliding_window=3, layer_types=("sliding_attention", "full_attention",
                                                          "sliding_attention"),
                           rope_local_theta=100.0, query_pre_attn_scalar=8,
                           attn_logit_softcap=2.0, final_logit_softcap=8.0)
  cfg = ops.resolve(cfg)
  params = models.build_model(cfg, seed=2).param_dict()
  params = {n: v + 0.3 * (n.endswith("norm")) for n, v in params.items()}  # norms != identity
  params["embed"] = params["embed"] * 20  # O(1) logits: the samples are not uniform
  prompts, pmask = H.left_padded(np.random.default_rng(6), [6, 3], 6, cfg.vocab_size)
  prompts, pmask = jnp.asarray(prompts), jnp.asarray(pmask)
  G, T = 2, 9
  kw = dict(rng=jax.random.key(1), num_samples=G, max_new_tokens=T,
            sampling=strategies.SamplingParams(1.0), eos_ids=(cfg.vocab_size - 1,), pad_id=0)
  lockstep = sampler.generate_from_params(cfg, params, prompts, pmask, **kw)
  paged = engine.generate(cfg, params, prompts, pmask, engine=engine.EngineConfig(page_size=4),
                          **kw)
  for out in (lockstep, paged):
    tokens = np.asarray(out.tokens)
    full = np.concatenate([np.repeat(np.asarray(prompts), G, 0), tokens], 1)
    fmask = np.concatenate([np.repeat(np.asarray(pmask), G, 0), np.asarray(out.mask) > 0], 1)
    logits = np.asarray(_logits(cfg, params, full, fmask))[:, 5:-1]
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, axis=-1)),
                              tokens[..., None], -1)[..., 0]
    real = np.asarray(out.mask) > 0
    assert real.sum() > 10
    np.testing.assert_allclose(np.asarray(out.logps)[real], want[real], atol=2e-4)
  # The trainer's log-probs: each prompt run once for its group (forward_shared_prompt),
  # the final cap on chunked logits (core/logprobs.py).
  train = jax.jit(lambda p, *a: rollout.completion_logps(cfg, p, *a, group_size=G, chunk_size=8))(
      params, jnp.repeat(prompts, G, 0), jnp.repeat(pmask, G, 0), lockstep.tokens, lockstep.mask)
  real = np.asarray(lockstep.mask) > 0
  np.testing.assert_allclose(np.asarray(train)[real], np.asarray(lockstep.logps)[real], atol=2e-4)


def test_lora_on_gemma_targets_and_peft_export(checkpoints, tmp_path):
  """Zero-B adapters leave Gemma as it was; random ones give PEFT's logits once exported,
  under PEFT's tensor names."""
  import peft
  hf, path = checkpoints["gemma3"]
  model = models.from_pretrained(path, dtype="float32")
  cfg, base = model.config, model.param_dict()
  lora = lora_lib.LoraConfig(rank=2, alpha=4.0, targets="all")
  adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(0))
  tokens, mask = H.left_padded(np.random.default_rng(7), [12, 8], 12, cfg.vocab_size)
  c = cfg.replace(lora_scale=lora.scale)
  np.testing.assert_array_equal(np.asarray(_logits(c, {**base, **adapters}, tokens, mask)),
                                np.asarray(_logits(c, base, tokens, mask)))
  rng = np.random.default_rng(8)
  adapters = {n: jnp.asarray(rng.normal(size=a.shape).astype(np.float32) * 0.3)
              for n, a in adapters.items()}
  ours = np.asarray(_logits(c, {**base, **adapters}, tokens, mask))
  lora_lib.save_peft(cfg, lora, adapters, str(tmp_path / "peft"))
  target = peft.get_peft_model(
      H.hf_model("gemma3", seed=20),
      peft.LoraConfig(r=2, lora_alpha=4.0, target_modules=lora_lib.peft_config(cfg, lora, "")[
          "target_modules"]))
  names = {k.replace(".default", "") for k in target.state_dict() if "lora_" in k}
  assert names == {e[0] for e in lora_lib.peft_tensors(cfg, lora)}
  loaded = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
  np.testing.assert_allclose(ours[mask], H.hf_logits(loaded, tokens, mask)[mask], atol=1e-4)


def test_planner_takes_gemma_3_1b_abstractly():
  """The published Gemma 3 1B shapes: parameters by hand from the config (999,885,952, HF's
  count for google/gemma-3-1b-pt), the planner's abstract train state holding them, and
  fit refusing a budget below that state without compiling anything."""
  model_cfg = models.get_preset("gemma-3-1b")
  D, F, V, L = 1152, 6912, 262144, 26
  N, K, H_ = 4, 1, 256
  per_layer = (N + 2 * K) * H_ * D + D * N * H_ + 3 * F * D + 4 * D + 2 * H_
  by_hand = V * D + D + L * per_layer
  assert by_hand == 999_885_952
  assert model_cfg.layer_windows.count(None) == 4 and model_cfg.layer_windows[5] is None
  cfg = config_lib.get_config()
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  state = plan_lib.abstract_state(read_settings(cfg), model_cfg, mesh)
  assert sum(math.prod(p.shape) * p.dtype.itemsize
             for p in jax.tree.leaves(state.params)) == 4 * by_hand
  total = plan_lib.bytes_per_device(state)
  # Per device: float32 parameters and Adam's two moments, a shard of each at least.
  assert total >= 3 * 4 * by_hand // mesh.size
  compiles = []
  real = plan_lib.measure
  plan_lib.measure = lambda *a, **k: compiles.append(1) or real(*a, **k)
  try:
    with pytest.raises(config_lib.ConfigError, match="the train state alone"):
      plan_lib.fit(read_settings(cfg), model_cfg, mesh, device_bytes=int(total / 0.9) - 1024)
  finally:
    plan_lib.measure = real
  assert not compiles
  assert math.isclose(model_cfg.attention_scale, 256**-0.5)
