"""The optimizer from the `optim.*` config and the reference sync, against hand numbers.

Adam with b1 = b2 = 0 has m_hat = g and v_hat = g^2, so one step moves a parameter
by exactly -lr * g / (|g| + eps): with eps = 0 that is -lr * sign(g) (reads the
learning rate), with eps = 1 it is linear enough in g to read clipping and averaging.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpojax import config as config_lib
from grpojax import models
from grpojax.train import optim
from grpojax.train import state as state_lib


def _optim(**overrides):
  cfg = config_lib.get_config().optim
  base = dict(learning_rate=1.0, schedule="constant", warmup_steps=0, weight_decay=0.0, b1=0.0,
              b2=0.0, eps=0.0, max_grad_norm=0.0, grad_accum_steps=1)
  for k, v in {**base, **overrides}.items():
    cfg[k] = v
  return cfg


def _run(tx, params, grads_seq):
  """Applies the gradients in turn; returns the update of each call."""
  opt_state, update = tx.init(params), jax.jit(tx.update)  # one compile, not one per op
  seen = []
  for grads in grads_seq:
    updates, opt_state = update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    seen.append(updates)
  return seen, params


# (step, learning rate): lr 1, warmup 4 steps from 0, 12 optimizer steps in all.
WARMUP = [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]
COSINE = WARMUP + [(4, 1.0), (6, 0.8535534), (8, 0.5), (10, 0.1464466), (12, 0.0), (14, 0.0)]
CONSTANT = WARMUP + [(4, 1.0), (9, 1.0), (14, 1.0)]
LINEAR = WARMUP + [(4, 1.0), (6, 0.75), (8, 0.5), (10, 0.25), (12, 0.0), (14, 0.0)]


@pytest.mark.parametrize("schedule,expected", [("cosine", COSINE), ("constant", CONSTANT),
                                               ("linear", LINEAR)])
def test_warmup_then_schedule(schedule, expected):
  fn = optim.learning_rate_schedule(1.0, 4, 12, schedule)
  for step, lr in expected:
    assert float(fn(step)) == pytest.approx(lr, abs=1e-6), step
  # The same numbers come out of the whole optimizer: constant gradient 1,
  # Adam with b1 = b2 = eps = 0 steps by exactly -lr(k).
  tx = optim.make_optimizer(_optim(schedule=schedule, warmup_steps=4), total_steps=12)
  updates, _ = _run(tx, {"w": jnp.zeros(())}, [{"w": jnp.ones(())}] * 15)
  for step, lr in expected:
    assert -float(updates[step]["w"]) == pytest.approx(lr, abs=1e-6), step


def test_cosine_without_warmup_and_unknown_schedule():
  fn = optim.learning_rate_schedule(2.0, 0, 8, "cosine")
  assert [float(fn(k)) for k in (0, 4, 8)] == pytest.approx([2.0, 1.0, 0.0], abs=1e-6)
  with pytest.raises(ValueError, match="optim.schedule='step' is unknown"):
    optim.learning_rate_schedule(1.0, 0, 8, "step")


@pytest.mark.parametrize("schedule,theirs", [("linear", "linear"), ("cosine", "cosine"),
                                             ("constant", "constant_with_warmup")])
def test_schedules_are_transformers_own(schedule, theirs):
  # TRL's lr_scheduler_type goes through transformers.get_scheduler: the same rate at
  # each of the run's optimizer steps, warmup included.
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=3e-4)
  sched = transformers.get_scheduler(theirs, opt, num_warmup_steps=3, num_training_steps=20)
  theirs = []
  for _ in range(20):
    theirs.append(opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
  ours = optim.learning_rate_schedule(3e-4, 3, 20, schedule)
  assert [float(ours(k)) for k in range(20)] == pytest.approx(theirs, rel=1e-5, abs=1e-12)


def test_weight_decay_skips_norms_and_biases():
  # The real parameter names of a model with biases (Qwen2: bq, bk, bv).
  names = models.param_specs(models.get_preset("qwen2_tiny")).keys()
  decayed = {"embed", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
  kept = {"final_norm", "attn_norm", "mlp_norm", "bq", "bk", "bv"}
  assert set(names) == decayed | kept
  params = {k: jnp.full((2,), 2.0) for k in names}
  tx = optim.make_optimizer(_optim(learning_rate=0.1, weight_decay=0.5, eps=1.0), total_steps=10)
  # Zero gradients: AdamW moves only by decay, p <- p - lr * wd * p = 2 - 0.1.
  _, new = _run(tx, params, [{k: jnp.zeros((2,)) for k in names}])
  for k in decayed:
    np.testing.assert_allclose(np.asarray(new[k]), [1.9, 1.9], rtol=1e-6, err_msg=k)
  for k in kept:
    np.testing.assert_array_equal(np.asarray(new[k]), [2.0, 2.0], err_msg=k)


@pytest.mark.parametrize("max_norm,grad,expected", [
    (1.0, [3.0, 4.0], [-0.6 / 1.6, -0.8 / 1.8]),  # norm 5 -> scaled to [0.6, 0.8]
    (1.0, [0.3, 0.4], [-0.3 / 1.3, -0.4 / 1.4]),  # norm 0.5: left alone
    (0.0, [3.0, 4.0], [-3.0 / 4.0, -4.0 / 5.0]),  # 0: no clipping
])
def test_clip_by_global_norm(max_norm, grad, expected):
  tx = optim.make_optimizer(_optim(max_grad_norm=max_norm, eps=1.0), total_steps=10)
  (updates,), _ = _run(tx, {"a": jnp.zeros(()), "b": jnp.zeros(())},
                       [{"a": jnp.array(grad[0]), "b": jnp.array(grad[1])}])
  np.testing.assert_allclose([float(updates["a"]), float(updates["b"])], expected, rtol=1e-6)


def test_grad_accumulation_updates_every_k_steps_with_the_mean_gradient():
  tx = optim.make_optimizer(_optim(eps=1.0, grad_accum_steps=3), total_steps=10)
  grads = [{"w": jnp.array(g)} for g in (1.0, 2.0, 6.0, 0.5, 0.5, 0.5)]
  updates, params = _run(tx, {"w": jnp.zeros(())}, grads)
  # Mean gradients 3 and 0.5 -> -3/4 and -0.5/1.5, each on every third call only.
  np.testing.assert_allclose([float(u["w"]) for u in updates],
                             [0, 0, -0.75, 0, 0, -1 / 3], rtol=1e-6)
  assert float(params["w"]) == pytest.approx(-0.75 - 1 / 3)


def test_grad_accumulation_counts_optimizer_steps_for_the_schedule():
  # Warmup over 2 optimizer steps = 4 micro-steps: lr 0 then 0.5 then 1.
  tx = optim.make_optimizer(_optim(warmup_steps=2, grad_accum_steps=2), total_steps=10)
  updates, _ = _run(tx, {"w": jnp.zeros(())}, [{"w": jnp.ones(())}] * 6)
  np.testing.assert_allclose([-float(u["w"]) for u in updates], [0, 0, 0, 0.5, 0, 1.0], atol=1e-7)


def _state(params, *, with_reference, ref_dtype="float32"):
  return state_lib.create_train_state(models.get_preset("tiny"), params, optax.sgd(1.0),
                                      with_reference=with_reference, ref_dtype=ref_dtype)


def test_sync_reference_mixes_policy_into_reference():
  state = _state({"w": jnp.array([1.0, 2.0])}, with_reference=True)
  state = state.replace(ref_params={"w": jnp.array([3.0, 6.0])})
  # 0.25 * [1, 2] + 0.75 * [3, 6]
  np.testing.assert_allclose(np.asarray(state_lib.sync_reference(state, 0.25).ref_params["w"]),
                             [2.5, 5.0], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(state_lib.sync_reference(state, 1.0).ref_params["w"]),
                                [1.0, 2.0])
  np.testing.assert_array_equal(np.asarray(state_lib.sync_reference(state, 0.0).ref_params["w"]),
                                [3.0, 6.0])
  # A bfloat16 reference stays bfloat16 (0.5 * 1 + 0.5 * 3 = 2 is exact in bf16).
  bf16 = _state({"w": jnp.array([1.0])}, with_reference=True, ref_dtype="bfloat16")
  bf16 = bf16.replace(ref_params={"w": jnp.array([3.0], jnp.bfloat16)})
  synced = state_lib.sync_reference(bf16, 0.5).ref_params["w"]
  assert synced.dtype == jnp.bfloat16 and float(synced[0]) == 2.0


def test_sync_reference_is_a_no_op_without_reference():
  state = _state({"w": jnp.array([1.0, 2.0])}, with_reference=False)
  assert state.ref_params is None
  assert state_lib.sync_reference(state, 0.5) is state


def test_float32_reference_is_its_own_buffer():
  # `update` donates params and reference together: they must never alias
  # (astype to the same dtype would), or XLA is handed one buffer twice.
  state = _state({"w": jnp.array([1.0, 2.0])}, with_reference=True, ref_dtype="float32")
  assert (state.ref_params["w"].unsafe_buffer_pointer()
          != state.params["w"].unsafe_buffer_pointer())
  state.params["w"].delete()
  np.testing.assert_array_equal(np.asarray(state.ref_params["w"]), [1.0, 2.0])
