"""HF checkpoints in and out: transformers reloads what we save; errors; bfloat16; sharded files."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import test_models_helpers as H
from grpojax import models
from grpojax.models import hf as hf_lib
from grpojax.models import safetensors_io

torch, transformers = H.torch, H.transformers


@nnx.jit
def _logits(model, tokens, mask):
  return model(tokens, mask=mask)


def _tokens(vocab, seed=0):
  return H.left_padded(np.random.default_rng(seed), [9, 5], 9, vocab)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_save_pretrained_reloads_in_transformers(tmp_path, kind):
  hf = H.hf_model(kind, seed=10)
  # Sharded HF checkpoint in (index.json), sharded checkpoint out (ours).
  hf.save_pretrained(tmp_path / "src", max_shard_size="60KB")
  assert os.path.isfile(tmp_path / "src" / "model.safetensors.index.json")
  model = models.from_pretrained(str(tmp_path / "src"), dtype="float32")
  models.save_pretrained(model, str(tmp_path / "out"), max_shard_bytes=100_000)
  index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
  assert len(set(index["weight_map"].values())) > 1

  back = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
  assert type(back) is type(hf)
  ref_state, back_state = hf.state_dict(), back.state_dict()
  assert set(ref_state) == set(back_state)
  for name, value in ref_state.items():  # bit-exact round trip of every tensor
    assert torch.equal(value, back_state[name]), name
  tokens, mask = _tokens(hf.config.vocab_size)
  ours = np.asarray(_logits(model, jnp.asarray(tokens), jnp.asarray(mask)))
  np.testing.assert_allclose(ours[mask], H.hf_logits(back, tokens, mask)[mask], atol=1e-4, rtol=0)


def test_scratch_model_saves_with_tokenizer(tmp_path):
  """A model built from a preset (no source config) plus a tokenizer: both load in transformers."""
  import test_models_tokenizers

  tok = models.load_tokenizer(test_models_tokenizers.make_hf_tokenizer_dir(tmp_path / "t"))
  cfg = models.get_preset("qwen2_tiny", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
  model = models.build_model(cfg, seed=2)
  # Random norms and biases so a mis-mapped tensor cannot hide behind ones/zeros.
  params = model.param_dict()
  for i, name in enumerate(sorted(n for n in params if n.endswith("norm") or n[0] == "b")):
    params[name] = params[name] + 0.3 * np.random.default_rng(i).standard_normal(params[name].shape)
  model = models.Transformer(cfg, params={k: jnp.asarray(v, jnp.float32) for k, v in params.items()})
  models.save_pretrained(model, str(tmp_path / "out"), tokenizer=tok)

  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert back.config.tie_word_embeddings and back.config.eos_token_id == tok.eos_id
  hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  assert hf_tok.encode("hello world") == tok.encode("hello world")
  tokens, mask = _tokens(cfg.vocab_size, seed=1)
  ours = np.asarray(_logits(model, jnp.asarray(tokens), jnp.asarray(mask)))
  np.testing.assert_allclose(ours[mask], H.hf_logits(back.eval(), tokens, mask)[mask], atol=1e-4)


def test_bfloat16_checkpoint_loads_bit_exact_and_saves(tmp_path):
  hf = H.hf_model("qwen3", seed=3).to(torch.bfloat16)
  hf.save_pretrained(tmp_path / "src")
  model = models.from_pretrained(str(tmp_path / "src"))  # default dtype: bfloat16
  assert model.wq[...].dtype == jnp.bfloat16 and model.config.dtype == "bfloat16"
  q = hf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(model.wq[...][1], np.float32).reshape(q.shape), q)
  # Loading bf16 into float32 converts on the fly.
  as_f32 = models.from_pretrained(str(tmp_path / "src"), dtype="float32")
  np.testing.assert_array_equal(np.asarray(as_f32.wq[...][1]).reshape(q.shape), q)
  models.save_pretrained(model, str(tmp_path / "out"))
  assert os.path.isfile(tmp_path / "out" / "model.safetensors")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
  assert torch.equal(back.model.layers[1].self_attn.q_proj.weight, hf.model.layers[1].self_attn.q_proj.weight)


def test_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    models.from_pretrained(str(tmp_path / "nope"))
  hf = H.hf_model("mistral")
  hf.save_pretrained(tmp_path / "ok")
  config = json.load(open(tmp_path / "ok" / "config.json"))

  bad = tmp_path / "moe"
  bad.mkdir()
  json.dump({**config, "architectures": ["MixtralForCausalLM"]}, open(bad / "config.json", "w"))
  with pytest.raises(ValueError, match="unsupported architectures .*MixtralForCausalLM"):
    models.from_pretrained(str(bad))

  # A checkpoint with one tensor left out.
  missing = tmp_path / "missing"
  missing.mkdir()
  json.dump(config, open(missing / "config.json", "w"))
  tensors = safetensors_io.read_header(str(tmp_path / "ok" / "model.safetensors"))
  kept = [n for n in tensors if n != "model.layers.1.mlp.up_proj.weight"]

  def fetch(name):
    out = np.empty(tensors[name].shape, tensors[name].dtype)
    safetensors_io.read_into(tensors[name], out)
    return out

  safetensors_io.write_file(str(missing / "model.safetensors"),
                            [(n, tensors[n].shape, tensors[n].dtype) for n in kept], fetch)
  with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
    models.from_pretrained(str(missing))

  with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
    hf_lib.config_from_hf({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                           "rope_parameters": None})
  windowed = hf_lib.config_from_hf({**config, "sliding_window": 4096})
  assert windowed.sliding_window == 4096  # Mistral-7B-v0.1: every layer windowed
  assert windowed.layer_windows == (4096,) * windowed.num_layers
  qwen = hf_lib.config_from_hf({**config, "architectures": ["Qwen2ForCausalLM"],
                                "use_sliding_window": True, "sliding_window": 64,
                                "max_window_layers": 1})  # transformers 4.x: no layer_types
  assert qwen.layer_windows == (None,) + (64,) * (qwen.num_layers - 1)
  with pytest.raises(ValueError, match="cannot express qkv_bias"):
    hf_lib.config_to_hf(models.get_preset("tiny", arch="mistral", qkv_bias=True))


def test_config_reads_transformers_4_keys():
  """Hub checkpoints carry 4.x-style rope_theta/rope_scaling, not rope_parameters."""
  cfg = hf_lib.config_from_hf({
      "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
      "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
      "num_key_value_heads": 1, "rope_theta": 500000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
      "eos_token_id": [1, 2], "tie_word_embeddings": True})
  assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (500000.0, "llama3", 32.0)
  assert cfg.head_dim == 4 and cfg.eos_ids == (1, 2) and cfg.tie_embeddings
