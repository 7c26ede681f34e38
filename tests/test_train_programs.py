"""The compiled programs themselves: the update never talks to the host, the rollout
does exactly once (the reward callback), and a state on a mesh does not retrace.

Host round trips inside jit show up in the lowered StableHLO as custom calls to a
Python callback (pure_callback, io_callback, jax.debug.*) or as send / recv /
infeed / outfeed ops; `float(x)` and friends cannot even trace.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

from grpojax import models
from grpojax.core import losses
from grpojax.parallel import mesh as mesh_lib
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import rollout as rollout_lib
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib
from grpojax.train import strategy as strategy_lib
from reward_helpers import decode_chars

G = 2
CALLBACK = re.compile(r"custom_call\s*@\"?(\w*callback\w*)")
HOST_IO = re.compile(r"stablehlo\.(send|recv|infeed|outfeed)\b")
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
  """Collects XLA compilations (their durations) while the block runs."""
  seen = []

  def listener(event, duration, **unused):
    if event == BACKEND_COMPILE_EVENT:
      seen.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def callbacks(hlo_text: str) -> list[str]:
  return CALLBACK.findall(hlo_text)


def ones(completions, **unused):
  return [1.0] * len(completions)


BATCH = {
    "prompt_tokens": jnp.array([[0, 5, 6], [7, 8, 9]], jnp.int32),
    "prompt_mask": jnp.array([[0, 1, 1], [1, 1, 1]], jnp.int32),
    "example_ids": jnp.array([0, 1], jnp.int32),
}


@pytest.fixture(scope="module")
def model():
  return models.build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def host():
  with HostRewards([ones], decode=decode_chars, lookup=lambda i: {"prompt": str(i)},
                   num_workers=0) as h:
    yield h


def _state(params, beta, tx=None):
  return state_lib.create_train_state(models.get_preset("tiny"), params, tx or optax.adam(1e-3),
                                      with_reference=beta > 0)


def _rollout_fn(host, beta, mesh=None):
  config = rollout_lib.RolloutConfig(group_size=G, max_new_tokens=4, sampling=SamplingParams(),
                                     eos_ids=(1,), pad_id=0, with_reference=beta > 0,
                                     with_old_logps=True)
  # The plain strategy's jitted program: (state, batch, rng) -> (Rollout, metrics).
  return strategy_lib.make("plain", config, host, num_prompts=2, mesh=mesh).program


def test_the_detector_sees_a_callback():
  def f(x):
    jax.debug.print("{}", x)
    return x * 2

  assert callbacks(jax.jit(f).lower(1.0).as_text()) != []
  assert callbacks(jax.jit(lambda x: x * 2).lower(1.0).as_text()) == []


@pytest.mark.parametrize("mesh_shape", [None, (1, 2, 1)])
def test_rollout_has_exactly_the_reward_callback(model, host, mesh_shape):
  mesh = None
  if mesh_shape:
    mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, mesh_shape)), devices=jax.devices()[:2])
  state = _state(model.param_dict(), beta=0.04)
  text = _rollout_fn(host, 0.04, mesh).lower(state, BATCH, jax.random.key(0)).as_text()
  # One host callback, even on a mesh (it sits once in the shard_map body).
  assert len(callbacks(text)) == 1, callbacks(text)
  assert not HOST_IO.search(text)


@pytest.mark.parametrize("loss_type,beta,minibatches", [("dapo", 0.0, 1), ("grpo", 0.04, 2)])
def test_update_has_no_host_callback(model, host, loss_type, beta, minibatches):
  state = _state(model.param_dict(), beta)
  rollout_fn = _rollout_fn(host, beta)
  # Abstract shapes only: the rollout is never run.
  rollout = jax.eval_shape(lambda *a: rollout_fn(*a)[0], state, BATCH, jax.random.key(0))
  assert (rollout.ref_logps is not None) == (beta > 0)
  text = step_lib.update.lower(state, rollout, jax.random.key(0),
                               loss_config=losses.LossConfig(loss_type=loss_type, beta=beta),
                               group_size=G, minibatches=minibatches).as_text()
  assert callbacks(text) == []
  assert not HOST_IO.search(text)


@pytest.mark.slow
def test_state_on_a_mesh_comes_back_as_it_went_in(model):
  """create_train_state puts the step counter and Adam's count on the params' mesh,
  where `update` returns them: the second update reuses the first's program."""
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, devices=jax.devices()[:2])
  state = _state(models.shard_model(model, mesh).param_dict(), beta=0.0)
  shardings = lambda s: [x.sharding for x in jax.tree.leaves(s)]  # noqa: E731
  assert all(isinstance(s, jax.sharding.NamedSharding) for s in shardings(state))
  rows = 2 * G
  rollout = step_lib.Rollout(
      prompt_tokens=jnp.ones((rows, 3), jnp.int32), prompt_mask=jnp.ones((rows, 3), jnp.int32),
      tokens=jnp.full((rows, 4), 7, jnp.int32), mask=jnp.ones((rows, 4), jnp.int32),
      advantages=jnp.array([1.0, -1.0, 0.5, -0.5]))
  rollout = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)),
                         rollout)
  before = [(x.sharding, x.ndim) for x in jax.tree.leaves(state)]
  kw = dict(loss_config=losses.LossConfig(), group_size=G)
  with count_compiles() as compiles:
    state, _ = step_lib.update(state, rollout, jax.random.key(0), **kw)
  assert compiles, "no compile seen: has JAX renamed the compile event?"
  for (was, ndim), now in zip(before, shardings(state), strict=True):
    assert now.is_equivalent_to(was, ndim), (was, now)
  # (Not jit's _cache_size: its C++ fast path also keys on how a sharding is
  # spelt, P(None, "fsdp") vs P(None, "fsdp", None), without compiling again.)
  with count_compiles() as compiles:
    state, _ = step_lib.update(state, rollout, jax.random.key(1), **kw)
  assert compiles == []
  assert int(state.step) == 2
