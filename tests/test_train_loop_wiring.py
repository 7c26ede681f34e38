"""How the loop wires config options into the model, the data splits and the
rewards, checked without a training run (the experiments' smoke runs train
with remat, sliced splits and the overlong penalty on)."""

import os

import numpy as np
import optax
import pytest

from grpojax import config as config_lib
from grpojax import models
from grpojax.data import tasks
from grpojax.models.tokenizers import CharTokenizer
from grpojax.rewards.runtime.host import HostRewards
from grpojax.train import wiring
from grpojax.train import state as state_lib
from grpojax.run import assemble as assemble_lib
from reward_helpers import decode_chars
from grpojax.run.settings import read as read_settings


@pytest.mark.parametrize("remat", [False, True])
def test_model_remat_reaches_the_train_state_from_both_loaders(remat, tmp_path):
  cfg = config_lib.get_config()
  cfg.model.remat = remat
  run = read_settings(cfg)
  built = assemble_lib.load_model(run, wiring.model_config(run, CharTokenizer()), None)
  # config.json has no remat: the config sets it
  models.save_pretrained(models.Transformer(built[0], params=built[1]), str(tmp_path))
  cfg.model.path = str(tmp_path)
  run = read_settings(cfg)
  loaded = assemble_lib.load_model(run, wiring.model_config(run, CharTokenizer()), None)
  for model_cfg, params in (built, loaded):
    state = state_lib.create_train_state(model_cfg, params, optax.sgd(0.1),
                                         with_reference=False)
    assert state.model_config.remat is remat  # the update traces the model from this config


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_reference_is_not_held_when_beta_is_zero(beta):
  cfg = config_lib.get_config()
  cfg.loss.beta = beta
  run = read_settings(cfg)
  model_cfg, params = assemble_lib.load_model(run, wiring.model_config(run, CharTokenizer()), None)
  # The loop builds its state (also after SFT) and its rollout through these two.
  state = assemble_lib.train_state(read_settings(cfg), model_cfg, params, optax.sgd(0.1))
  rollout_config = wiring.rollout_config(read_settings(cfg), CharTokenizer())
  if beta == 0:
    assert state.ref_params is None and not rollout_config.with_reference
  else:
    assert set(state.ref_params) == set(state.params) and rollout_config.with_reference


def test_advantage_keys_reach_the_rollout_config():
  cfg = config_lib.get_config()
  cfg.advantage.estimator, cfg.advantage.scale, cfg.advantage.eps = "rloo", "none", 0.25
  got = wiring.rollout_config(read_settings(cfg), CharTokenizer())
  assert (got.estimator, got.advantage_scale, got.advantage_eps) == ("rloo", "none", 0.25)


def test_splits_default_to_the_tasks_own():
  cfg = config_lib.get_config()
  task = tasks.get_task("math")
  assert wiring.splits(read_settings(cfg), task) == task.splits == ("test", "test")
  cfg.task.train_split = "train[:100]"
  assert wiring.splits(read_settings(cfg), task) == ("train[:100]", "test")
  cfg.task.eval_split = "train[100:120]"
  assert wiring.splits(read_settings(cfg), task) == ("train[:100]", "train[100:120]")


@pytest.mark.parametrize("name, weights", [("arithmetic", [1.0, 1.0]),
                                           ("countdown", [1.0, 0.1, 1.0])])
def test_overlong_buffer_appends_dapos_penalty_at_weight_one(name, weights):
  cfg = config_lib.get_config()
  task = tasks.get_task(name)
  run = read_settings(cfg)
  assert wiring.run_rewards(run, task) == (task.reward_fns, task.reward_weights)  # 0: off
  cfg.rollout.max_completion_length, cfg.rewards.overlong_buffer = 8, 4
  fns, got = wiring.run_rewards(read_settings(cfg), task)
  assert fns[:-1] == task.reward_fns and list(got) == weights
  assert fns[-1].__name__ == "soft_overlong_penalty"


def test_overlong_penalty_scores_completion_lengths_next_to_the_task_reward():
  cfg = config_lib.get_config()
  cfg.rollout.max_completion_length, cfg.rewards.overlong_buffer = 8, 4
  fns, weights = wiring.run_rewards(read_settings(cfg), tasks.get_task("arithmetic"))
  row = {"prompt": "1+1=", "question": "1+1=", "answer": "2"}
  host = HostRewards(fns, decode=decode_chars, lookup=lambda i: row, weights=weights,
                     num_workers=0)
  lengths = np.array([1, 4, 6, 8])
  tokens = np.full((4, 8), ord("2"))
  out = host.compute(np.zeros(4, int), tokens, np.arange(8)[None] < lengths[:, None])
  assert out.names == ("exact_answer", "soft_overlong_penalty")
  # No penalty up to 8 - 4 tokens, then linear down to -1 at the maximum (DAPO).
  np.testing.assert_allclose(out.rewards[:, 1], [0.0, 0.0, -0.5, -1.0])
  np.testing.assert_allclose(out.rewards[:, 0], [1.0, 0.0, 0.0, 0.0])  # only "2" is right


def test_a_model_dir_without_its_tokenizer_or_weights_is_one_line(tmp_path):
  cfg = config_lib.get_config()
  run = read_settings(cfg)
  model_cfg, params = assemble_lib.load_model(run, wiring.model_config(run, CharTokenizer()), None)
  model = models.Transformer(model_cfg, params=params)
  models.save_pretrained(model, str(tmp_path))  # config.json and weights, no tokenizer
  cfg.model.path = str(tmp_path)
  with pytest.raises(config_lib.ConfigError, match=r"^config: model\.path='.*' has no tokenizer "
                     r"\(none of tokenizer\.json, .*\): give model\.tokenizer=DIR"):
    wiring.run_tokenizer(read_settings(cfg))
  CharTokenizer().save_pretrained(str(tmp_path))
  model_cfg = wiring.model_config(read_settings(cfg), wiring.run_tokenizer(read_settings(cfg)))
  for name in os.listdir(tmp_path):
    if name.endswith(".safetensors"):
      os.remove(tmp_path / name)
  with pytest.raises(config_lib.ConfigError, match=r"^config: model\.path='.*': no \*\.safetensors "
                     r"weights in"):
    assemble_lib.load_model(read_settings(cfg), model_cfg, mesh=None)


def test_a_run_reads_its_config_in_one_function(tmp_path, monkeypatch):
  """From the entry point (loop.setup) through the assembled run, every read of the
  config (an item, its keys, a dict of it) is made by settings.read and the section
  reader it calls: below it, the run holds typed settings, never the config."""
  import sys

  import ml_collections

  from grpojax import default_experiment
  from grpojax.train import evaluate, loop

  cfg = config_lib.apply(default_experiment.get_config("smoke"),
                         {"sft.steps": 0, "train.loggers": ""})
  # The evaluators are made (from the eval settings); their generation is not what is
  # checked here, and would compile.
  monkeypatch.setattr(evaluate.Evaluator, "__call__", lambda *args, **kwargs: {})
  readers = set()

  def spy(name):
    original = getattr(ml_collections.ConfigDict, name)

    def read(self, *args, **kwargs):
      frame = sys._getframe(1)
      # Past ml_collections' own calls (attribute access, to_dict), this spy's, and
      # comprehensions (a frame of their own before Python 3.12) to the reading function.
      while ("ml_collections" in frame.f_code.co_filename or frame.f_code is read.__code__
             or frame.f_code.co_name.startswith("<")):
        frame = frame.f_back
      readers.add(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
      return original(self, *args, **kwargs)

    monkeypatch.setattr(ml_collections.ConfigDict, name, read)

  for name in ("__getitem__", "keys", "items", "values", "to_dict", "get"):
    spy(name)
  job = loop.setup(cfg, str(tmp_path))
  try:
    assert readers == {"settings.py:read", "settings.py:_section"}
    assert job.state.step == 0 and job.rollout.group_size == cfg.rollout.group_size
    assert len(job.evaluators) == 1
  finally:
    monkeypatch.undo()
    job.host.close()
    job.ckpt.close()
    job.writer.close()
  # The spy sees reads: one made here, outside the settings.
  readers.clear()
  spy("__getitem__")
  cfg["train"]
  assert readers == {"test_train_loop_wiring.py:test_a_run_reads_its_config_in_one_function"}
