"""The update program: it optimises, zero-std groups give no policy gradient, KL-only
gradients with beta > 0, no retrace, and the same result on several meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpojax import models
from grpojax.core import losses
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import sampler
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib

G = 4


@pytest.fixture(scope="module")
def setup():
  model = models.build_model("tiny", seed=0)
  prompts = jnp.array([[0, 5, 6, 7], [3, 4, 9, 5]], jnp.int32)
  pmask = (prompts > 0).astype(jnp.int32)
  out = sampler.generate(model, prompts, pmask, rng=jax.random.key(0), num_samples=G,
                         max_new_tokens=6, eos_ids=[1, 2], pad_id=0)
  rollout = step_lib.Rollout(
      prompt_tokens=jnp.repeat(prompts, G, axis=0), prompt_mask=jnp.repeat(pmask, G, axis=0),
      tokens=out.tokens, mask=out.mask,
      advantages=jnp.array([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, 0.2, -0.2]))
  return model, rollout


def _state(model, beta=0.0, tx=None):
  tx = tx or optax.adam(1e-2)
  return state_lib.create_train_state(model.config, model.param_dict(), tx, with_reference=beta > 0,
                                      ref_dtype="float32")


def _with_old_logps(state, rollout):
  """The rollout as an off-policy update sees it: behaviour log-probs from `state`."""
  return rollout.replace(old_logps=step_lib.completion_logps(
      state.model_config, state.params, rollout.prompt_tokens, rollout.prompt_mask,
      rollout.tokens, rollout.mask))


def _objective(state, rollout):
  """sum_i A_i * log pi(o_i): what policy gradient ascends."""
  logps = step_lib.completion_logps(state.model_config, state.params, rollout.prompt_tokens,
                                    rollout.prompt_mask, rollout.tokens, rollout.mask)
  return float(jnp.sum(rollout.advantages[:, None] * logps * rollout.mask))


@pytest.mark.slow
def test_sampler_and_trainer_logps_agree(setup):
  model, rollout = setup
  out = sampler.generate(model, rollout.prompt_tokens[::G], rollout.prompt_mask[::G],
                         rng=jax.random.key(0), num_samples=G, max_new_tokens=6, eos_ids=[1, 2],
                         pad_id=0)
  logps = step_lib.completion_logps(model.config, model.param_dict(), rollout.prompt_tokens,
                                    rollout.prompt_mask, out.tokens, out.mask)
  m = np.asarray(out.mask) > 0
  np.testing.assert_allclose(np.asarray(logps)[m], np.asarray(out.logps)[m], atol=1e-4)


@pytest.mark.slow
def test_updates_raise_the_objective_and_lower_the_surrogate(setup):
  model, rollout = setup
  state = _state(model)
  rollout = _with_old_logps(state, rollout)
  before = _objective(state, rollout)
  cfg = losses.LossConfig(loss_type="grpo", epsilon_low=10.0, epsilon_high=10.0)  # no clipping
  seen = []
  for i in range(3):
    state, metrics = step_lib.update(state, rollout, jax.random.key(i), loss_config=cfg,
                                     group_size=G)
    seen.append(float(metrics["loss"]))
  assert seen[0] > seen[1] > seen[2]
  assert _objective(state, rollout) > before
  assert int(state.step) == 3


@pytest.mark.slow
def test_zero_advantages_give_no_policy_gradient_but_kl_still_pulls(setup):
  model, rollout = setup
  rollout = rollout.replace(advantages=jnp.zeros(8))
  cfg = losses.LossConfig(loss_type="dapo")
  state = _state(model)
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = step_lib.update(state, rollout, jax.random.key(0), loss_config=cfg, group_size=G)
  assert float(metrics["grad_norm"]) == 0.0
  for k, v in state.params.items():
    np.testing.assert_array_equal(np.asarray(v), before[k])

  # beta > 0 with a reference that differs from the policy: a KL-only gradient.
  state = _state(model, beta=0.1)
  shifted = {k: v + 0.05 for k, v in state.ref_params.items()}
  state = state.replace(ref_params=shifted)
  ref = step_lib.completion_logps(state.reference()[0], shifted, rollout.prompt_tokens,
                                  rollout.prompt_mask, rollout.tokens, rollout.mask)
  state, metrics = step_lib.update(state, rollout.replace(ref_logps=ref), jax.random.key(0),
                                   loss_config=losses.LossConfig(loss_type="dapo", beta=0.1),
                                   group_size=G)
  assert float(metrics["grad_norm"]) > 0 and float(metrics["kl"]) > 0


@pytest.mark.slow
def test_minibatches_and_iterations_do_not_retrace(setup):
  model, rollout = setup
  state = _state(model)
  rollout = _with_old_logps(state, rollout)
  kw = dict(loss_config=losses.LossConfig(), group_size=G, num_iterations=2, minibatches=2)
  state, _ = step_lib.update(state, rollout, jax.random.key(0), **kw)
  size = step_lib.update._cache_size()
  state, metrics = step_lib.update(state, rollout, jax.random.key(1), **kw)
  assert step_lib.update._cache_size() == size
  assert np.isfinite(float(metrics["loss"]))
  with pytest.raises(ValueError, match="need old_logps"):
    step_lib.update(state, rollout.replace(old_logps=None), jax.random.key(2), **kw)


# (data, fsdp, tensor): all three axes at once, and all 8 devices on the tensor axis.
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 8)])
def test_sharded_update_matches_one_device(setup, shape):
  model, rollout = setup
  cfg = losses.LossConfig(loss_type="dapo")
  # Plain SGD with lr 1: parameters move by exactly the gradient (Adam's first
  # step would turn round-off in near-zero gradients into +-lr sign flips).
  ref_state, ref_metrics = step_lib.update(_state(model, tx=optax.sgd(1.0)), rollout, jax.random.key(0),
                                           loss_config=cfg, group_size=G)
  mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, shape)))
  sharded_params = models.shard_model(model, mesh).param_dict()
  state = state_lib.create_train_state(model.config, sharded_params, optax.sgd(1.0),
                                       with_reference=False)
  rows = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), rollout)
  state, metrics = step_lib.update(state, rows, jax.random.key(0), loss_config=cfg, group_size=G)
  # Reductions happen in a different order across shards: float32 round-off only.
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5, atol=1e-6)
  for k in state.params:
    np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(ref_state.params[k]),
                               rtol=1e-5, atol=2e-6)
    assert len(state.params[k].sharding.device_set) == 8


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_accumulated_minibatches_give_the_full_batch_gradient(setup, loss_type):
  # SGD makes the step proportional to the gradient the optimizer received, so
  # two accumulated half-batches must move the weights exactly as the full batch
  # does: dapo's losses (already divided by the whole batch's tokens) are summed,
  # grpo's per-minibatch means averaged, as in TRL.
  model, rollout = setup
  config = losses.LossConfig(loss_type=loss_type)
  accumulated = _state(model, tx=optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  rollout = _with_old_logps(accumulated, rollout)
  full = _state(model, tx=optax.sgd(0.1))
  full, _ = step_lib.update(full, rollout, jax.random.key(0), loss_config=config, group_size=G)
  accumulated, _ = step_lib.update(accumulated, rollout, jax.random.key(0), loss_config=config,
                                   group_size=G, minibatches=2, grad_accum_steps=2)
  for name, want in full.params.items():
    before = model.param_dict()[name]
    np.testing.assert_allclose(accumulated.params[name] - before, want - before, rtol=2e-4,
                               atol=1e-7, err_msg=name)


# With the batch-level extras: the high-entropy cut and the entropy bonus's
# normaliser are the whole minibatch's, the sampler correction and off-policy mask per row.
EXTRAS = dict(importance_sampling_correction=True, importance_sampling_mode="token_truncate",
              importance_sampling_clip_max=1.5, off_policy_mask_threshold=0.05,
              top_entropy_quantile=0.5, entropy_coef=0.01, beta=0.04)


@pytest.mark.slow
# Each aggregation once (grpo's and dapo's with the extras on: their plain cases add no
# path of their own, and each case compiles two updates).
@pytest.mark.parametrize("loss_type,extra", [
    ("bnpo", {}), ("dr_grpo", {}), ("dapo", EXTRAS), ("grpo", EXTRAS),
    ("luspo", dict(importance_sampling_level="sequence")),
    ("vespo", dict(EXTRAS, importance_sampling_mode="sequence_mask"))])
def test_micro_batches_give_the_whole_minibatch_gradient(setup, loss_type, extra):
  """train.micro_batches: the minibatch's gradient summed over micro-batches of whole
  groups (each weighted as its aggregation says) is the whole minibatch's: with
  SGD the weights move the same, to float32 round-off; the loss and token-mean
  metrics are the whole minibatch's too. Off-policy (old log-probs from a
  perturbed policy) so that ratios and clipping are not trivial."""
  model, rollout = setup
  config = losses.LossConfig(loss_type=loss_type, epsilon_low=0.01, **extra)
  shifted = jax.tree.map(lambda p: p * 1.2, model.param_dict())
  old = step_lib.completion_logps(model.config, shifted, rollout.prompt_tokens,
                                  rollout.prompt_mask, rollout.tokens, rollout.mask)
  noise = jax.random.normal(jax.random.key(3), old.shape) * 0.3
  rollout = rollout.replace(old_logps=old, sampler_logps=old + noise * rollout.mask)
  if config.beta:
    rollout = rollout.replace(ref_logps=old - noise)
  assert len(set(np.asarray(rollout.mask.sum(1)).tolist())) > 1  # parts differ in tokens
  results = []
  for micro in (1, 2):
    state, metrics = step_lib.update(_state(model, tx=optax.sgd(0.1)), rollout,
                                     jax.random.key(0), loss_config=config, group_size=G,
                                     micro_batches=micro)
    results.append((state, metrics))
  (whole, m_whole), (parts, m_parts) = results
  for name, want in whole.params.items():
    before = model.param_dict()[name]
    assert float(jnp.abs(want - before).max()) > 1e-5, name  # a real step
    np.testing.assert_allclose(parts.params[name] - before, want - before, rtol=2e-4,
                               atol=1e-7, err_msg=name)
  keys = [k for k in m_whole if not k.startswith("nonfinite/") and k != "grad_norm"]
  assert set(m_parts) == set(m_whole) and "sampling/sampling_logp_difference/max" in keys
  for key in keys:
    np.testing.assert_allclose(float(m_parts[key]), float(m_whole[key]), rtol=1e-5, atol=1e-7,
                               err_msg=key)
  if loss_type != "vespo":
    assert float(m_whole["clip_ratio/region_mean"]) > 0
  with pytest.raises(ValueError, match="micro-batches"):
    step_lib.update(_state(model), rollout, jax.random.key(0), loss_config=config,
                    group_size=G, micro_batches=3)


def test_rollout_logps_in_row_chunks_equal_all_rows_at_once(setup):
  """The rollout's reference / old log-prob forwards over row chunks of whole groups
  (RolloutConfig.logprob_chunks, the update's micro-batch rows) give the same values."""
  from grpojax.train import rollout as rollout_lib
  model, r = setup
  args = (model.config, model.param_dict(), r.prompt_tokens, r.prompt_mask, r.tokens, r.mask)
  whole = rollout_lib.completion_logps(*args, group_size=G)
  parts = jax.jit(lambda *a: rollout_lib.chunked_completion_logps(
      model.config, *a, chunks=2, group_size=G))(*args[1:])
  np.testing.assert_allclose(parts, whole, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="whole groups"):
    rollout_lib.chunked_completion_logps(*args, chunks=3, group_size=G)


# A tool's response at completion positions 1-3 of every row, and a last row that
# is all tool: tokens that exist (mask 1), attended to, never trained (loss_mask 0).
TOOL_RUN = slice(1, 4)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,micro_batches", [("dapo", 1), ("grpo", 1), ("bnpo", 2)])
def test_untrained_tokens_are_attended_to_but_never_trained(setup, loss_type, micro_batches):
  """Rollout.loss_mask apart from mask: the update's gradient is that of the loss over
  the trained tokens alone (d loss / d logp exactly 0 at the others, whose old and
  reference log-probs it never reads), while later tokens' log-probs still see the
  untrained ones through attention. Off-policy with beta > 0, so ratios, clipping,
  the KL and each aggregation's normaliser (micro-batched for bnpo) all read it."""
  model, base = setup
  N, T = base.tokens.shape
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, model.config.vocab_size, (N, T)), jnp.int32)
  mask = jnp.ones((N, T), jnp.int32)
  loss_mask = np.ones((N, T), np.int32)
  loss_mask[:, TOOL_RUN] = 0
  loss_mask[-1] = 0
  loss_mask = jnp.asarray(loss_mask)
  params = model.param_dict()
  config = losses.LossConfig(loss_type=loss_type, epsilon_low=0.01, beta=0.04)

  def logps_of(params, tokens, attend):
    return step_lib.completion_logps(model.config, params, base.prompt_tokens, base.prompt_mask,
                                     tokens, attend)

  old = logps_of(jax.tree.map(lambda p: p * 1.2, params), tokens, mask)
  ref = old + 0.3 * jax.random.normal(jax.random.key(1), old.shape)
  rollout = base.replace(tokens=tokens, mask=mask, loss_mask=loss_mask, old_logps=old,
                         ref_logps=ref)

  sgd = optax.sgd(1.0)  # one optimizer: a new one is a new static argument, a retrace

  def update(rollout):
    state, metrics = step_lib.update(_state(model, tx=sgd), rollout, jax.random.key(0),
                                     loss_config=config, group_size=G,
                                     micro_batches=micro_batches)
    return jax.tree.map(lambda new, p: np.asarray(p - new), state.params, params), metrics

  def reference(params, trained):
    return losses.policy_loss(logps_of(params, tokens, mask), old, rollout.advantages, trained,
                              config=config, ref_logps=ref)[0]

  # SGD with lr 1 moves the weights by exactly the gradient the update took.
  step, metrics = update(rollout)
  size = step_lib.update._cache_size()
  loss, want = jax.value_and_grad(reference)(params, loss_mask)
  assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5, abs=1e-6)
  for name, g in want.items():
    np.testing.assert_allclose(step[name], g, rtol=2e-4, atol=1e-7, err_msg=name)
  # ... which training every existing token would not give.
  conflated = jax.grad(reference)(params, mask)
  assert max(float(jnp.abs(conflated[k] - want[k]).max()) for k in want) > 1e-4
  # d loss / d logp is exactly 0 at the untrained tokens (and live elsewhere).
  d_logps = np.asarray(jax.grad(lambda lp: losses.policy_loss(
      lp, old, rollout.advantages, loss_mask, config=config, ref_logps=ref)[0])(
          logps_of(params, tokens, mask)))
  untrained = np.asarray(loss_mask) == 0
  assert not d_logps[untrained].any() and np.abs(d_logps[~untrained]).min() > 0

  # Nothing is read at the untrained tokens: garbage old and reference log-probs
  # there give the same update, bit for bit.
  garbage = rollout.replace(old_logps=jnp.where(untrained, old + 5.0, old),
                            ref_logps=jnp.where(untrained, -1e4, ref))
  same, same_metrics = update(garbage)
  for name in step:
    np.testing.assert_array_equal(same[name], step[name], err_msg=name)
  assert float(same_metrics["loss"]) == float(metrics["loss"])

  # Yet later tokens attend to them: other tokens at positions 1-2 of the run (3,
  # whose embedding predicts position 4, is kept) change the trained log-probs
  # after the run through attention alone, and with them the loss; those before
  # it cannot change (causality).
  other = tokens.at[:, 1:3].set((tokens[:, 1:3] + 7) % model.config.vocab_size)
  a, b = logps_of(params, tokens, mask), logps_of(params, other, mask)
  np.testing.assert_allclose(b[:, 0], a[:, 0], rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(b[:, 4:] - a[:, 4:]).max()) > 1e-3
  _, other_metrics = update(rollout.replace(tokens=other))
  assert abs(float(other_metrics["loss"]) - float(metrics["loss"])) > 1e-5
  assert step_lib.update._cache_size() == size  # none of these retraced
