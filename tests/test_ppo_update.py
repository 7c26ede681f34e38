"""PPO with a learned critic, wired through the rollout and the update, against TRL 0.21's
PPOTrainer computations in torch on the same weights (HF transformers' models): the
policy's and reference's log-probs, the critic's values at each slot, the per-token
rewards, GAE's advantages and returns, and then the update's loss, value loss and
gradients (policy and critic, one optimizer step of plain SGD)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import test_models_helpers as H
from test_ppo_math import _lengths_mask, _trl_ppo_reference
from grpojax.core import losses
from grpojax.core import ppo
from grpojax.models import hf
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import rollout as rollout_lib
from grpojax.train.state import (CRITIC_PREFIX, create_train_state, lora_critic, split_trainable,
                                 with_critic)
from grpojax.train.step import update
from grpojax.run.settings import read as read_settings

torch = H.torch
PAD = 0
KL_COEF, VF_COEF, CLIPRANGE_VALUE = 0.05, 0.1, 0.2


def _batch(vocab, N=4, P=5, T=6):
  """Left-padded prompts and right-padded completions (pads after each row's end), one
  row empty and one filling all T (no slot after it)."""
  rng = np.random.default_rng(7)
  prompt_lengths = np.array([5, 3, 4, 2])
  lengths = np.array([6, 3, 0, 4])
  prompts = rng.integers(1, vocab, (N, P)).astype(np.int32)
  prompt_mask = np.arange(P)[None] >= P - prompt_lengths[:, None]
  prompts[~prompt_mask] = PAD
  tokens = rng.integers(1, vocab, (N, T)).astype(np.int32)
  mask = _lengths_mask(lengths, T).astype(bool)
  tokens[~mask] = PAD
  return prompts, prompt_mask, tokens, mask, lengths


def _trl_logprobs(model, query_response, context_length):
  """TRL 0.21's forward() then selective_log_softmax over the response (temperature 1)."""
  attention_mask = query_response != PAD
  position_ids = attention_mask.cumsum(1) - attention_mask.long()
  logits = model(input_ids=torch.masked_fill(query_response, ~attention_mask, 0),
                 attention_mask=attention_mask, position_ids=position_ids).logits
  logits = logits[:, context_length - 1:-1] / (1.0 + 1e-7)
  response = query_response[:, context_length:]
  return torch.gather(logits.log_softmax(-1), 2, response.unsqueeze(-1)).squeeze(-1)


def _trl_values(critic, query_response, context_length):
  """TRL 0.21's get_reward(value_model, ...)[0][:, context_length - 1 : -1]: the score
  head on the backbone's last hidden state at every position."""
  attention_mask = query_response != PAD
  position_ids = attention_mask.cumsum(1) - attention_mask.long()
  out = critic.model(input_ids=torch.masked_fill(query_response, ~attention_mask, 0),
                     attention_mask=attention_mask, position_ids=position_ids,
                     output_hidden_states=True)
  return critic.score(out.hidden_states[-1])[:, context_length - 1:-1, 0]


def _load(model, path):
  model.save_pretrained(path)
  return hf.load_params(str(path), dtype="float32")


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_ppo_rollout_and_update_match_trl_ppo_trainer(tmp_path, gamma, lam):
  policy_hf = H.hf_model("llama", seed=1)
  ref_hf = H.hf_model("llama", seed=2)
  critic_hf = H.hf_model("llama", seed=3, auto="AutoModelForSequenceClassification",
                         num_labels=1, pad_token_id=PAD)
  pcfg, pparams = _load(policy_hf, tmp_path / "policy")
  _, rparams = _load(ref_hf, tmp_path / "ref")
  ccfg, cparams = _load(critic_hf, tmp_path / "critic")
  prompts, prompt_mask, tokens, mask, lengths = _batch(pcfg.vocab_size)
  scores = np.array([1.5, -0.5, 0.25, 2.0], np.float32)

  # --- ours: the rollout's PPO fields, then one update of plain SGD (lr 1: the step is
  # minus the gradient) with TRL's loss shape (token mean over the batch: bnpo).
  state = create_train_state(pcfg, pparams, optax.sgd(1.0), with_reference=True,
                             ref_dtype="float32")
  state = state.replace(ref_params={k: jnp.asarray(v) for k, v in rparams.items()})
  state = with_critic(state, ccfg, cparams)
  config = rollout_lib.RolloutConfig(
      group_size=1, max_new_tokens=tokens.shape[1], sampling=SamplingParams(), eos_ids=(1,),
      pad_id=PAD, estimator="gae", with_reference=True, with_old_logps=True, engine=None,
      gamma=gamma, lam=lam, reward_kl_coef=KL_COEF, kl_estimator="k1")
  rollout = rollout_lib.Rollout(
      prompt_tokens=jnp.asarray(prompts), prompt_mask=jnp.asarray(prompt_mask),
      tokens=jnp.asarray(tokens), mask=jnp.asarray(mask, jnp.int32),
      loss_mask=jnp.asarray(mask, jnp.int32), advantages=jnp.zeros(tokens.shape))
  rollout = rollout_lib.with_gae(config, state, rollout_lib.with_logps(config, state, rollout),
                                 jnp.asarray(scores))
  before = jax.tree.map(np.asarray, state.trainable)
  loss_config = losses.LossConfig(loss_type="bnpo", beta=KL_COEF, kl_estimator="k1",
                                  kl_in_reward=True, vf_coef=VF_COEF,
                                  cliprange_value=CLIPRANGE_VALUE)
  new_state, metrics = update(state, rollout, jax.random.key(0), loss_config=loss_config,
                              group_size=1)
  grads = {k: before[k] - np.asarray(v) for k, v in new_state.trainable.items()}

  # --- TRL 0.21's PPOTrainer.train on the same batch, in float64 where it computes
  # (the models run in float32, as ours).
  context_length = prompts.shape[1]
  query_response = torch.tensor(np.concatenate([prompts, tokens], 1), dtype=torch.long)
  with torch.no_grad():
    logprobs = _trl_logprobs(policy_hf, query_response, context_length).double()
    ref_logprobs = _trl_logprobs(ref_hf, query_response, context_length).double()
    values = _trl_values(critic_hf, query_response, context_length).double()
  ref = _trl_ppo_reference(
      logprobs, ref_logprobs, values, torch.tensor(scores, dtype=torch.float64), values,
      torch.tensor(lengths - 1), kl_coef=KL_COEF, kl_estimator="k1", whiten_rewards=False,
      gamma=gamma, lam=lam, cliprange_value=CLIPRANGE_VALUE)

  on = mask
  np.testing.assert_allclose(np.asarray(rollout.old_logps)[on], logprobs.numpy()[on], atol=1e-4)
  np.testing.assert_allclose(np.asarray(rollout.ref_logps)[on], ref_logprobs.numpy()[on],
                             atol=1e-4)
  slots = np.asarray(ppo.value_mask(jnp.asarray(mask))) != 0
  np.testing.assert_allclose(np.asarray(rollout.values)[slots], values.numpy()[slots], atol=1e-4)
  np.testing.assert_allclose(rollout.advantages, ref["advantages"].numpy(), atol=2e-4)
  np.testing.assert_allclose(np.asarray(rollout.returns)[slots], ref["returns"].numpy()[slots],
                             atol=2e-4)

  # The update's loss and its gradients: TRL's loss = pg_loss + vf_coef * vf_loss, with
  # the ratio against the rollout's log-probs (1 on this first pass, its gradient not).
  policy_hf.zero_grad()
  critic_hf.zero_grad()
  new_logprobs = _trl_logprobs(policy_hf, query_response, context_length).double()
  vpred = _trl_values(critic_hf, query_response, context_length).double()
  padding_mask = torch.tensor(~mask)
  padding_mask_p1 = torch.tensor(~slots)
  adv = ref["advantages"]
  ratio = torch.exp(new_logprobs - logprobs)
  pg_losses = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
  pg_loss = pg_losses[~padding_mask].mean()
  vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
  returns = ref["returns"]
  old_values = torch.masked_fill(values, padding_mask_p1, 0)
  clipped = torch.clamp(vpred, old_values - CLIPRANGE_VALUE, old_values + CLIPRANGE_VALUE)
  vf_loss = 0.5 * torch.max((vpred - returns) ** 2, (clipped - returns) ** 2)[~padding_mask_p1].mean()
  loss = pg_loss + VF_COEF * vf_loss
  loss.backward()

  np.testing.assert_allclose(metrics["value/loss"], vf_loss.item(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], loss.item(), rtol=1e-4, atol=1e-6)
  # The same layouts in both: the embeddings [V, D] and the score head [1, D].
  np.testing.assert_allclose(grads["embed"], policy_hf.model.embed_tokens.weight.grad.numpy(),
                             atol=1e-5)
  np.testing.assert_allclose(grads[CRITIC_PREFIX + "embed"],
                             critic_hf.model.embed_tokens.weight.grad.numpy(), atol=1e-5)
  np.testing.assert_allclose(grads[CRITIC_PREFIX + "score"], critic_hf.score.weight.grad.numpy(),
                             atol=1e-5)
  # And every parameter, by norm, model by model.
  policy_grads, critic_grads = split_trainable(grads)
  for ours, model in ((policy_grads, policy_hf), (critic_grads, critic_hf)):
    want = np.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()
                       if p.grad is not None))
    got = np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in ours.values()))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert want > 0
  np.testing.assert_allclose(metrics["grad_norm"], np.hypot(
      np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in policy_grads.values())),
      np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in critic_grads.values()))),
      rtol=1e-5)


# --- the critic's state: micro-batches, checkpoints, where it starts, the config ---


def _tiny_ppo_state(tx=None, lora_rank=0):
  """A tiny policy and its critic; lora_rank > 0: LoRA adapters on a frozen base for
  both (the critic's own adapters and score head, state.lora_critic)."""
  from grpojax.models import lora as lora_lib
  from grpojax.models import transformer
  from grpojax.models.config import get_preset

  cfg = get_preset("tiny", dtype="float32")
  params = transformer.init_params(cfg, jax.random.key(0))
  lora = lora_lib.LoraConfig(rank=lora_rank, alpha=8.0) if lora_rank else None
  state = create_train_state(cfg, params, tx or optax.sgd(0.5), with_reference=False, lora=lora)
  if lora_rank:
    return with_critic(state, *lora_critic(state.model_config, state.params, jax.random.key(1)))
  return with_critic(state, *transformer.with_score_head(cfg, state.params, jax.random.key(1)))


def _tiny_rollout(state, N=4, P=3, T=5):
  rng = np.random.default_rng(3)
  V = state.model_config.vocab_size
  lengths = np.array([5, 2, 0, 3])
  mask = jnp.asarray(_lengths_mask(lengths, T), jnp.int32)
  config = rollout_lib.RolloutConfig(
      group_size=1, max_new_tokens=T, sampling=SamplingParams(), eos_ids=(1,), pad_id=PAD,
      estimator="gae", with_old_logps=True, engine=None)
  rollout = rollout_lib.Rollout(
      prompt_tokens=jnp.asarray(rng.integers(1, V, (N, P)), jnp.int32),
      prompt_mask=jnp.ones((N, P), jnp.int32),
      tokens=jnp.asarray(rng.integers(1, V, (N, T)), jnp.int32) * mask, mask=mask,
      loss_mask=mask, advantages=jnp.zeros((N, T)))
  return rollout_lib.with_gae(config, state, rollout_lib.with_logps(config, state, rollout),
                              jnp.asarray([1.0, -1.0, 0.5, 2.0]))


def test_micro_batches_give_the_critic_the_gradient_of_the_whole_minibatch():
  # Rows of unequal lengths: each micro-batch's value loss must weigh its share of the
  # minibatch's critic slots, not count as a mean of its own.
  kw = dict(loss_config=losses.LossConfig(loss_type="bnpo", vf_coef=0.5), group_size=1)
  got = {}
  for micro in (1, 2):
    state = _tiny_ppo_state()
    new, metrics = update(state, _tiny_rollout(state), jax.random.key(0), micro_batches=micro,
                          **kw)
    got[micro] = (jax.tree.map(np.asarray, new.trainable), float(metrics["loss"]))
  assert got[1][1] == pytest.approx(got[2][1], rel=1e-5)
  start = jax.tree.map(np.asarray, _tiny_ppo_state().trainable)
  for k in start:
    np.testing.assert_allclose(got[2][0][k] - start[k], got[1][0][k] - start[k], atol=1e-6,
                               err_msg=k)
  moved = [k for k in start if k.startswith(CRITIC_PREFIX) and np.any(got[1][0][k] != start[k])]
  assert CRITIC_PREFIX + "score" in moved and len(moved) > 3


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_checkpoint_holds_the_critic_and_its_optimizer_state(tmp_path, lora_rank):
  from grpojax.train.checkpoint import Checkpointer

  tx = optax.adam(1e-2)
  state = _tiny_ppo_state(tx, lora_rank)
  state, _ = update(state, _tiny_rollout(state), jax.random.key(0),
                    loss_config=losses.LossConfig(loss_type="bnpo"), group_size=1)
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {"data": {}})
  fresh = _tiny_ppo_state(tx, lora_rank)
  restored, _ = ckpt.restore(fresh, 1)
  ckpt.close()
  assert not np.array_equal(fresh.critic_params["score"], state.critic_params["score"])
  for k, v in state.critic_params.items():
    np.testing.assert_array_equal(restored.critic_params[k], v)
  for a, b in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state)):
    np.testing.assert_array_equal(a, b)


def test_the_critic_starts_from_the_policy_or_a_reward_model(tmp_path):
  from grpojax import config as config_lib
  from grpojax.train import wiring

  state = _tiny_ppo_state()
  cfg = config_lib.get_config()
  cfg.advantage.estimator = "gae"
  critic_cfg, params = wiring.critic(read_settings(cfg), state)
  assert (critic_cfg.head, critic_cfg.num_labels) == ("score", 1)
  for k, v in params.items():  # the policy's decoder, a fresh head
    if k != "score":
      np.testing.assert_array_equal(v, state.params[k])
  assert "lm_head" not in params and float(np.std(params["score"])) > 0

  hf_critic = H.hf_model("llama", seed=3, auto="AutoModelForSequenceClassification",
                         num_labels=1, pad_token_id=PAD)
  hf_critic.save_pretrained(tmp_path / "rm")
  cfg.advantage.critic = str(tmp_path / "rm")
  small = state.replace(model_config=state.model_config.replace(vocab_size=8))
  critic_cfg, params = wiring.critic(read_settings(cfg), small)
  np.testing.assert_allclose(params["score"], hf_critic.score.weight.detach().numpy(), atol=0)
  assert critic_cfg.dtype == small.model_config.dtype
  run = read_settings(cfg)
  with pytest.raises(config_lib.ConfigError, match="vocabulary"):
    wiring.critic(run, state.replace(model_config=state.model_config.replace(vocab_size=10**6)))
  hf_critic_3 = H.hf_model("llama", seed=3, auto="AutoModelForSequenceClassification",
                           num_labels=3, pad_token_id=PAD)
  hf_critic_3.save_pretrained(tmp_path / "rm3")
  cfg.advantage.critic = str(tmp_path / "rm3")
  with pytest.raises(config_lib.ConfigError, match="3 labels"):
    wiring.critic(read_settings(cfg), small)


@pytest.mark.parametrize("overrides,match", [
    ({"rollout.group_size": 1}, "gae, PPO's critic, works with 1"),
    ({"advantage.estimator": "gae", "model.lora.rank": 4, "advantage.critic": "owner/rm"},
     "advantage.critic='policy'"),
    ({"advantage.estimator": "gae", "rollout.dynamic_sampling": True},
     "rollout.dynamic_sampling=False"),
    ({"advantage.estimator": "gae", "advantage.lam": 1.5}, "advantage.lam"),
    ({"advantage.estimator": "gae", "advantage.critic": "/nonexistent/dir"}, "advantage.critic"),
    ({"loss.kl_in_reward": True, "loss.beta": 0.1}, "only advantage.estimator=gae reads"),
    ({"advantage.estimator": "gae", "loss.kl_in_reward": True}, "set loss.beta > 0"),
    ({"advantage.estimator": "gae", "loss.cliprange_value": 0.0}, "cliprange_value"),
])
def test_the_config_refuses_what_ppo_cannot_run(overrides, match):
  from grpojax import config as config_lib

  cfg = config_lib.get_config()
  for key, value in overrides.items():
    section, name = key.rsplit(".", 1)
    node = cfg
    for part in section.split("."):
      node = node[part]
    node[name] = value
  with pytest.raises(config_lib.ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
    config_lib.validate(cfg)


def test_groups_share_their_prompt_in_the_critic_as_in_the_policy():
  # G = 2 over rows whose prompts come in pairs: the critic runs each prompt once
  # (forward_shared_prompt) and must give the per-row forward's values and value loss.
  state = _tiny_ppo_state()
  rollout = _tiny_rollout(state)
  rollout = rollout.replace(prompt_tokens=jnp.repeat(rollout.prompt_tokens[::2], 2, axis=0))
  got = []
  for G in (1, 2):
    config = rollout_lib.RolloutConfig(
        group_size=G, max_new_tokens=5, sampling=SamplingParams(), eos_ids=(1,), pad_id=PAD,
        estimator="gae", engine=None)
    scored = rollout_lib.with_gae(config, state, rollout, jnp.asarray([1.0, -1.0, 0.5, 2.0]))
    _, metrics = update(_tiny_ppo_state(), scored, jax.random.key(0),
                        loss_config=losses.LossConfig(loss_type="bnpo"), group_size=G)
    got.append((np.asarray(scored.values), float(metrics["value/loss"])))
  np.testing.assert_allclose(got[1][0], got[0][0], atol=1e-5)
  assert got[1][1] == pytest.approx(got[0][1], rel=1e-5)


# --- LoRA: the critic's own adapters and score head on the policy's frozen base ---


def test_a_lora_critic_is_adapters_on_the_policys_base_and_trains_as_the_merged_model():
  # The reference is a full critic on the merged weights (lora.merge: W + s B A, a path
  # apart from the forward's per-matmul delta) with the same head: its values, and the
  # gradient of vf_coef x its value loss carried back to A and B through the merge,
  # must be the LoRA critic's values and the update's step on its adapters (plain SGD).
  from grpojax.models import lora as lora_lib
  from grpojax.models import transformer

  lr, vf_coef = 0.5, 0.5
  state = _tiny_ppo_state(optax.sgd(lr), lora_rank=4)
  assert set(state.critic_params) == {"score"} | {
      k for k in state.params if lora_lib.is_adapter(k)}
  # B starts at zero (the base's values); give it weight so the adapters matter.
  keys = iter(jax.random.split(jax.random.key(5), len(state.critic_params)))
  critic = {k: v + 0.05 * jax.random.normal(next(keys), v.shape) if k.endswith("_lora_b") else v
            for k, v in state.critic_params.items()}
  state = state.replace(critic_params=critic)
  rollout = _tiny_rollout(state)
  scale = state.model_config.lora_scale
  assert scale == 8.0 / 4  # alpha / rank
  full_cfg = state.critic_config.replace(lora_scale=1.0)
  base = {k: v for k, v in state.frozen.items() if k != "lm_head"}

  def merged_critic(trained):
    return lora_lib.merge({**base, **trained}, scale)

  def values(trained):
    return rollout_lib.critic_values(full_cfg, merged_critic(trained), rollout.prompt_tokens,
                                     rollout.prompt_mask, rollout.tokens, rollout.mask)

  np.testing.assert_allclose(rollout.values, values(critic), atol=1e-5)
  assert "wq_lora_a" not in merged_critic(critic) and "score" in transformer.param_specs(full_cfg)

  def value_term(trained):
    loss, _ = ppo.value_loss(values(trained), rollout.values, rollout.returns, rollout.loss_mask,
                             CLIPRANGE_VALUE)
    return vf_coef * loss

  grads = jax.grad(value_term)(critic)
  critic, frozen = jax.tree.map(np.asarray, (critic, state.frozen))  # update donates the state
  new, _ = update(state, rollout, jax.random.key(0), group_size=1,
                  loss_config=losses.LossConfig(loss_type="bnpo", vf_coef=vf_coef,
                                                cliprange_value=CLIPRANGE_VALUE))
  for k, v in critic.items():
    np.testing.assert_allclose(new.critic_params[k] - v, -lr * grads[k], atol=2e-6, err_msg=k)
    assert np.any(new.critic_params[k] != v), k
  # The base is shared and stays as it was.
  for k, v in frozen.items():
    np.testing.assert_array_equal(new.frozen[k], v, err_msg=k)
  assert not set(new.critic_params) & set(new.frozen)


def test_a_lora_runs_critic_comes_from_the_policys_base(tmp_path):
  from grpojax import config as config_lib
  from grpojax.train import wiring

  state = _tiny_ppo_state(lora_rank=4)
  cfg = config_lib.get_config()
  cfg.advantage.estimator = "gae"
  cfg.model.lora.rank = 4
  config_lib.validate(cfg)
  critic_cfg, params = wiring.critic(read_settings(cfg), state)
  assert (critic_cfg.head, critic_cfg.num_labels) == ("score", 1)
  assert critic_cfg.lora_scale == state.model_config.lora_scale
  assert set(params) == {"score"} | set(state.params)
  for k, v in params.items():  # fresh: B zero (the base's values), A and the head drawn
    assert v.shape == (state.params[k].shape if k != "score" else (1, critic_cfg.hidden_size))
    if k.endswith("_lora_b"):
      assert not np.any(v)
    elif k.endswith("_lora_a"):
      assert not np.array_equal(v, state.params[k])  # not the policy's draw
  (tmp_path / "config.json").write_text("{}")  # a reward model's directory, as far as read sees
  cfg.advantage.critic = str(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="with LoRA"):
    read_settings(cfg)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_hf_export_holds_the_critic_as_a_sequence_classifier(tmp_path, lora_rank):
  # Full: the critic's own weights; LoRA: its adapters folded into the shared base
  # (lora.merge), the policy's lm_head left out. transformers loads it as the
  # *ForSequenceClassification TRL's and verl's value models are.
  from grpojax.models import lora as lora_lib
  from grpojax.train.checkpoint import export_hf

  state = _tiny_ppo_state(lora_rank=lora_rank)
  if lora_rank:  # B at zero would make the merge the base itself
    state = state.replace(critic_params={
        k: v + 0.1 if k.endswith("_lora_b") else v for k, v in state.critic_params.items()})
  want = state.critic_model_params
  if lora_rank:
    want = lora_lib.merge(want, state.critic_config.lora_scale)
  want = {k: np.asarray(v) for k, v in want.items() if k != "lm_head"}
  export_hf(state, str(tmp_path / "hf"), dtype="float32")
  cfg, got = hf.load_params(str(tmp_path / "hf" / "critic"), dtype="float32")
  assert (cfg.head, cfg.num_labels) == ("score", 1) and set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
  hf_critic = H.transformers.AutoModelForSequenceClassification.from_pretrained(
      str(tmp_path / "hf" / "critic"))
  np.testing.assert_array_equal(hf_critic.score.weight.detach().numpy(), want["score"])
