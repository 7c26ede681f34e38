"""TRL's reward-function contract beyond the columns: `trainer_state`, `log_metric` and
`log_extra`, `async def` functions (awaited concurrently within a batch) and callable
objects, in process and in worker processes. Through the loop (in workers):
tests/test_trl_formats.py."""

import asyncio
import threading

import numpy as np
import pytest

from grpojax.rewards import RewardFunctionError, TrainerState, compute_rewards
from grpojax.rewards.runtime.host import HostRewards
from grpojax.train import loop
from reward_helpers import decode_chars

EXAMPLES = {i: {"prompt": f"p{i}", "answer": str(i)} for i in range(4)}
IDS = np.array([0, 0, 1, 1, 2, 2, 3, 3])


def _tokens(texts):
  width = max(map(len, texts))
  tokens = np.array([[ord(c) for c in t] + [0] * (width - len(t)) for t in texts], np.int32)
  mask = np.array([[1] * len(t) + [0] * (width - len(t)) for t in texts], np.int32)
  return tokens, mask


TOKENS, MASK = _tokens(["a", "bb", "c", "dd", "e", "ff", "g", "hh"])


def progress(completions, trainer_state, **kwargs):
  """A curriculum-style reward: reads the step and the run's length."""
  return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def sees_state(completions, **kwargs):
  return [float("trainer_state" in kwargs)] * len(completions)


def plain(prompts, completions):  # takes no trainer_state: it must not be given one
  return [float(len(c)) for c in completions]


async def async_length(completions, **kwargs):
  await asyncio.sleep(0)
  return [float(len(c)) for c in completions]


def logs(completions, log_metric, log_extra, **kwargs):
  log_metric("calls_logged", 1.0)
  log_extra("length", [len(c) for c in completions])
  return [0.0] * len(completions)


async def async_logs(completions, log_extra, **kwargs):
  log_extra("first", [c[0] for c in completions])
  return [0.0] * len(completions)


class Contains:
  """A reward given as an object (TRL allows any callable)."""

  def __init__(self, letter):
    self.letter = letter

  def __call__(self, completions, **kwargs):
    return [float(self.letter in c) for c in completions]


class AsyncContains(Contains):
  async def __call__(self, completions, **kwargs):
    return [float(self.letter in c) for c in completions]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_whole_contract_in_process_and_in_workers(num_workers):
  fns = [progress, sees_state, plain, async_length, Contains("b"), AsyncContains("f"), logs,
         async_logs]
  # Chunks of 3 rows in workers: each chunk's call logs its own rows.
  with HostRewards(fns, decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=num_workers, chunk_rows=3) as host:
    host.trainer_state = TrainerState(global_step=3, max_steps=12)
    out = host.compute(IDS, TOKENS, MASK)
    logged = host.take_logged_metrics()
    assert host.take_logged_metrics() == {}  # taken once
  assert logged == {"calls_logged": 1.0}
  assert out.logs.extra == {"length": MASK.sum(1).tolist(), "first": list("abcdefgh")}
  assert host.recent[-1]["extra"] == out.logs.extra
  lengths = MASK.sum(1).astype(np.float32)
  np.testing.assert_array_equal(out.rewards[:, 0], 0.25)
  np.testing.assert_array_equal(out.rewards[:, 1], 1.0)
  np.testing.assert_array_equal(out.rewards[:, 2], lengths)
  np.testing.assert_array_equal(out.rewards[:, 3], lengths)
  np.testing.assert_array_equal(out.rewards[:, 4], [0, 1, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(out.rewards[:, 5], [0, 0, 0, 0, 0, 1, 0, 0])
  assert out.names == ("progress", "sees_state", "plain", "async_length", "Contains",
                       "AsyncContains", "logs", "async_logs")
  assert out.errors.tolist() == [0] * 8


def bad_extra(completions, log_extra):
  log_extra("length", [1])
  return [0.0] * len(completions)


def failing_rows(completions, log_extra):
  """Raises on the whole batch; alone, row "bb" raises too, the others log."""
  if len(completions) > 1 or completions[0] == "bb":
    raise ValueError("no")
  log_extra("ok", [completions[0]])
  return [1.0]


def test_logged_columns_are_one_value_a_completion_and_follow_row_retries():
  with pytest.raises(RewardFunctionError, match="logged 1 values in column 'length' for 2"):
    compute_rewards([bad_extra], ["p", "p"], ["a", "b"])
  out = compute_rewards([failing_rows], ["p"] * 3, ["a", "bb", "c"])
  assert out.logs.extra == {"ok": ["a", None, "c"]} and out.errors.tolist() == [1]


def test_without_a_state_none_is_passed_and_a_function_that_needs_it_says_so():
  assert compute_rewards([sees_state], ["p"], ["c"]).rewards.tolist() == [[0.0]]
  with pytest.raises(Exception, match="needs \\['trainer_state'\\]"):
    compute_rewards([progress], ["p"], ["c"])


def test_async_functions_of_a_batch_run_at_the_same_time():
  """Each of two async functions waits, in its own event loop, until the other has
  started: awaited one after the other, the first would time out, and fail every row."""
  met = threading.Barrier(2, timeout=20)

  async def first(completions, **kwargs):
    met.wait()
    return [1.0] * len(completions)

  async def second(completions, **kwargs):
    met.wait()
    return [2.0] * len(completions)

  with HostRewards([first, plain, second], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=0) as host:
    out = host.compute(IDS, TOKENS, MASK)
  np.testing.assert_array_equal(out.rewards[:, [0, 2]], [[1.0, 2.0]] * 8)
  assert out.errors.tolist() == [0, 0, 0]


def test_an_async_function_from_inside_a_running_event_loop():
  async def notebook():  # a notebook's cell runs in a loop already
    return compute_rewards([async_length], ["p", "p"], ["ab", "c"]).rewards[:, 0].tolist()

  assert asyncio.run(notebook()) == [2.0, 1.0]


def returns_no_values(completions, **kwargs):
  return []


@pytest.mark.slow
def test_a_broken_reward_function_is_its_own_one_line_error(tmp_path):
  """Raised as itself from the rollout, not wrapped in XLA's error from the host
  callback (a device's callback: its one row)."""
  cfg = loop.config_lib.get_config()
  cfg.rewards.functions = "test_rewards_trl_contract:returns_no_values"
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 2
  cfg.train.steps, cfg.sft.steps, cfg.eval.num_prompts = 1, 0, 0
  with pytest.raises(RewardFunctionError, match="^reward function 'returns_no_values' "
                     "returned 0 values for 1 completions"):
    loop.train(cfg, str(tmp_path))


def test_trainer_state_is_an_object_and_indexing_it_says_how_in_one_line():
  state = TrainerState(global_step=3, max_steps=12)
  assert (state.global_step, state.max_steps) == (3, 12)
  with pytest.raises(TypeError) as e:
    state["global_step"]  # pylint: disable=pointless-statement
  assert "trainer_state.global_step" in str(e.value) and "\n" not in str(e.value)
