"""The rollout beside the update (parallel.rollout_devices, grpojax.train.beside) on the
fake CPU devices: each step trains on the rollout the weights before it drew, token
for token what a plain rollout on the rollout device alone draws with those weights;
the proximal and reference log-probs are the update's weights'; the rollout drawn
ahead survives a save and load; a run beside the update resumes exactly; bad
settings stop with one line."""

import json
import os
import sys
import threading

import jax
import numpy as np
import pytest

from grpojax import config as config_lib
from grpojax.parallel import mesh as mesh_lib
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import beside as beside_lib
from grpojax.train import loop
from grpojax.train import rollout as rollout_lib
from grpojax.train import state as state_lib
from grpojax.train import strategy as strategy_lib
from reward_helpers import decode_chars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import arithmetic_tiny  # noqa: E402
from test_carry import PROMPTS, B, G, T, digits, host, model  # noqa: E402, F401  (fixtures)
from test_carry import Batches as _Batches  # noqa: E402
from test_carry import SGD, _batch  # noqa: E402

SHAPE = dict(data=1, fsdp=-1, tensor=1)
ONE = dict(data=1, fsdp=1, tensor=1)


class Batches(_Batches):
  """Batch 0, 1, 2, ... in turn; rewind goes back `back` draws (a whole batch each)."""

  def __init__(self, served=0):
    self.served = served

  def rewind(self, back, used):
    assert used == 0
    self.served -= back


def _config(**kw):
  return rollout_lib.RolloutConfig(group_size=G, max_new_tokens=T,
                                   sampling=SamplingParams(temperature=1.0), eos_ids=(1,),
                                   pad_id=0, **kw)


def _states(model, mesh):
  """Versions 0, 1, 2 of a policy on `mesh`: each a step of SGD away from the last."""
  state = state_lib.create_train_state(model.config, model.param_dict(), SGD,
                                       with_reference=True)
  state = jax.device_put(state, mesh_lib.replicated(mesh))
  out = [state]
  for i in range(2):
    noise = {k: 0.05 * jax.random.normal(jax.random.key(i), v.shape, v.dtype)
             for k, v in state.params.items()}
    state = state.replace(step=state.step + 1,
                          params={k: v + noise[k] for k, v in state.params.items()})
    out.append(state)
  return out


def _on(state, mesh):
  return jax.device_put(state, mesh_lib.replicated(mesh))


def _devices_of(tree):
  return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def test_each_step_trains_on_what_the_weights_before_it_drew(model, host):
  """Step i's rollout is a plain rollout drawn on the rollout device by version i - 1
  (step 0's by version 0, on the spot), with the key fold_in(step i - 1's key, 1); its
  old and reference log-probs are version i's and the reference's, on the update's
  devices."""
  mesh, rollout_mesh = beside_lib.split_meshes(SHAPE, ONE, 1)
  alone = mesh_lib.make_mesh(ONE, rollout_mesh.devices.flat)  # the rollout device, as a run's
  config = _config(with_old_logps=True, with_reference=True)
  beside = beside_lib.make_beside("plain", config, host, num_prompts=B, mesh=mesh,
                                  rollout_mesh=rollout_mesh)
  plain = strategy_lib.make("plain", _config(), host, num_prompts=B, mesh=alone)
  states, source = _states(model, mesh), Batches()
  keys = [jax.random.key(10 + i) for i in range(3)]
  drawn = [(0, keys[0]), (0, jax.random.fold_in(keys[0], 1)), (1, jax.random.fold_in(keys[1], 1))]
  for step in range(3):
    rollout, metrics = beside(states[step], source, keys[step])
    version, key = drawn[step]
    want, _ = plain(_on(states[version], alone), _on(_batch(step), alone), key)
    np.testing.assert_array_equal(rollout.tokens, want.tokens)
    np.testing.assert_array_equal(rollout.mask, want.mask)
    np.testing.assert_allclose(rollout.sampler_logps, want.sampler_logps, atol=1e-6)
    np.testing.assert_allclose(rollout.advantages, want.advantages, atol=1e-6)
    assert float(metrics["beside/on_policy"]) == (step == 0)
    # Proximal and reference log-probs: this step's weights and the reference, worked
    # by the unchunked forward.
    for logps, (cfg, params) in ((rollout.old_logps, (model.config, states[step].params)),
                                 (rollout.ref_logps, states[step].reference())):
      np.testing.assert_allclose(logps * rollout.mask, rollout_lib.completion_logps(
          cfg, params, rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens,
          rollout.mask) * rollout.mask, atol=2e-5)
    assert _devices_of(rollout) == set(mesh.devices.flat)
  assert source.served == 4  # three steps' batches and the next step's, drawn ahead
  assert not set(mesh.devices.flat) & set(rollout_mesh.devices.flat)


def test_the_rollout_drawn_ahead_survives_a_save_and_load(model, host):
  mesh, rollout_mesh = beside_lib.split_meshes(SHAPE, dict(data=1, fsdp=1, tensor=-1), 2)
  make = lambda: beside_lib.make_beside(  # noqa: E731
      "carried", _config(max_staleness=2, with_old_logps=True), host, num_prompts=B,
      mesh=mesh, rollout_mesh=rollout_mesh)
  states, keys = _states(model, mesh), [jax.random.key(20 + i) for i in range(3)]
  straight, source = make(), Batches()
  for step in range(2):
    straight(states[step], source, keys[step])
  saved = {k: np.array(v) for k, v in straight.state_dict().items()}
  assert any(k.startswith("pending.") for k in saved) and any(k.startswith("inner.")
                                                              for k in saved)
  resumed = make()
  resumed.load_state_dict(saved)
  want, want_metrics = straight(states[2], source, keys[2])
  got, got_metrics = resumed(states[2], Batches(served=source.served - 1), keys[2])
  for name in ("tokens", "mask", "advantages", "sampler_logps", "old_logps", "loss_mask"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  assert got_metrics.keys() == want_metrics.keys()
  for k in want_metrics:
    np.testing.assert_allclose(float(got_metrics[k]), float(want_metrics[k]), err_msg=k)
  # And the next rollouts, drawn by the inner strategy restored with it, agree too.
  np.testing.assert_array_equal(straight(states[2], Batches(9), keys[0])[0].tokens,
                                resumed(states[2], Batches(9), keys[0])[0].tokens)


def test_a_cut_rollout_drawn_ahead_gives_its_prompts_back(model, monkeypatch):
  from grpojax.rewards.runtime import inprocess
  monkeypatch.setattr(inprocess, "INTERRUPT_GRACE_S", 0.0)  # calls after interrupt() are cut
  mesh, rollout_mesh = beside_lib.split_meshes(SHAPE, ONE, 1)
  states, source = _states(model, mesh), Batches()
  hang = threading.Event()  # set: the reward hangs (until the test ends), as a slow one would

  def digits_or_hang(completions, **unused):
    if hang.is_set():
      threading.Event().wait(5.0)
    return digits(completions)

  with HostRewards([digits_or_hang], decode=decode_chars, lookup=lambda i: {"prompt": str(i)},
                   num_workers=0) as cut:
    beside = beside_lib.make_beside("plain", _config(), cut, num_prompts=B, mesh=mesh,
                                    rollout_mesh=rollout_mesh)
    beside(states[0], source, jax.random.key(0))
    assert beside.state_dict()  # whole: kept
    hang.set()
    cut.interrupt()  # SIGTERM: the rollout drawn ahead next has its rewards cut short
    beside(states[1], source, jax.random.key(1))
    assert source.served == 3
    # state_dict waits for the rollout drawn ahead (it may still be running), then
    # finds its rewards cut short.
    assert beside.state_dict() == {} and cut.interrupted
  assert source.served == 2  # its batch is served again after the resume


def test_undo_of_a_first_step_puts_back_both_rollouts(model, host):
  """The first call draws two rollouts (its own, on the spot, and the next): undone,
  the carried rows are those from before either."""
  mesh, rollout_mesh = beside_lib.split_meshes(SHAPE, ONE, 1)
  beside = beside_lib.make_beside("carried", _config(max_staleness=2), host, num_prompts=B,
                                  mesh=mesh, rollout_mesh=rollout_mesh)
  beside(_states(model, mesh)[0], Batches(), jax.random.key(0))
  assert beside.state_dict()  # rows carried, a rollout drawn ahead
  beside.undo()
  assert beside.state_dict() == {}


def test_bad_settings_stop_with_one_line():
  with pytest.raises(ValueError, match="at least one device for the rollout and one"):
    beside_lib.split_meshes(SHAPE, ONE, len(jax.devices()))
  with pytest.raises(ValueError, match="not 'streaming'"):
    beside_lib.make_beside("streaming", _config(), None, num_prompts=B, mesh=None,
                           rollout_mesh=None)
  cfg = arithmetic_tiny.get_config("smoke")
  for key, value, why in (("parallel.rollout_devices", -1, ">= 0"),
                          ("parallel.rollout_shape", {"data": 1, "tensor": -1},
                           "exactly the axes")):
    bad = config_lib.apply(arithmetic_tiny.get_config("smoke"), {key: value})
    with pytest.raises(config_lib.ConfigError, match=why):
      config_lib.validate(bad)
  bad = config_lib.apply(cfg, {"parallel.rollout_devices": 2, "rollout.dynamic_sampling": True})
  with pytest.raises(config_lib.ConfigError, match="dynamic sampling"):
    config_lib.validate(bad)


def _read(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in m.items() if not k.startswith(("time/", "step_time"))}
          for m in rows]


@pytest.mark.slow
def test_a_run_beside_the_update_resumes_exactly(tmp_path):
  """Carried rows decoded on two devices (tensor-parallel) beside the update on six: a
  run stopped at step 2 and resumed writes the metrics of one never stopped, and it
  learns (the length penalty gives the groups a spread)."""
  def config(steps):
    c = arithmetic_tiny.get_config("smoke")
    return config_lib.apply(c, {
        "train.steps": steps, "train.save_every": 2, "train.eval_every": 0, "sft.steps": 2,
        "eval.num_prompts": 0, "rollout.prompts_per_step": 4, "rollout.group_size": 4,
        "rollout.max_staleness": 2, "loss.decoupled": True, "rewards.overlong_buffer": 5,
        "parallel.rollout_devices": 2})

  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  loop.train(config(4), straight)
  assert loop.train(config(2), resumed)["step"] == 2
  assert loop.train(config(4), resumed)["step"] == 4
  a, b = _read(straight), _read(resumed)
  assert [m["step"] for m in a] == [0, 1, 2, 3, 4][-len(a):] and a == b
  trained = [m for m in a if "loss" in m]
  assert [m["beside/on_policy"] for m in trained] == [1.0, 0.0, 0.0, 0.0]
  assert any(m["loss"] != 0 for m in trained)  # the groups' rewards differ: it learns


def test_lower_gives_the_inner_program_on_the_rollout_devices(model, host):
  mesh, rollout_mesh = beside_lib.split_meshes(SHAPE, dict(data=1, fsdp=1, tensor=-1), 2)
  beside = beside_lib.make_beside("plain", _config(), host, num_prompts=B, mesh=mesh,
                                  rollout_mesh=rollout_mesh)
  state = jax.eval_shape(lambda s: s, _states(model, mesh)[0])
  lowered = beside.lower(state, jax.eval_shape(lambda: jax.random.key(0)),
                         prompt_length=len(PROMPTS[0]))
  compiled = lowered.compile()
  devices = {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set}
  assert devices == set(rollout_mesh.devices.flat)
