"""The run's HF export is self-contained: transformers' AutoTokenizer and
AutoModelForCausalLM load it as is, and generate() stops at the run's EOS and
decodes what our sampler decodes (the default model: character tokenizer)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpojax import models
from grpojax.models.tokenizers import CharTokenizer
from grpojax.sampling import sampler
from grpojax.train import checkpoint
from grpojax.train import state as state_lib


def test_export_loads_and_generates_with_transformers(tmp_path):
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  tok = CharTokenizer()
  model = models.build_model("tiny", vocab_size=tok.vocab_size, seed=4)
  state = state_lib.create_train_state(model.config, model.param_dict(), optax.sgd(0.1),
                                       with_reference=False)
  path = str(tmp_path / "hf")
  checkpoint.export_hf(state, path, tokenizer=tok)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (2, 0, 1)
  with open(os.path.join(path, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == 2

  hf_tok = AutoTokenizer.from_pretrained(path)
  text = "37+58=\nx y"
  assert hf_tok(text)["input_ids"] == tok.encode(text)
  assert hf_tok.decode(tok.encode(text)) == text
  assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (2, 0)

  prompt = tok.encode("37+58=")
  ours = sampler.generate(model, jnp.asarray([prompt]), jnp.ones((1, len(prompt)), jnp.int32),
                          rng=jax.random.key(0), num_samples=1, max_new_tokens=8,
                          temperature=0.0, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
  ours = np.asarray(ours.tokens[0])[: int(ours.lengths[0])].tolist()
  hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
  theirs = out[0, len(prompt):].tolist()
  assert theirs == ours[:len(theirs)] and len(theirs) == len(ours)  # the same stop, at EOS or 8
