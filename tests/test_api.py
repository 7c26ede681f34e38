"""The Python API in TRL's shape (grpojax.GRPOTrainer, GRPOConfig): TRL's quick start
ports to it, it trains through the same config and wiring as the command line (the
same metrics for the same seed), and a run started in one resumes in the other."""

import copy
import json
import math
import os
import re
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import grpojax
from grpojax import config as config_lib
from grpojax import models
from grpojax.api import GRPOConfig, GRPOTrainer, reward_paths, write_datasets
from grpojax.data import get_task
from grpojax.models.tokenizers import CharTokenizer
from grpojax.rewards import resolve
from grpojax.train import wiring

import reward_helpers
from grpojax.run.settings import read as read_settings


trl_rewards = pytest.importorskip("trl.rewards")

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def _dataset(n: int, offset: int = 0) -> list[dict]:
  """Conversational rows, as TRL's quick start's dataset (a prompt and a solution)."""
  return [{"prompt": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": f"What is {i} + {i}?"}],
           "solution": str(2 * i)} for i in range(offset, offset + n)]


def _args(workdir, max_steps: int, **kw) -> GRPOConfig:
  # TRL's names; the tiny model's budget. constant: a run resumed with more steps keeps
  # the learning rate of the steps before (linear decays to the run's last step).
  return GRPOConfig(output_dir=str(workdir), max_steps=max_steps, per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=8, learning_rate=1e-3,
                    lr_scheduler_type="constant", logging_steps=1, seed=3,
                    report_to="none", **kw)


def _trainer(workdir, max_steps: int) -> GRPOTrainer:
  return GRPOTrainer(model="tiny",
                     reward_funcs=[trl_rewards.accuracy_reward, reward_helpers.trl_everything],
                     args=_args(workdir, max_steps), train_dataset=_dataset(16),
                     eval_dataset=_dataset(4, offset=50))


def _metrics(workdir) -> list[dict]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/"))
           and k != "step_time"} for r in rows if r["step"]]


def _cli(*args) -> subprocess.CompletedProcess:
  # From the tests' directory: reward_helpers imports there, as the user's own module would.
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "grpojax.main", *args], cwd=TESTS, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_trls_quick_start_trains_the_same_through_the_api_and_the_cli(tmp_path):
  trainer = _trainer(tmp_path / "api", 2)
  summary = trainer.train()
  assert summary["step"] == 2 and "eval/accuracy" in summary["end"]
  # As the command line does: plots at the end (and the summary table, printed).
  assert (tmp_path / "api" / "plots" / "summary.png").is_file()
  cfg = config_lib.from_json(str(tmp_path / "api" / "config.json"))
  assert cfg.task.name == "prompt" and cfg.rollout.prompts_per_step == 2
  assert cfg.rewards.functions == ("trl.rewards.accuracy_rewards:accuracy_reward,"
                                  "reward_helpers:trl_everything")  # where each is defined
  api = _metrics(tmp_path / "api")
  assert [r["step"] for r in api] == [1, 2]
  # The reward saw TRL's trainer_state (optimizer steps: one a generation here), logged.
  assert [r["progress"] for r in api] == [0.0, 0.5]
  assert all(r["rewards/trl_everything/mean"] > 0 for r in api)

  # The command line, from the config.py the run wrote: the same metrics, value for value
  # (one step of it here; the API then resumes this run and makes the second).
  proc = _cli("--config", str(tmp_path / "api" / "config.py"), "--workdir", str(tmp_path / "cli"),
              "--config.train.steps=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert _metrics(tmp_path / "cli") == api[:1]
  # Started on the command line, resumed from Python with the command line's config.
  cfg = config_lib.from_json(str(tmp_path / "cli" / "config.json"))
  cfg.train.steps = 2
  assert GRPOTrainer(args=cfg, output_dir=str(tmp_path / "cli")).train()["step"] == 2
  assert _metrics(tmp_path / "cli") == api
  # ... and the reverse: started from Python, resumed by the command line.
  proc = _cli("--config", str(tmp_path / "api" / "config.py"), "--workdir", str(tmp_path / "api"),
              "--config.train.steps=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step 2 of 3" in proc.stderr
  assert [r["step"] for r in _metrics(tmp_path / "api")] == [1, 2, 3]

  # The trained policy is reachable: in memory, and as an HF directory.
  out = trainer.save_model(str(tmp_path / "export"))
  loaded = models.from_pretrained(out, dtype="float32")
  for name, value in trainer.state.params.items():
    assert (loaded.param_dict()[name] == value).all(), name
  tokens = CharTokenizer().encode("What is 2 + 2?")
  assert trainer.model(jax_array(tokens)).shape == (1, len(tokens), trainer.state.model_config.vocab_size)


def jax_array(tokens):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return jnp.asarray([tokens], jnp.int32)


def test_trls_batch_arguments_become_grpojax_keys():
  # TRL on one process: a generation of 8 x 2 completions is 4 prompts of 4, trained in
  # 2 minibatches of 8, both to one optimizer step, twice (num_iterations): 2 optimizer
  # steps a generation, so max_steps=12 is 6 rollouts.
  cfg = GRPOConfig(per_device_train_batch_size=8, num_generations=4,
                   gradient_accumulation_steps=2, num_iterations=2, max_steps=12,
                   logging_steps=4, save_steps=6, warmup_steps=0.25,
                   lr_scheduler_type="cosine", report_to=["tensorboard"], scale_rewards=False,
                   reward_weights=[1.0, 0.5], epsilon=0.1, epsilon_high=0.3, beta=0.04,
                   bf16=True, config={"rollout": {"engine": "paged"}}).to_config()
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (4, 4)
  assert (cfg.train.minibatches, cfg.optim.grad_accum_steps, cfg.train.num_iterations) == (2, 2, 2)
  # (read as a run would, with the data and the two reward functions the trainer adds)
  run = read_settings(config_lib.apply(copy.deepcopy(cfg), {
      "task.dataset": "owner/data", "rewards.functions": "m:one,m:two"}))
  assert run.updates_per_step == 2 and cfg.train.steps == 6
  assert (cfg.train.log_every, cfg.train.save_every) == (2, 3)
  assert (cfg.optim.schedule, cfg.optim.warmup_steps) == ("cosine", 3)  # ceil(0.25 x 12)
  assert (cfg.train.loggers, cfg.advantage.scale) == ("tensorboard", "none")
  assert tuple(cfg.rewards.weights) == (1.0, 0.5)
  assert (cfg.loss.epsilon_low, cfg.loss.epsilon_high, cfg.loss.beta) == (0.1, 0.3, 0.04)
  assert (cfg.model.dtype, cfg.rollout.engine) == ("bfloat16", "paged")
  # TRL's defaults where nothing is given: one prompt of 8 a step, 3 epochs.
  cfg = GRPOConfig().to_config(train_rows=10)
  assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.train.steps) == (1, 8, 30)
  assert (cfg.optim.schedule, cfg.rollout.max_completion_length, cfg.train.seed) == ("linear", 512, 42)
  assert GRPOConfig(num_train_epochs=0.5, per_device_train_batch_size=16,
                    num_generations=4).to_config(train_rows=10).train.steps == math.ceil(0.5 * 2)


@pytest.mark.parametrize("kwargs,words", [
    (dict(per_device_train_batch_size=6, num_generations=4), "whole groups of num_generations=4"),
    (dict(max_steps=5, num_iterations=2), "multiple of the 2 optimizer steps"),
    (dict(use_vllm=True), "its own engine"),
    (dict(lr_scheduler_type="polynomial"), "known: ['linear'"),
    (dict(steps_per_generation=2, gradient_accumulation_steps=3), "must divide steps_per_generation"),
    (dict(config={"rollout.group_sise": 4}), "unknown key 'rollout.group_sise'"),
])
def test_a_trl_argument_grpojax_cannot_honour_is_one_line(kwargs, words):
  with pytest.raises(config_lib.ConfigError) as e:
    GRPOConfig(**{"max_steps": 4, **kwargs}).to_config()
  assert words in str(e.value) and "\n" not in str(e.value)


def _lambda_free(prompts, completions, **kw):
  return [0.0] * len(completions)


class _Scorer:
  def __call__(self, completions, **kw):
    return [1.0] * len(completions)


SCORER = _Scorer()


def test_reward_functions_are_named_by_import_path_or_found_in_process(tmp_path):
  inline = lambda completions, **kw: [0.5] * len(completions)  # noqa: E731
  paths = reward_paths([_lambda_free, SCORER, "trl.rewards:think_format_reward", inline])
  assert paths[:3] == ["test_api:_lambda_free", "test_api:SCORER",
                       "trl.rewards:think_format_reward"]
  assert paths[3].startswith("__main__:")  # none imports a lambda: this process only
  cfg = config_lib.get_config()
  cfg.rewards.functions = ",".join(paths)
  assert resolve.reward_functions(read_settings(cfg).rewards.functions) == (
      _lambda_free, SCORER, trl_rewards.think_format_reward, inline)
  # Another process (the command line) cannot have it, and says what to do.
  cfg.rewards.functions = "__main__:not_here"
  with pytest.raises(config_lib.ConfigError, match="move it to a module"):
    resolve.reward_functions(read_settings(cfg).rewards.functions)
  with pytest.raises(config_lib.ConfigError, match="nor, given to GRPOTrainer, a reward model"):
    reward_paths("Qwen/Qwen2.5-0.5B-Reward")


def test_trainer_arguments_are_checked_in_one_line(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="neither a directory, a Hub id"):
    GRPOTrainer(model="no such model", reward_funcs=_lambda_free, train_dataset=_dataset(4))
  with pytest.raises(config_lib.ConfigError, match="none of GRPOConfig"):
    GRPOTrainer(model="tiny", reward_funcs=_lambda_free, args=3)
  with pytest.raises(config_lib.ConfigError, match="is empty"):
    GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=[],
                args=_args(tmp_path, 2))
  # A dict of grpojax keys over its own defaults (not TRL's); the output_dir given apart.
  t = GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                  args={"rollout": {"group_size": 4}, "train.steps": 2},
                  output_dir=str(tmp_path / "w"))
  assert (t.config.rollout.group_size, t.config.rollout.prompts_per_step) == (4, 8)
  assert t.workdir == str(tmp_path / "w") and t.config.task.name == "prompt"
  assert t.config.eval.num_prompts == 0  # no eval_dataset: no eval, as TRL
  with open(os.path.join(t.config.task.dataset, "train.jsonl")) as f:
    assert [json.loads(line) for line in f] == _dataset(8)


def test_the_same_rows_give_the_same_data_directory(tmp_path):
  a = GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                  args=_args(tmp_path, 2))
  b = GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                  args=_args(tmp_path, 2))
  c = GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8, 1),
                  args=_args(tmp_path, 2))
  assert a.config.task.dataset == b.config.task.dataset != c.config.task.dataset
  assert grpojax.GRPOTrainer is GRPOTrainer and grpojax.GRPOConfig is GRPOConfig


@pytest.mark.parametrize("longest,bucket", [(1, 16), (16, 16), (17, 32), (100, 128),
                                            (256, 256), (257, 512), (600, 768)])
def test_prompt_buckets(longest, bucket):
  assert wiring.prompt_bucket(longest) == bucket


def test_auto_prompt_length_keeps_every_prompt_of_the_data():
  # The chat prompts the default 128 used to filter (the trial): auto holds them.
  cfg = config_lib.get_config()
  cfg.task.name, cfg.task.dataset = "prompt", "owner/chats"
  cfg.rewards.functions = "trl.rewards:think_format_reward"
  given = read_settings(cfg)
  rows = _dataset(3) + [{"prompt": [{"role": "user", "content": "x" * 300}], "solution": "1"}]
  tok = CharTokenizer()
  resolved = wiring.with_prompt_length(given, get_task("prompt"), tok, [rows[:3], rows[3:]])
  longest = len(tok.encode(tok.apply_chat_template(rows[3]["prompt"])))
  assert longest >= 300 and resolved.rollout.max_prompt_length == wiring.prompt_bucket(longest)
  assert given.rollout.max_prompt_length == "auto"  # the settings as read stay as given
  assert resolved.source["rollout"]["max_prompt_length"] == "auto"  # config.json's value
  cfg.rollout.max_prompt_length = 64
  fixed = read_settings(cfg)
  assert wiring.with_prompt_length(fixed, get_task("prompt"), tok, [rows]) is fixed


def _short(completions, **kw):
  return [1.0] * (len(completions) - 1)


def _raises(completions, answer, **kw):
  return [float(a) for a in answer]


def _counts(completions, log_metric, **kw):
  log_metric("probed", 1.0)
  return [0.0] * len(completions)


@pytest.mark.parametrize("fn,words", [
    (_short, "reward function '_short' returned 0 values for 1 completions"),
    (_raises, "reward function '_raises' failed on 2 of 2 completions: TypeError"),
])
def test_the_opt_in_start_up_check_names_a_broken_reward_in_one_line(fn, words):
  from grpojax.rewards.base import RewardFunctionError  # pylint: disable=import-outside-toplevel
  from grpojax.rewards.runtime.host import HostRewards  # pylint: disable=import-outside-toplevel

  rows = [{"prompt": "1+1=", "answer": None}, {"prompt": "2+2=", "answer": None}]
  with HostRewards([_counts, fn], decode=lambda r: ["" for _ in r], lookup=rows.__getitem__) as host:
    with pytest.raises(RewardFunctionError) as e:
      host.probe([0, 1])
    assert str(e.value).startswith("rewards.check_at_start: ") and words in str(e.value)
    assert "\n" not in str(e.value)
    # What the probe's calls logged does not reach the first step's metrics.
    assert host.take_logged_metrics() == {} and host.recent == []


def test_trls_peft_config_becomes_the_lora_keys(tmp_path):
  peft = pytest.importorskip("peft")
  t = GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                  args=_args(tmp_path, 2, config={"model.lora.quantize": "nf4"}),
                  peft_config=peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                              target_modules=["q_proj", "v_proj"]))
  lora = read_settings(t.config).model.lora
  assert (lora.rank, lora.scale, lora.weights, lora.quantize) == (8, 2.0, ("wq", "wv"), "nf4")
  with pytest.raises(config_lib.ConfigError, match="lora_dropout=0.05"):
    GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                args=_args(tmp_path, 2), peft_config=peft.LoraConfig(r=8, lora_dropout=0.05))
  with pytest.raises(config_lib.ConfigError, match="use_dora"):
    GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                args=_args(tmp_path, 2), peft_config={"r": 4, "use_dora": True})


# Issue 49: the API's data and its in-process reward functions.
def _tree(root) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, files in os.walk(root) for f in files)


@pytest.mark.parametrize("eval_dataset,words", [
    ({"main": _dataset(2), "train": _dataset(2)}, "over train.jsonl, the train rows"),
    ({"main": _dataset(2), "Train": _dataset(2)}, "over train.jsonl"),  # one file on macOS
    ({"main": _dataset(2), "test": _dataset(2)}, "over test.jsonl, the first eval set"),
    ({"main": _dataset(2), "hard": _dataset(2), "HARD": _dataset(2)}, "over eval set 'hard'"),
    ({"main": _dataset(2), "../../x": _dataset(2)}, "must be a letter then"),
    ({"main": _dataset(2), "a/b": _dataset(2)}, "must be a letter then"),
    ({"main": _dataset(2), "..": _dataset(2)}, "must be a letter then"),
    ({"main": _dataset(2), "x.jsonl": _dataset(2)}, "must be a letter then"),
    ({"main": _dataset(2), "": _dataset(2)}, "must be a letter then"),
    ({"main": _dataset(2), 3: _dataset(2)}, "must be a letter then"),
    ({"main": _dataset(2), "accuracy": _dataset(2)}, "not 'accuracy'"),
])
def test_eval_set_names_are_checked_before_anything_is_written(tmp_path, eval_dataset, words):
  workdir = tmp_path / "a" / "b" / "w"  # "../../x" would land in tmp_path / "a" / "x"
  with pytest.raises(config_lib.ConfigError, match=re.escape(words)):
    GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                eval_dataset=eval_dataset, args=_args(workdir, 2))
  assert _tree(tmp_path) == []


def test_a_refused_config_writes_no_data(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="rollout.temperature"):
    GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                eval_dataset=_dataset(2),
                args=_args(tmp_path / "w", 2, config={"rollout.temperature": -1.0}))
  for rows, words in [([{"prompt": "p", "answer": (1, 2)}], "column 'answer' is a tuple"),
                      ([{"prompt": "p", "answer": {1: "a"}}], "the key 1 (int)"),
                      ([{"prompt": "p", "answer": {1, 2}}], "is a set")]:
    with pytest.raises(config_lib.ConfigError, match=re.escape(words)):
      GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=rows * 8,
                  args=_args(tmp_path / "w", 2))
  assert _tree(tmp_path) == []
  # A valid one then writes: the rows, the marker that they are exact, nothing else.
  t = GRPOTrainer(model="tiny", reward_funcs=_lambda_free, train_dataset=_dataset(8),
                  eval_dataset={"main": _dataset(2), "hard": _dataset(3)},
                  args=_args(tmp_path / "w", 2))
  assert sorted(os.listdir(t.config.task.dataset)) == ["ROWS_ARE_EXACT", "hard.jsonl",
                                                        "test.jsonl", "train.jsonl"]


BIG = 12345678901234567890  # past int64 (Arrow would make it a float)


def _exact_rows() -> list[dict]:
  return [{"prompt": f"{i} + 0 = ", "answer": BIG + i, "small": -2**70, "ratio": 0.1 * i,
           "nested": [[i, {"k": None}], [1.5, True]], "maybe": None if i % 2 else i,
           "flag": i % 2 == 0} for i in range(8)]


def right_answer(completions, answer, **kw):
  return [float(c == str(a) and type(a) is int) for c, a in zip(completions, answer)]


def test_rows_round_trip_exactly_and_a_reward_sees_the_exact_int(tmp_path):
  from grpojax.rewards.runtime.host import HostRewards  # pylint: disable=import-outside-toplevel

  rows, held_out = _exact_rows(), _exact_rows()[:3]
  t = GRPOTrainer(model="tiny", reward_funcs=right_answer, train_dataset=rows,
                  eval_dataset={"main": held_out, "hard": held_out[:2]},
                  args=_args(tmp_path, 2))
  task = get_task(t.config.task.name)
  train, evals = wiring.run_rows(read_settings(t.config), task)
  # repr: the types too (1 is not 1.0, True is not 1), and NaN-free rows compare exactly.
  assert repr(train) == repr(rows)
  assert [(name, repr(r)) for name, r in evals] == [("", repr(held_out)),
                                                    ("hard", repr(held_out[:2]))]
  # A slice of the split, as datasets would cut it.
  cfg = copy.deepcopy(t.config)
  cfg.task.train_split = "train[2:5]"
  assert repr(wiring.run_rows(read_settings(cfg), task)[0]) == repr(rows[2:5])
  # The reward function gets the int itself: the right answer scores 1.
  completions = [str(BIG + i) for i in range(8)]
  with HostRewards([right_answer], decode=lambda ids: [completions[i[0]] for i in ids],
                   lookup=train.__getitem__, num_workers=0) as host:
    out = host.compute(np.arange(8), np.arange(8)[:, None])
  assert out.rewards[:, 0].tolist() == [1.0] * 8


def test_several_processes_may_write_one_data_directory(tmp_path, monkeypatch):
  """The hosts of a job on shared storage each write the same rows at once: each
  writer's own temporary file, so none replaces another's half-written one."""
  from grpojax.data import rows as rows_lib  # pylint: disable=import-outside-toplevel

  real_replace, both = os.replace, threading.Barrier(2, timeout=30)

  def replace_together(src, dst):  # both writers have written before either moves
    both.wait()
    real_replace(src, dst)

  monkeypatch.setattr(rows_lib.os, "replace", replace_together)
  failures, out = [], []

  def write():
    try:
      out.append(write_datasets(str(tmp_path), _dataset(8), [("", _dataset(2))]))
    except Exception as e:  # noqa: BLE001 - what the other process would crash with
      failures.append(e)

  writers = [threading.Thread(target=write) for _ in range(2)]
  for w in writers:
    w.start()
  for w in writers:
    w.join(60)
  assert failures == [] and len(out) == 2 and out[0] == out[1]
  assert sorted(os.listdir(out[0])) == ["ROWS_ARE_EXACT", "test.jsonl", "train.jsonl"]
  with open(os.path.join(out[0], "train.jsonl")) as f:
    assert [json.loads(line) for line in f] == _dataset(8)


def test_each_trainer_runs_its_own_in_process_functions(tmp_path, monkeypatch):
  """Two trainers of one process, each with a lambda (both named "__main__:lambda"):
  each trainer's run calls its own."""
  from grpojax.train import loop  # pylint: disable=import-outside-toplevel

  # The run's setup, up to where it looks the reward functions up (wiring.run_rewards).
  def setup(cfg, workdir):
    task = wiring.run_task(read_settings(cfg))
    fns, _ = wiring.run_rewards(read_settings(cfg), task)
    return types.SimpleNamespace(tokenizer=None, export={}, state=None, fns=fns)

  monkeypatch.setattr(loop, "setup", setup)
  # (A preempted run's summary: no end-of-run plots and table to make.)
  monkeypatch.setattr(loop, "run", lambda job: {"fns": job.fns, "preempted": True})
  a_fn = lambda completions, **kw: [0.25] * len(completions)  # noqa: E731
  b_fn = lambda completions, **kw: [0.75] * len(completions)  # noqa: E731
  a = GRPOTrainer(model="tiny", reward_funcs=[a_fn], train_dataset=_dataset(8),
                  args=_args(tmp_path / "a", 2))
  b = GRPOTrainer(model="tiny", reward_funcs=[b_fn], train_dataset=_dataset(8),
                  args=_args(tmp_path / "b", 2))
  assert a.config.rewards.functions == b.config.rewards.functions == "__main__:lambda"
  assert a.train()["fns"] == (a_fn,) and b.train()["fns"] == (b_fn,)
  assert a.train()["fns"] == (a_fn,)  # again, after b's run
