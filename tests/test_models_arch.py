"""A decoder variant added in one place (an Architecture subclass, registered) runs on
every path: the uncached forward and, through the unchanged sampler, prefill and decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models
from grpojax.models import config as config_lib
from grpojax.sampling import sampler
from test_sampler import MASK, NEVER, PROMPTS, _greedy_reference, _real_prompt


class ScaledGelu(models.Architecture):
  """Gemma-like: sqrt(D)-scaled input embeddings, (1 + scale) norms, a GELU-gated MLP."""

  def embed(self, cfg, params, tokens):
    x = jnp.take(params["embed"], tokens, axis=0)
    return (x * cfg.hidden_size**0.5).astype(cfg.dtype)

  def norm(self, cfg, x, scale):
    return super().norm(cfg, x, 1.0 + scale)

  def activation(self, cfg, gate):
    return jax.nn.gelu(gate, approximate=True)


@pytest.fixture
def variant():
  models.register_architecture("scaled_gelu", ScaledGelu())
  yield models.build_model("tiny", arch="scaled_gelu", seed=2)
  config_lib.ARCHITECTURES.pop("scaled_gelu")


@pytest.mark.slow
def test_variant_decodes_through_the_unchanged_sampler(variant):
  steps = 12
  out = sampler.generate(variant, PROMPTS, MASK, rng=jax.random.key(0), num_samples=2,
                         max_new_tokens=steps, temperature=0.0, eos_ids=NEVER, pad_id=0)
  refs = _greedy_reference(variant, [_real_prompt(b) for b in range(3)], steps)
  for b in range(3):
    assert out.tokens[2 * b].tolist() == out.tokens[2 * b + 1].tolist() == refs[b]
  # The hooks change the model: the same weights as plain Llama decode other tokens.
  plain = models.Transformer(variant.config.replace(arch="llama"), params=variant.param_dict())
  assert _greedy_reference(plain, [_real_prompt(b) for b in range(3)], steps) != refs


def test_variant_logits_follow_its_hooks(variant):
  """The variant's first logits, recomputed by hand from its weights."""
  cfg, p = variant.config, variant.param_dict()
  tokens = jnp.asarray([[5]])
  x = p["embed"][5] * cfg.hidden_size**0.5  # one token: attention returns its own value
  norm = lambda v, s: v / np.sqrt(np.mean(v * v) + cfg.rms_norm_eps) * (1 + s)  # noqa: E731
  for i in range(cfg.num_layers):
    h = norm(x, p["attn_norm"][i])
    v = p["wv"][i].reshape(-1, cfg.hidden_size) @ h  # [K*H]
    v = np.repeat(v.reshape(cfg.num_kv_heads, -1), cfg.num_heads // cfg.num_kv_heads, axis=0)
    x = x + p["wo"][i].reshape(cfg.hidden_size, -1) @ v.reshape(-1)
    h = norm(x, p["mlp_norm"][i])
    x = x + p["w_down"][i] @ (jax.nn.gelu(p["w_gate"][i] @ h, approximate=True) * (p["w_up"][i] @ h))
  want = p["lm_head"] @ norm(x, p["final_norm"])
  np.testing.assert_allclose(variant(tokens)[0, 0], want, atol=2e-4, rtol=1e-4)


def test_unknown_or_clashing_architectures_are_refused(variant):
  with pytest.raises(ValueError, match="arch='nope' is unknown"):
    models.get_preset("tiny", arch="nope")
  with pytest.raises(ValueError, match="already registered"):
    models.register_architecture("llama", ScaledGelu())
  with pytest.raises(TypeError):
    models.register_architecture("bad", object())


class ScaledGeluHF(ScaledGelu):
  """The variant with a Hugging Face identity: one registry entry holds its hooks and
  the class name its config.json carries."""

  hf_class, model_type = "ScaledGeluForCausalLM", "scaled_gelu"


@pytest.mark.slow
def test_a_registered_architecture_trains_and_exports_to_hf(tmp_path):
  """Saved, read back by its hf_class, trained by the loop from that directory, and
  exported: the export names the variant and loads as it, with the trained weights."""
  import json
  import os

  from grpojax.models import hf
  from grpojax.models.tokenizers import CharTokenizer
  from grpojax.train import loop
  from test_train_loop import tiny_config

  models.register_architecture("scaled_gelu_hf", ScaledGeluHF())
  try:
    tok = CharTokenizer()
    init = models.build_model("tiny", arch="scaled_gelu_hf", vocab_size=tok.vocab_size, seed=3)
    start = str(tmp_path / "init")
    models.save_pretrained(init, start, tokenizer=tok)
    cfg = tiny_config(1, **{"eval.num_prompts": 0, "sft.steps": 1})
    cfg.model.path = start
    workdir = str(tmp_path / "run")
    loop.train(cfg, workdir)
    with open(os.path.join(workdir, "hf", "config.json")) as f:
      written = json.load(f)
    assert written["architectures"] == ["ScaledGeluForCausalLM"]
    assert written["model_type"] == "scaled_gelu"
    trained = hf.from_pretrained(os.path.join(workdir, "hf"), dtype="float32")
    assert trained.config.arch == "scaled_gelu_hf"
    before, after = init.param_dict(), trained.param_dict()
    assert before.keys() == after.keys()
    assert any(not np.allclose(before[k], after[k]) for k in before)  # SFT and GRPO moved it
    # It runs its own hooks: the same weights read as plain Llama give other logits.
    tokens = jnp.asarray([[5, 6, 7]])
    plain = models.Transformer(trained.config.replace(arch="llama"), params=after)
    assert not np.allclose(trained(tokens), plain(tokens), atol=1e-3)
  finally:
    config_lib.ARCHITECTURES.pop("scaled_gelu_hf")


def test_an_architecture_without_hf_class_refuses_export(variant, tmp_path):
  with pytest.raises(ValueError, match="arch='scaled_gelu' has no Hugging Face format"):
    models.save_pretrained(variant, str(tmp_path / "x"))
