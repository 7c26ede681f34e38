"""One registry mechanism (grpojax.registry) behind losses, advantage
estimators and tasks, with one duplicate rule."""

import dataclasses

import pytest

import grpojax
from grpojax import registry
from grpojax.core import advantages, losses
from grpojax.data import tasks


def test_get_names_contains_and_the_unknown_name_error():
  reg = registry.Registry("section.key")
  a, b = object(), object()
  assert reg.register("b", b) is b and reg.register("a", a) is a
  assert reg.get("a") is a and "a" in reg and "c" not in reg
  assert reg.names() == list(reg) == ["a", "b"] and len(reg) == 2
  with pytest.raises(ValueError, match=r"^section.key='c' is unknown; known: \['a', 'b'\]$"):
    reg.get("c")
  assert reg.pop("a") is a and reg.pop("a") is None and reg.names() == ["b"]


def test_same_object_again_is_a_no_op_another_raises_unless_override():
  reg = registry.Registry("section.key")
  first, second = object(), object()
  reg.register("x", first)
  reg.register("x", first)  # re-running a module's registrations is harmless
  with pytest.raises(ValueError, match=r"section.key='x' is already registered.*override=True"):
    reg.register("x", second)
  assert reg.get("x") is first
  assert reg.register("x", second, override=True) is second and reg.get("x") is second


def _loss_a(x, config):
  return -x.advantages * x.logps


def _loss_b(x, config):
  return x.advantages * x.logps


def test_losses_follow_the_rule():
  name = "test_registry_loss"
  try:
    grpojax.register_loss(name, aggregation="batch_token_mean")(_loss_a)
    grpojax.register_loss(name, aggregation="batch_token_mean")(_loss_a)  # no-op
    with pytest.raises(ValueError, match="already registered"):
      grpojax.register_loss(name, aggregation="batch_token_mean")(_loss_b)
    with pytest.raises(ValueError, match="already registered"):  # same fn, other aggregation
      grpojax.register_loss(name, aggregation="global_token_mean")(_loss_a)
    assert losses.get_loss(name).fn is _loss_a
    grpojax.register_loss(name, aggregation="global_token_mean", override=True)(_loss_b)
    assert losses.get_loss(name) == losses._Registered(_loss_b, "global_token_mean")
    with pytest.raises(ValueError, match="already registered"):  # a built-in, by accident
      grpojax.register_loss("dapo")(_loss_b)
  finally:
    losses.LOSSES.pop(name)


def test_advantage_estimators_follow_the_rule():
  name = "test_registry_estimator"
  fn = lambda rewards, group_size, **kw: rewards  # noqa: E731
  try:
    grpojax.register_advantage(name)(fn)
    grpojax.register_advantage(name)(fn)
    with pytest.raises(ValueError, match=r"advantage.estimator='test_registry_estimator' is "
                                         r"already registered"):
      grpojax.register_advantage(name)(lambda rewards, group_size, **kw: -rewards)
    assert advantages.get_advantage_fn(name) is fn
  finally:
    advantages.ESTIMATORS.pop(name)


def test_tasks_follow_the_rule():
  base = tasks.get_task("arithmetic")
  task = dataclasses.replace(base, name="test_registry_task")
  try:
    assert grpojax.data.register_task(task) is task
    grpojax.data.register_task(task)
    other = dataclasses.replace(task, reward_weights=(2.0,))
    with pytest.raises(ValueError, match=r"task.name='test_registry_task' is already registered"):
      grpojax.data.register_task(other)
    assert grpojax.data.register_task(other, override=True) is other
    assert tasks.get_task("test_registry_task") is other
  finally:
    tasks.TASKS.pop("test_registry_task")
