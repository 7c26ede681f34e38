"""The score head (HF's *ForSequenceClassification: reward models and critics) against
transformers' PyTorch models on the same weights: the pooled logits with HF's
last-non-pad-token rule and its pad_token_id cases, the per-position values, the
checkpoint in and out."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import test_models_helpers as H
from grpojax import models
from grpojax.models import transformer

torch, transformers = H.torch, H.transformers
PAD = 0


@nnx.jit
def _scores(model, tokens, mask):
  return model(tokens, mask=mask)


def _hf_classifier(kind, num_labels, seed=4, **overrides):
  return H.hf_model(kind, seed=seed, auto="AutoModelForSequenceClassification",
                    **{"num_labels": num_labels, "pad_token_id": PAD, **overrides})


def _batch(vocab):
  """Right-padded rows as TRL hands a reward model its texts, one with the pad id inside
  its text (attended: HF's rule still reads its last token), one ending in it."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, vocab, (4, 10)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  for row, n in ((0, 6), (2, 3)):
    tokens[row, n:], mask[row, n:] = PAD, False
  tokens[1, 4] = PAD  # in the text
  tokens[3, 9] = PAD  # last, attended (a pad id that is also EOS): HF reads position 8
  return tokens, mask


def _hf_scores(hf, tokens, mask):
  with torch.no_grad():
    return hf(torch.tensor(tokens, dtype=torch.long),
              attention_mask=torch.tensor(mask, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("kind,num_labels", [("llama", 1), ("qwen2", 3), ("qwen3", 1),
                                             ("mistral", 2)])
def test_a_sequence_classifier_scores_as_transformers_does_and_round_trips(tmp_path, kind,
                                                                          num_labels):
  hf = _hf_classifier(kind, num_labels)
  hf.save_pretrained(tmp_path / "src")
  model = models.from_pretrained(str(tmp_path / "src"), dtype="float32")
  assert (model.config.head, model.config.num_labels) == ("score", num_labels)
  assert "lm_head" not in model.param_dict()
  tokens, mask = _batch(hf.config.vocab_size)
  ours = np.asarray(_scores(model, jnp.asarray(tokens), jnp.asarray(mask)))
  assert ours.shape == (4, num_labels)
  np.testing.assert_allclose(ours, _hf_scores(hf, tokens, mask), atol=1e-4, rtol=0)

  # Every position (a critic's values): HF's score layer over its last hidden state.
  with torch.no_grad():
    hidden = hf.model(torch.tensor(tokens, dtype=torch.long),
                      attention_mask=torch.tensor(mask, dtype=torch.long)).last_hidden_state
    want = hf.score(hidden).float().numpy()
  values = np.asarray(nnx.jit(lambda m, t, k: m.values(t, mask=k))(model, jnp.asarray(tokens),
                                                                     jnp.asarray(mask)))
  np.testing.assert_allclose(values[mask], want[mask], atol=1e-4, rtol=0)

  models.save_pretrained(model, str(tmp_path / "out"))
  back = transformers.AutoModelForSequenceClassification.from_pretrained(
      tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
  assert type(back) is type(hf) and back.config.num_labels == num_labels
  ref_state, back_state = hf.state_dict(), back.state_dict()
  assert set(ref_state) == set(back_state)
  for name, value in ref_state.items():  # bit-exact round trip of every tensor
    assert torch.equal(value, back_state[name]), name


def test_the_pooled_position_follows_hfs_pad_rule():
  # The rightmost token that is not the pad id, left or right padding alike; 0 for pads only.
  tokens = jnp.array([[5, 6, 0, 0], [0, 0, 7, 8], [3, 0, 4, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(transformer.last_token_index(tokens, 0), [1, 3, 2, 0])
  np.testing.assert_array_equal(transformer.last_token_index(tokens, None), [3, 3, 3, 3])


def test_without_a_pad_id_one_row_reads_its_last_position_and_batches_are_refused(tmp_path):
  hf = _hf_classifier("llama", 1, pad_token_id=None)
  hf.save_pretrained(tmp_path / "src")
  model = models.from_pretrained(str(tmp_path / "src"), dtype="float32")
  tokens = np.random.default_rng(1).integers(1, hf.config.vocab_size, (2, 7)).astype(np.int32)
  with torch.no_grad():
    want = hf(torch.tensor(tokens[:1], dtype=torch.long)).logits.float().numpy()
    with pytest.raises(ValueError, match="padding token"):
      hf(torch.tensor(tokens, dtype=torch.long))
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens[:1]))), want, atol=1e-4)
  with pytest.raises(ValueError, match="pad_token_id"):
    model(jnp.asarray(tokens))


def test_heads_refuse_what_they_do_not_have():
  scorer = models.build_model("tiny", head="score", num_labels=2)
  assert scorer.score[...].shape == (2, scorer.config.hidden_size)
  with pytest.raises(ValueError, match="no language-model head"):
    transformer.unembedding(scorer.config, scorer.param_dict())
  lm = models.build_model("tiny")
  with pytest.raises(ValueError, match="no score head"):
    lm.values(jnp.ones((1, 3), jnp.int32))
  with pytest.raises(ValueError, match="head='value'"):
    models.get_preset("tiny", head="value")


def test_a_critic_started_from_a_policy_shares_its_body_and_draws_its_head():
  import jax

  policy = models.build_model("qwen2_tiny", seed=3)  # tied embeddings: no lm_head to drop
  cfg, params = transformer.with_score_head(policy.config, policy.param_dict(),
                                            jax.random.key(0))
  assert (cfg.head, cfg.num_labels) == ("score", 1) and "lm_head" not in params
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 200, (2, 6)), jnp.int32)
  hidden = transformer.forward(policy.config, policy.param_dict(), tokens)
  values = transformer.score(cfg, params, transformer.forward(cfg, params, tokens))
  np.testing.assert_array_equal(transformer.forward(cfg, params, tokens), hidden)
  np.testing.assert_allclose(values[..., 0], np.asarray(hidden) @ np.asarray(params["score"][0]),
                             rtol=1e-5, atol=1e-6)
  assert 0.01 < float(jnp.std(params["score"])) < 0.04  # N(0, 0.02), as HF draws it
  untied = models.build_model("tiny", seed=1)
  _, p2 = transformer.with_score_head(untied.config, untied.param_dict(), jax.random.key(1))
  assert set(p2) == set(transformer.param_specs(untied.config.replace(head="score")))
  assert "lm_head" in untied.param_dict() and "lm_head" not in p2
  same_cfg, same = transformer.with_score_head(cfg, params, jax.random.key(2))
  assert same_cfg == cfg and same["score"] is params["score"]  # a score model keeps its head
