"""TRL's dataset formats and reward functions port as they are: the "prompt" task takes
a prompt column of text or of chat messages, hands every other column to the reward
functions, and completions in TRL's shapes; TRL's own trl.rewards functions score them,
in process and in worker processes, and train through the loop."""

import json

import numpy as np
import pytest

from grpojax.data import PromptIterator, get_task, load_rows
from grpojax.models.tokenizers import CharTokenizer
from grpojax.rewards.runtime.host import HostRewards
from grpojax.train import loop

trl_rewards = pytest.importorskip("trl.rewards")

RIGHT = "<think>one third</think> \\boxed{\\frac{1}{3}}"
WRONG = "no tags \\boxed{\\frac{1}{2}}"


def _rows(conversational: bool, n: int = 8):
  q = "What is 1/3 as a fraction?"
  prompt = [{"role": "user", "content": q}] if conversational else q
  return [{"prompt": prompt, "solution": "\\frac{1}{3}", "id": i} for i in range(n)]


def text_reward(prompts, completions, solution, **kw):
  """A text-format reward: prompts and completions are strings."""
  assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
  return [float(s in c) for c, s in zip(completions, solution)]


def _score(rows, fns, num_workers):
  tok = CharTokenizer()
  task = get_task("prompt")
  it = PromptIterator(rows, task, tok, batch_size=2, max_prompt_length=64, seed=0)
  batch = it.next()
  ids = np.repeat(batch["example_ids"], 2)
  texts = [RIGHT, WRONG] * len(batch["example_ids"])
  width = max(map(len, texts))
  tokens = np.array([tok.encode(t) + [0] * (width - len(t)) for t in texts], np.int32)
  mask = np.array([[1] * len(t) + [0] * (width - len(t)) for t in texts], np.int32)
  with HostRewards(fns, decode=lambda r: [tok.decode(x) for x in r], lookup=it.lookup,
                   num_workers=num_workers) as host:
    return host.compute(ids, tokens, mask).rewards


@pytest.mark.parametrize("num_workers", [0, 1])
def test_trls_own_rewards_score_conversational_rows(num_workers):
  rewards = _score(_rows(True), [trl_rewards.think_format_reward, trl_rewards.accuracy_reward],
                   num_workers)
  np.testing.assert_array_equal(rewards, [[1.0, 1.0], [0.0, 0.0]] * 2)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_text_rows_get_strings(num_workers):
  np.testing.assert_array_equal(_score(_rows(False), [text_reward], num_workers)[:, 0],
                                [1.0, 0.0] * 2)


def step_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
  """TRL's extra arguments, in a worker: the step, a logged metric and a logged column."""
  log_metric("seen_step", trainer_state.global_step)
  log_extra("chars", [len(c[0]["content"]) for c in completions])  # chat rows: messages
  return [float(trainer_state.global_step + 100 * trainer_state.max_steps)] * len(completions)


@pytest.mark.slow
def test_a_trl_dataset_trains_with_trl_rewards(tmp_path):
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in _rows(True, 16)))
  cfg = loop.config_lib.get_config()
  cfg.task.name, cfg.task.dataset = "prompt", str(tmp_path)
  cfg.task.train_split = cfg.task.eval_split = "train"
  cfg.rewards.functions = ("trl.rewards:think_format_reward,trl.rewards:accuracy_reward,"
                           "test_trl_formats:step_reward")
  cfg.rewards.num_workers = 1
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 2, 4
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = 64, 8
  cfg.train.steps, cfg.train.save_every, cfg.train.log_completions = 2, 0, 1
  cfg.eval.num_prompts, cfg.eval.batch_size = 4, 4
  summary = loop.train(cfg, str(tmp_path / "run"))
  assert summary["step"] == 2 and "eval/accuracy" in summary["end"]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert "rewards/think_format_reward/mean" in rows[-1]
  assert "rewards/accuracy_reward/mean" in rows[-1]
  # trainer_state moves with the steps (the rollout of step s runs after s - 1 of 2), and
  # what the function logged reaches the metrics and the sampled completions.
  assert [r["rewards/step_reward/mean"] for r in rows if r["step"]] == [200.0, 201.0]
  assert [r["seen_step"] for r in rows if "seen_step" in r] == [0.0, 1.0]
  samples = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
  assert samples and all(x["extra"]["chars"] == len(x["completion"]) for x in samples)
  assert load_rows(get_task("prompt"), str(tmp_path), "train")[0]["solution"] == "\\frac{1}{3}"
