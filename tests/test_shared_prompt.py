"""Running each group's prompt once (forward_shared_prompt) gives the same log-probs,
entropies and gradients as running every row's prompt + completion in full."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models
from grpojax.models import transformer
from grpojax.train import step as step_lib

G = 3


def _batch(vocab):
  rng = np.random.default_rng(0)
  B, P, T = 2, 5, 6
  prompts = rng.integers(3, vocab, (B, P))
  prompts[0, :2] = 0  # left padding, different per prompt
  pmask = (prompts > 0).astype(np.int32)
  tokens = rng.integers(3, vocab, (B * G, T))
  lengths = np.array([6, 4, 1, 0, 3, 6])  # includes an empty completion
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
  tokens = np.where(mask > 0, tokens, 0)
  return (jnp.asarray(np.repeat(prompts, G, 0), jnp.int32), jnp.asarray(np.repeat(pmask, G, 0)),
          jnp.asarray(tokens, jnp.int32), jnp.asarray(mask))


@pytest.mark.slow
def test_shared_prompt_logps_and_grads_match_the_full_forward():
  # qwen2_tiny: q/k/v biases, 7:1 GQA, tied embeddings; with per-layer remat.
  model = models.build_model("qwen2_tiny", seed=1, remat=True)
  cfg, params = model.config, model.param_dict()
  prompts, pmask, tokens, mask = _batch(cfg.vocab_size)
  weights = jax.random.normal(jax.random.key(2), tokens.shape)

  def objective(params, group_size):
    logps, ent = step_lib.completion_logps(cfg, params, prompts, pmask, tokens, mask,
                                           temperature=0.7, with_entropy=True,
                                           group_size=group_size)
    return jnp.sum(weights * logps * mask), (logps, ent)

  (v1, (lp1, e1)), g1 = jax.value_and_grad(objective, has_aux=True)(params, 1)
  (vg, (lpg, eg)), gg = jax.value_and_grad(objective, has_aux=True)(params, G)
  m = np.asarray(mask) > 0
  np.testing.assert_allclose(np.asarray(lpg)[m], np.asarray(lp1)[m], atol=2e-5)
  np.testing.assert_allclose(np.asarray(eg)[m], np.asarray(e1)[m], atol=2e-5)
  np.testing.assert_allclose(float(vg), float(v1), rtol=1e-5)
  for name in g1:
    scale = float(jnp.max(jnp.abs(g1[name]))) + 1e-12
    np.testing.assert_allclose(np.asarray(gg[name]) / scale, np.asarray(g1[name]) / scale,
                               atol=2e-5, err_msg=name)
  # The prompts' own gradient paths matter: the sum above has nonzero gradients there.
  assert float(jnp.max(jnp.abs(g1["wk"]))) > 0


@pytest.mark.slow
def test_shared_prompt_hidden_states_match_the_full_forward():
  model = models.build_model("tiny", seed=3)
  cfg, params = model.config, model.param_dict()
  prompts, pmask, tokens, mask = _batch(cfg.vocab_size)
  hp, hc = transformer.forward_shared_prompt(cfg, params, prompts[::G], pmask[::G], tokens, mask)
  full = transformer.forward(cfg, params, jnp.concatenate([prompts, tokens], 1), None,
                                jnp.concatenate([pmask, mask], 1))
  P = prompts.shape[1]
  m = np.asarray(mask) > 0
  np.testing.assert_allclose(np.asarray(hc)[m], np.asarray(full[:, P:])[m], atol=1e-5)
  pm = np.asarray(pmask[::G]) > 0
  np.testing.assert_allclose(np.asarray(hp)[pm], np.asarray(full[::G, :P])[pm], atol=1e-5)


def test_rows_that_do_not_form_groups_are_refused():
  model = models.build_model("tiny", seed=0)
  prompts, pmask, tokens, mask = _batch(model.config.vocab_size)
  with pytest.raises(ValueError, match="groups"):
    transformer.forward_shared_prompt(model.config, model.param_dict(), prompts[:4], pmask[:4],
                                      tokens, mask)
  with pytest.raises(ValueError, match="groups of 4"):
    step_lib.completion_logps(model.config, model.param_dict(), prompts, pmask, tokens, mask,
                              group_size=4)
