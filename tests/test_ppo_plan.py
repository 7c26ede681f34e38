"""The planner's PPO: the critic and its optimizer state in the abstract train state the
programs compile against, counted by hand, and `--compare ppo`'s twin of a run."""

import math

import jax
import pytest

from grpojax import config as config_lib
from grpojax import default_experiment, plan
from grpojax.models import config as model_config_lib
from grpojax.models import transformer
from grpojax.parallel import mesh as mesh_lib
from grpojax.run.settings import read as read_settings


def _model_config(cfg):
  return model_config_lib.get_preset(cfg.model.arch, vocab_size=32)


def _grpo_and_ppo_states(cfg):
  """(the model config, GRPO's state bytes per device, the PPO twin's abstract state)."""
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  model_cfg = _model_config(cfg)
  grpo = plan.bytes_per_device(plan.abstract_state(read_settings(cfg), model_cfg, mesh))
  twin = plan.ppo_twin(cfg)
  config_lib.validate(twin)
  return model_cfg, grpo, plan.abstract_state(read_settings(twin), model_cfg, mesh)


def test_the_ppo_state_adds_the_critic_and_its_two_adam_moments_in_float32():
  model_cfg, grpo, state = _grpo_and_ppo_states(default_experiment.get_config("smoke"))
  specs = transformer.param_specs(model_cfg.replace(head="score", num_labels=1))
  critic = sum(math.prod(shape) for shape, _ in specs.values())
  # Parameters, Adam's mu and nu: three float32 copies of the critic.
  assert plan.bytes_per_device(state) - grpo == 3 * 4 * critic
  assert set(state.critic_params) == set(specs) and "lm_head" not in state.critic_params


def test_the_ppo_twin_draws_the_same_samples_per_step_one_per_prompt():
  cfg = default_experiment.get_config()
  cfg.loss.beta = 0.04
  twin = plan.ppo_twin(cfg)
  r, t = cfg.rollout, twin.rollout
  assert (t.group_size, t.prompts_per_step) == (1, r.prompts_per_step * r.group_size)
  assert twin.advantage.estimator == "gae" and twin.loss.kl_in_reward
  assert cfg.advantage.estimator == "grpo" and not cfg.loss.kl_in_reward  # a copy
  one = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  rollout = plan.abstract_rollout(read_settings(twin), one)
  N, T = t.prompts_per_step, t.max_completion_length
  assert rollout.advantages.shape == rollout.values.shape == rollout.returns.shape == (N, T)
  assert rollout.old_logps is not None  # the KL in the reward reads the rollout's log-probs


def test_the_grpo_vs_ppo_workload_plans_both_ways():
  from test_bench_suite import quick

  figures = quick("grpo_vs_ppo", "--part", "memory")["memory"]
  row = figures["rows"]["tiny@cpu"]
  assert row["grpo"]["fits"] and row["ppo"]["fits"]
  # The state grows by the critic and its two Adam moments, as counted above.
  from grpojax.train import wiring

  cfg = default_experiment.get_config("smoke")
  run = read_settings(cfg)
  model_cfg = wiring.model_config(run, wiring.run_tokenizer(run))  # the run's vocabulary
  critic = sum(math.prod(shape) for shape, _ in transformer.param_specs(
      model_cfg.replace(head="score", num_labels=1)).values())
  # Per device: the plan's mesh spans the session's devices, and fsdp shards the critic.
  per_device = 12 * critic / jax.device_count()
  grpo = row["grpo"]["state_GiB"] * 2**30
  assert row["ppo"]["state_GiB"] * 2**30 - grpo == pytest.approx(per_device, rel=0.02)
  assert row["ratios"]["state"] == pytest.approx((grpo + per_device) / grpo, rel=0.02)
  assert row["ratios"]["update"] > 1  # the critic's forward and backward, its gradients
  assert figures["largest"] == {"grpo@cpu": "tiny", "ppo@cpu": "tiny"}


def test_a_lora_ppo_state_adds_only_the_critics_adapters_head_and_moments():
  # With LoRA the critic shares the policy's frozen base: the twin's state grows by the
  # critic's adapters (the policy's rank and targets) and its head, three float32 copies.
  cfg = default_experiment.get_config("smoke")
  cfg.model.lora.rank, cfg.model.lora.targets = 4, "q,v,down"
  model_cfg, grpo, state = _grpo_and_ppo_states(cfg)
  L, D, r = model_cfg.num_layers, model_cfg.hidden_size, 4
  q = model_cfg.num_heads * model_cfg.head_dim
  v = model_cfg.num_kv_heads * model_cfg.head_dim
  F = model_cfg.intermediate_size
  adapters = L * r * ((D + q) + (D + v) + (F + D))  # A [r, in] and B [out, r] per layer
  assert plan.bytes_per_device(state) - grpo == 3 * 4 * (adapters + D)
  assert set(state.critic_params) == {"score"} | set(state.params)
  assert state.critic_config.lora_scale == state.model_config.lora_scale
