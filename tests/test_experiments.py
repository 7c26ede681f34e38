"""The experiments: each full config validates once its model is downloaded and
holds the hyperparameters its comments cite; each `:smoke` variant trains end
to end on CPU (one through the CLI, from another directory)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from grpojax import config as config_lib
from grpojax.data import tasks
from grpojax.train import loop, wiring
from grpojax.models.lora import LoraConfig
from grpojax.run.settings import read as read_settings


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")

# Per experiment: the model directory under ~/models, and the values its
# comments attribute to the literature (dotted config keys).
FULL = {
    "gsm8k_qwen2_5_0_5b": ("Qwen2.5-0.5B-Instruct", {
        "task.name": "gsm8k", "task.dataset": "openai/gsm8k:main", "rollout.group_size": 8,
        "loss.loss_type": "grpo", "loss.beta": 0.04, "loss.kl_estimator": "k3",
        "loss.epsilon_low": 0.2, "optim.learning_rate": 1e-6, "train.num_iterations": 1}),
    "gsm8k_gemma3_1b": ("gemma-3-1b-it", {
        "task.name": "gsm8k", "task.dataset": "openai/gsm8k:main", "rollout.group_size": 8,
        "loss.loss_type": "grpo", "loss.beta": 0.04, "loss.kl_estimator": "k3",
        "loss.epsilon_low": 0.2, "optim.learning_rate": 1e-6, "train.num_iterations": 1}),
    "math_qwen2_5_1_5b": ("Qwen2.5-Math-1.5B", {
        "task.name": "math", "task.dataset": "nlile/hendrycks-MATH-benchmark",
        "task.train_split": "train", "task.eval_split": "test", "rollout.group_size": 8,
        "rollout.temperature": 1.0, "advantage.estimator": "dr_grpo",
        "loss.loss_type": "dr_grpo", "loss.beta": 0.0, "optim.learning_rate": 1e-6}),
    "math_qwen2_5_0_5b_4k": ("Qwen2.5-0.5B-Instruct", {
        "task.name": "math", "task.dataset": "nlile/hendrycks-MATH-benchmark",
        "rollout.max_completion_length": 4096, "rollout.temperature": 1.0,
        "advantage.estimator": "dr_grpo", "loss.loss_type": "dr_grpo", "loss.beta": 0.0,
        "loss.mask_truncated_completions": True, "optim.learning_rate": 1e-6}),
    "countdown_qwen2_5_3b": ("Qwen2.5-3B", {
        "task.name": "countdown", "task.dataset": "Jiayi-Pan/Countdown-Tasks-3to4",
        "task.train_split": "train[:327680]", "task.eval_split": "train[327680:328704]",
        "rollout.max_prompt_length": 256, "rollout.max_completion_length": 1024,
        "loss.beta": 0.001, "loss.kl_estimator": "k3", "optim.learning_rate": 1e-6,
        "eval.num_prompts": 1024}),
    "code_qwen2_5_coder": ("Qwen2.5-Coder-1.5B-Instruct", {
        "task.name": "code", "task.dataset": "google-research-datasets/mbpp",
        "rollout.group_size": 16, "loss.loss_type": "dapo", "loss.epsilon_low": 0.2,
        "loss.epsilon_high": 0.28, "loss.beta": 0.0, "optim.learning_rate": 1e-6,
        "optim.warmup_steps": 20, "optim.weight_decay": 0.1, "train.minibatches": 16,
        "rollout.dynamic_sampling": True}),
    "math_tools_qwen2_5_1_5b": ("Qwen2.5-1.5B-Instruct", {
        "task.name": "math", "rollout.tools": "grpojax.tools:PythonTool",
        "rollout.max_tool_calling_iterations": 4, "loss.loss_type": "dr_grpo",
        "loss.beta": 0.0}),
    # LoRA Without Regret: LoRA's best learning rate is ~10x full fine-tuning's.
    "gsm8k_qwen2_5_3b_lora": ("Qwen2.5-3B-Instruct", {
        "task.name": "gsm8k", "task.dataset": "openai/gsm8k:main", "rollout.group_size": 8,
        "rollout.max_completion_length": 2048, "loss.loss_type": "grpo", "loss.beta": 0.04,
        "loss.kl_estimator": "k3", "optim.learning_rate": 1e-5, "train.num_iterations": 1}),
    "gsm8k_qwen2_5_7b_qlora": ("Qwen2.5-7B-Instruct", {
        "task.name": "gsm8k", "task.dataset": "openai/gsm8k:main", "rollout.group_size": 8,
        "rollout.max_completion_length": 2048, "loss.loss_type": "grpo", "loss.beta": 0.04,
        "loss.kl_estimator": "k3", "optim.learning_rate": 1e-5, "train.num_iterations": 1}),
}
# The LoRA experiments' adapters (model.lora.*) and the base they freeze.
LORA = {"gsm8k_qwen2_5_3b_lora": "none", "gsm8k_qwen2_5_7b_qlora": "nf4"}
NAMES = sorted(FULL)


# Optimizer updates per rollout, as cited: DeepSeekMath makes one; Dr. GRPO
# (128-sample minibatches of 256 here) and TinyZero (half the batch) two; DAPO 16.
UPDATES_PER_ROLLOUT = {"gsm8k_qwen2_5_0_5b": 1, "gsm8k_gemma3_1b": 1, "math_qwen2_5_1_5b": 2, "math_qwen2_5_0_5b_4k": 2,
                       "countdown_qwen2_5_3b": 2, "code_qwen2_5_coder": 16,
                       "gsm8k_qwen2_5_3b_lora": 1, "gsm8k_qwen2_5_7b_qlora": 1,
                       "math_tools_qwen2_5_1_5b": 2}

# A right completion per smoke row of countdown, which has no reference column.
COUNTDOWN_SOLUTIONS = ["2 + 3 * 4", "5 * 6 + 7", "10 / 2 + 3", "4 * 5 + 6 - 1", "8 * 3 - 2",
                       "9 + 7 + 2 - 1"]


def load(name):
  spec = importlib.util.spec_from_file_location(f"experiment_{name}",
                                                os.path.join(EXPERIMENTS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get(cfg, dotted):
  section, key = dotted.split(".")
  return cfg[section][key]


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", NAMES)
def test_full_config_validates_once_the_model_is_downloaded(name, tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))  # the default model dir is ~/models/<model>
  model_dir, cited = FULL[name]
  cfg = load(name).get_config()
  assert cfg.model.path == str(tmp_path / "models" / model_dir)
  with pytest.raises(config_lib.ConfigError, match=r"model\.path=.* is not a directory"):
    config_lib.validate(cfg)
  os.makedirs(cfg.model.path)
  with pytest.raises(config_lib.ConfigError, match=r"model\.path=.* has no config\.json"):
    config_lib.validate(cfg)  # an empty directory is not a model
  with open(os.path.join(cfg.model.path, "config.json"), "w") as f:
    f.write("{}")
  config_lib.validate(cfg)
  assert {k: get(cfg, k) for k in cited} == cited
  assert cfg.model.dtype == "bfloat16" and cfg.rollout.temperature == 1.0
  # Memory is the loop's to fit (plan.fit), not hand-set: no remat or micro-batches here.
  assert cfg.model.remat == cfg.train.micro_batches == cfg.train.memory_budget == "auto"


def test_code_scales_dapos_overlong_buffer_to_its_completion_length():
  cfg = load("code_qwen2_5_coder").get_config()
  # DAPO: the last 4,096 of 20,480 tokens are penalised.
  fraction = cfg.rewards.overlong_buffer / cfg.rollout.max_completion_length
  assert fraction == pytest.approx(4096 / 20480, abs=0.01)
  others = [n for n in NAMES if n != "code_qwen2_5_coder"]
  assert [load(n).get_config().rewards.overlong_buffer for n in others] == [0] * len(others)


@pytest.mark.parametrize("name", NAMES)
def test_updates_per_rollout(name):
  cfg = load(name).get_config()
  assert cfg.optim.grad_accum_steps == 1  # micro-batches, not optimizer accumulation, bound memory
  assert cfg.train.minibatches == UPDATES_PER_ROLLOUT[name]


def lora_of(cfg) -> LoraConfig:
  """model.lora's adapters (the full experiments' model.path is not on this machine,
  so the whole config would not read here)."""
  return LoraConfig(**{k: v for k, v in cfg.model.lora.items() if k != "export_merged"})


@pytest.mark.parametrize("name", sorted(LORA))
def test_lora_experiments_train_adapters_over_a_frozen_base(name):
  for variant in (None, "smoke"):
    lora = lora_of(load(name).get_config(variant))
    assert lora.enabled and lora.quantize == LORA[name]
    assert set(lora.weights) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
  config_lib.validate(load(name).get_config("smoke"))
  cfg = load(name).get_config()
  assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (16, 32.0)
  assert cfg.train.ref_sync_every == 0  # the reference is the base, adapters off


def test_qlora_7b_has_a_v5e_variant_at_half_the_length():
  module = load("gsm8k_qwen2_5_7b_qlora")
  full, v5e = module.get_config(), module.get_config("v5e")
  assert (full.rollout.max_completion_length, v5e.rollout.max_completion_length) == (2048, 1024)
  assert config_lib.dotted(v5e.to_dict()) == dict(
      config_lib.dotted(full.to_dict()), **{"rollout.max_completion_length": 1024})


def test_gemma_on_one_v5e_is_the_recipe_through_lora():
  """Full fine-tuning of Gemma 3 1B does not fit a v5e chip (the experiment's plan):
  `:v5e` is the same recipe through rank-16 adapters on every projection at 10x the lr."""
  module = load("gsm8k_gemma3_1b")
  full, v5e = module.get_config(), module.get_config("v5e")
  assert not lora_of(full).enabled
  lora = lora_of(v5e)
  assert lora.rank == 16 and lora.quantize == "none"
  assert set(lora.weights) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
  assert v5e.optim.learning_rate == pytest.approx(10 * full.optim.learning_rate)
  v5e.model.lora, v5e.optim = full.model.lora, full.optim
  assert v5e.to_dict() == full.to_dict()


@pytest.mark.parametrize("name", NAMES)
def test_unknown_variant_raises(name):
  with pytest.raises(ValueError, match="unknown variant 'smok'"):
    load(name).get_config("smok")


@pytest.mark.parametrize("name", NAMES)
def test_smoke_rows_are_solved_by_their_reference(name):
  cfg = load(name).get_config("smoke")
  task = tasks.get_task(cfg.task.name)
  rows = tasks.load_rows(task, cfg.task.dataset, "train")  # a local file serves any split name
  train, held_out = (tasks.load_rows(task, cfg.task.dataset, s)
                     for s in wiring.splits(read_settings(cfg), task))
  if task.name == "countdown":  # disjoint slices of the file, as TinyZero's split of the dataset
    assert train + held_out == rows and len(train) == cfg.rollout.prompts_per_step
  else:
    assert train == held_out == rows
  assert len(held_out) >= cfg.eval.num_prompts
  if task.name == "countdown":
    references = [f"<think>...</think><answer>{s}</answer>" for s in COUNTDOWN_SOLUTIONS]
  else:
    references = [task.sft_target(row) for row in rows]
  assert len(rows) == len(references)
  assert [task.is_correct(ref, row) for ref, row in zip(references, rows)] == [True] * len(rows)
  assert not any(task.is_correct("no answer here", row) for row in rows)


def _check_smoke_run(workdir, cfg):
  metrics = read_metrics(workdir)
  assert [m["step"] for m in metrics] == list(range(cfg.train.steps + 1))
  assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]
  reward_names = {fn.__name__ for fn in tasks.get_task(cfg.task.name).reward_fns}
  if cfg.rewards.overlong_buffer:
    reward_names.add("soft_overlong_penalty")
  for m in metrics[1:]:
    assert {f"rewards/{n}/mean" for n in reward_names} <= set(m)
    assert [m[f"rewards/{n}/errors"] for n in reward_names] == [0] * len(reward_names)
    if cfg.rewards.overlong_buffer:
      assert -1.0 <= m["rewards/soft_overlong_penalty/mean"] <= 0.0
    if cfg.rollout.dynamic_sampling:
      assert 1 <= m["dynamic_sampling/rounds"] <= cfg.rollout.dynamic_sampling_max_rounds
  # hf/: the model, or with LoRA the PEFT adapter directory.
  exported = "adapter_config.json" if cfg.model.lora.rank else "config.json"
  assert os.path.isfile(os.path.join(workdir, "hf", exported))


@pytest.mark.slow
def test_gsm8k_smoke_runs_through_the_cli_from_another_directory(tmp_path):
  config = os.path.join(EXPERIMENTS, "gsm8k_qwen2_5_0_5b.py")
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "grpojax.main", f"--config={config}:smoke", f"--workdir={workdir}"],
      capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _check_smoke_run(str(workdir), load("gsm8k_qwen2_5_0_5b").get_config("smoke"))
  assert "eval/accuracy (end)" in proc.stdout
  assert (workdir / "plots" / "summary.png").is_file()  # main.py plots the finished run


# Not the LoRA experiments: their smoke is the GSM8K one's with adapters, which
# tests/test_lora.py trains end to end (a QLoRA run with SFT and KL); each would add
# about a minute to the suite.
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n != "gsm8k_qwen2_5_0_5b" and n not in LORA])
def test_smoke_trains_in_process(name, tmp_path):
  cfg = load(name).get_config("smoke")
  summary = loop.train(cfg, str(tmp_path))
  assert summary["step"] == cfg.train.steps
  _check_smoke_run(str(tmp_path), cfg)
