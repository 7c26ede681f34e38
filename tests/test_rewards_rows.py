"""What one row costs when its reward fails or runs out of time, through every path
that runs reward functions: compute_rewards (this thread), the in-process runner, the
worker pool, and HostRewards (compute, the jitted callback, the streaming engine's
score_rows, held-out score). A row's failure is that row's NaN, counted in errors
with one warning, whatever it raises (BaseExceptions too) or if it returns inf; a
row that returns TIMED_OUT is NaN, counted in timeouts, never as an error."""

import asyncio
import copy
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.rewards.base import (TIMED_OUT, RewardFunctionError, RewardOutput,
                                  compute_rewards)
from grpojax.rewards.runtime.host import HostRewards
from grpojax.rewards.runtime.inprocess import InProcessRunner
from grpojax.rewards.runtime.pool import RewardPool
from reward_helpers import decode_chars
from grpojax.run.settings import read as read_settings


class CustomBase(BaseException):
  """A BaseException of the user's own (not an Exception)."""


RAISED = {  # what a reward function may raise on a row, by name
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": lambda: SystemExit(3),
    "GeneratorExit": GeneratorExit,
    "CancelledError": asyncio.CancelledError,
    "CustomBase": CustomBase,
    "ValueError": ValueError,
}


# Module-level classes: worker processes unpickle them.
class RaisesOnBad:
  """Scores 1.0, and raises RAISED[kind] on the batch whenever a completion is "bad"."""

  def __init__(self, kind):
    self.kind, self.__name__ = kind, f"raises_{kind}"

  def __call__(self, completions, **kw):
    if "bad" in completions:
      raise RAISED[self.kind]()
    return [1.0] * len(completions)


class AsyncRaisesOnBad(RaisesOnBad):
  def __init__(self, kind):
    super().__init__(kind)
    self.__name__ = f"async_raises_{kind}"

  async def __call__(self, completions, **kw):
    await asyncio.sleep(0)
    if "bad" in completions:
      raise RAISED[self.kind]()
    return [1.0] * len(completions)


FUNCTIONS = [cls(kind) for kind in RAISED for cls in (RaisesOnBad, AsyncRaisesOnBad)]
COMPLETIONS = ["a", "bad", "c", "d"]  # row 1 is the bad one


def kwargs_of(completions):
  return {"prompts": ["p"] * len(completions), "completions": list(completions)}


def _check_one_bad_row(rewards, errors):
  expected = np.array([1.0, np.nan, 1.0, 1.0], np.float32)
  for k, fn in enumerate(FUNCTIONS):
    np.testing.assert_array_equal(rewards[:, k], expected, err_msg=fn.__name__)
  assert errors.tolist() == [1] * len(FUNCTIONS)


def _said(caplog, name):
  return [r.getMessage() for r in caplog.records if repr(name) in r.getMessage()]


def test_anything_raised_on_a_row_costs_that_row_in_this_thread(caplog):
  # The main thread: where a real Ctrl-C would land too (see the next test).
  for _ in range(2):
    out = compute_rewards(FUNCTIONS, ["p"] * 4, COMPLETIONS)
    _check_one_bad_row(out.rewards, out.errors)
  for fn in FUNCTIONS:
    said = _said(caplog, fn.__name__)
    if fn.kind == "ValueError":
      assert said == []  # an Exception: counted, as always, and shown by check_errors
    else:  # one line per function and call, naming what it raised
      assert len(said) == 2 and ("exited with code 3" if fn.kind == "SystemExit"
                                 else fn.kind) in said[0], said


def test_in_process_runner_and_host_callback_cost_only_the_row(caplog):
  runner = InProcessRunner(FUNCTIONS, row_timeout_s=30.0)
  for _ in range(2):
    rewards, errors, *_ = runner.run(kwargs_of(COMPLETIONS), 4)
    _check_one_bad_row(rewards, errors)
  for fn in FUNCTIONS:  # one line for the runner's life, not one per call
    assert len(_said(caplog, fn.__name__)) == (fn.kind != "ValueError"), fn.__name__


@pytest.mark.slow
def test_worker_pool_costs_only_the_row():
  with RewardPool(FUNCTIONS, num_workers=1, chunk_rows=4) as pool:
    rewards, errors, *_ = pool.run(kwargs_of(COMPLETIONS), 4)
  _check_one_bad_row(rewards, errors)


def raises_keyboard_interrupt_always(completions, **kw):
  raise KeyboardInterrupt


@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_function_raising_on_every_row_is_a_reward_bug_not_a_ctrl_c(num_workers):
  examples = {0: {"prompt": "p"}}
  with HostRewards([raises_keyboard_interrupt_always], decode=decode_chars,
                   lookup=examples.__getitem__, num_workers=num_workers) as host:
    with pytest.raises(RewardFunctionError, match="raises_keyboard_interrupt_always.* 2 of 2"):
      host.compute(np.zeros(2, np.int32), np.full((2, 1), 97, np.int32))
  with pytest.raises(RewardFunctionError, match="failed on 3 of 3"):
    compute_rewards([raises_keyboard_interrupt_always], ["p"] * 3, ["a"] * 3)


def test_the_users_ctrl_c_still_stops_the_call():
  """A real SIGINT during a reward call on the main thread raises KeyboardInterrupt out
  of compute_rewards (the default handler's), and the handler is put back."""
  assert threading.current_thread() is threading.main_thread()
  before = signal.getsignal(signal.SIGINT)
  if before is not signal.default_int_handler:
    pytest.skip("SIGINT is not Python's default handler here")
  calls = []

  def pressed_ctrl_c(completions, **kw):
    calls.append(len(completions))
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler runs at once, raising here
    return [1.0] * len(completions)

  with pytest.raises(KeyboardInterrupt):
    compute_rewards([pressed_ctrl_c], ["p"] * 3, ["a"] * 3)
  assert calls == [3]  # stopped: no row-by-row retry
  assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------- non-finite values

def nonfinite(completions, **kw):
  values = {"one": 1.0, "inf": math.inf, "-inf": -math.inf, "nan": math.nan, "none": None,
            "big": 1e39, "huge": 10**400, "np_inf": np.float64("inf")}  # big: past float32
  return [values[c] for c in completions]


NONFINITE = ["one", "inf", "-inf", "nan", "none", "big", "huge", "np_inf"]
NONFINITE_ERRORS = 5  # inf, -inf, big, huge, np_inf; NaN and None are "not applicable"


def _check_nonfinite(rewards, errors):
  assert np.isnan(rewards[1:, 0]).all() and rewards[0, 0] == 1.0
  assert errors.tolist() == [NONFINITE_ERRORS]


def test_non_finite_rewards_are_errors_not_inf_means(caplog):
  out = compute_rewards([nonfinite], ["p"] * 8, NONFINITE, max_error_fraction=None)
  _check_nonfinite(out.rewards, out.errors)
  m = out.metrics()
  assert m["rewards/nonfinite/mean"] == 1.0 and m["rewards/nonfinite/errors"] == 5.0
  said = _said(caplog, "nonfinite")
  assert len(said) == 1 and "inf" in said[0] and "errors" in said[0], said
  # Too many of them: the function is broken, and says why.
  with pytest.raises(RewardFunctionError, match="(?s)'nonfinite' failed on 1 of 1.*not a finite"):
    compute_rewards([nonfinite], ["p"], ["inf"])
  # A row retried alone after the batch raised is checked alike.
  def raises_then_inf(completions, **kw):
    if len(completions) > 1:
      raise ValueError("batch")
    return nonfinite(completions)
  out = compute_rewards([raises_then_inf], ["p"] * 8, NONFINITE, max_error_fraction=None)
  _check_nonfinite(out.rewards, out.errors)


def test_non_finite_rewards_through_the_runners(caplog):
  runner = InProcessRunner([nonfinite], row_timeout_s=30.0)
  rewards, errors, *_ = runner.run(kwargs_of(NONFINITE), 8)
  _check_nonfinite(rewards, errors)


@pytest.mark.slow
def test_non_finite_rewards_through_the_pool():
  with RewardPool([nonfinite], num_workers=1, chunk_rows=3) as pool:
    rewards, errors, *_ = pool.run(kwargs_of(NONFINITE), 8)
  _check_nonfinite(rewards, errors)


# ---------------------------------------------------------------- TIMED_OUT

def test_timed_out_is_one_object_everywhere():
  assert repr(TIMED_OUT) == "TIMED_OUT"
  assert pickle.loads(pickle.dumps(TIMED_OUT)) is TIMED_OUT
  assert copy.deepcopy(TIMED_OUT) is TIMED_OUT and copy.copy(TIMED_OUT) is TIMED_OUT
  # Pickled by another interpreter (a worker's verdict), unpickled here.
  code = ("import pickle, sys; from grpojax.rewards.base import TIMED_OUT; "
          "sys.stdout.buffer.write(pickle.dumps([TIMED_OUT, 1.0]))")
  data = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                        timeout=120).stdout
  assert pickle.loads(data)[0] is TIMED_OUT


def times_out_on_t(completions, **kw):
  """TIMED_OUT for completions starting with "t", else 1.0 ("0": 0.0)."""
  return [TIMED_OUT if c.startswith("t") else float(c != "0") for c in completions]


TIMEOUT_ROWS = ["1", "t", "0", "t", "1", "tt"]  # 3 timeouts; the rest average 2/3


def _check_timeouts(rewards, errors, timeouts, k=0):
  np.testing.assert_array_equal(rewards[:, k], [1.0, np.nan, 0.0, np.nan, 1.0, np.nan])
  assert errors[k] == 0 and timeouts[k] == 3


def test_timed_out_rows_are_nan_and_counted_apart_from_errors():
  out = compute_rewards([times_out_on_t], ["p"] * 6, TIMEOUT_ROWS)
  _check_timeouts(out.rewards, out.errors, out.timeouts)
  m = out.metrics()
  assert m["rewards/times_out_on_t/timeouts"] == 3.0 and m["rewards/times_out_on_t/errors"] == 0.0
  assert m["rewards/times_out_on_t/mean"] == pytest.approx(2 / 3)  # left out, not 0
  # All rows out of time: not a bug in the reward, so it does not stop the run.
  out = compute_rewards([times_out_on_t], ["p"] * 4, ["t"] * 4, max_error_fraction=0.0)
  assert out.timeouts.tolist() == [4] and out.errors.tolist() == [0]
  # Counted on a row-by-row retry too.
  def raises_then_times_out(completions, **kw):
    if len(completions) > 1:
      raise ValueError("batch")
    return times_out_on_t(completions)
  out = compute_rewards([raises_then_times_out], ["p"] * 6, TIMEOUT_ROWS)
  _check_timeouts(out.rewards, out.errors, out.timeouts)
  assert RewardOutput(out.rewards, out.names, out.errors).timeouts.tolist() == [0]


def test_timed_out_rows_through_the_in_process_runner():
  runner = InProcessRunner([times_out_on_t], row_timeout_s=30.0)
  rewards, errors, _, _, timeouts = runner.run(kwargs_of(TIMEOUT_ROWS), 6)
  _check_timeouts(rewards, errors, timeouts)


@pytest.mark.slow
def test_timed_out_rows_through_the_pool():
  # Chunks of 4 and 2 rows: the counts of both tasks add up.
  with RewardPool([nonfinite, times_out_on_t], num_workers=2, chunk_rows=4) as pool:
    rewards, errors, _, _, timeouts = pool.run(kwargs_of(TIMEOUT_ROWS), 6, functions=[1])
  _check_timeouts(rewards, errors, timeouts, k=1)
  assert timeouts[0] == 0 and np.isnan(rewards[:, 0]).all()  # not called


EXAMPLES = {i: {"prompt": f"p{i}"} for i in range(4)}


def encode(texts, length=4):
  tokens = np.zeros((len(texts), length), np.int32)
  mask = np.zeros((len(texts), length), np.int32)
  for r, text in enumerate(texts):
    tokens[r, :len(text)], mask[r, :len(text)] = [ord(c) for c in text], 1
  return tokens, mask


def test_host_counts_each_steps_timeouts_through_every_training_path(caplog):
  ids = np.array([0, 0, 1, 1, 2, 2], np.int32)
  tokens, mask = encode(TIMEOUT_ROWS)
  with HostRewards([times_out_on_t], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=0, max_error_fraction=0.0) as host:
    out = host.compute(ids, tokens, mask)
    _check_timeouts(out.rewards, out.errors, out.timeouts)
    assert out.metrics()["rewards/times_out_on_t/timeouts"] == 3.0
    # The rollout's jitted callback (sharded or not), then the streaming engine's
    # score_rows (only its valid rows are scored): 3 + 3 + 2 more in this "step".
    rewards, errors = jax.jit(lambda *a: host(*a))(jnp.asarray(ids), jnp.asarray(tokens),
                                                   jnp.asarray(mask))
    _check_timeouts(np.asarray(rewards), np.asarray(errors), [3])
    valid = np.array([True, True, True, True, False, False])
    rewards, errors = host.score_rows(ids, tokens, mask, valid)
    assert np.isnan(rewards[4:]).all() and errors.tolist() == [[0]]
    assert host.take_timeouts().tolist() == [3 + 3 + 2]
    assert host.take_timeouts().tolist() == [0]  # taken: the next step starts at 0
    # Held-out evaluation: NaN (not right), no crash, not the training count.
    rows = [{"prompt": "p"}] * 6
    scored = host.score(rows, TIMEOUT_ROWS, [[1]] * 6)
    np.testing.assert_array_equal(scored[:, 0], [1.0, np.nan, 0.0, np.nan, 1.0, np.nan])
    assert host.take_timeouts().tolist() == [0]
  said = _said(caplog, "times_out_on_t")
  assert len(said) == 1 and "timeouts" in said[0] and "3 of 6" in said[0]


def test_a_call_begun_before_the_take_counts_in_no_step():
  """A call still running when its step's count is taken (a streamed group the step
  did not wait for) is counted in neither that step nor the next."""
  started, release = threading.Event(), threading.Event()

  def slow_timeout(completions, **kw):
    started.set()
    release.wait(30)
    return [TIMED_OUT] * len(completions)

  ids = np.zeros(2, np.int32)
  tokens, mask = encode(["a", "b"])
  with HostRewards([slow_timeout], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=0, max_error_fraction=None) as host:
    late = threading.Thread(target=host.compute, args=(ids, tokens, mask))
    late.start()
    assert started.wait(30)
    assert host.take_timeouts().tolist() == [0]  # the step ends before its call does
    release.set()
    late.join(30)
    host.compute(ids, tokens, mask)  # the next step's own call
    assert host.take_timeouts().tolist() == [2]  # its own, not the late call's 2 more


def test_probe_timeouts_do_not_reach_the_first_step():
  with HostRewards([times_out_on_t], decode=lambda rows: ["t" for _ in rows],
                   lookup=EXAMPLES.__getitem__, num_workers=0) as host:
    host.probe([0, 1])
    assert host.take_timeouts().tolist() == [0]




# ---------------------------------------------------------------- the loop

_SEEN_LOCK = threading.Lock()
SEEN_TIMEOUTS: dict = {}  # global_step -> TIMED_OUT rows this function returned


def times_out_but_first(completions, trainer_state, **kw):
  """1.0 for each call's first row, TIMED_OUT for the rest (most rows: past
  max_error_fraction, were they errors), counted by the step it was called for."""
  with _SEEN_LOCK:  # a mesh's shards call back at once
    step = trainer_state.global_step
    SEEN_TIMEOUTS[step] = SEEN_TIMEOUTS.get(step, 0) + len(completions) - 1
  return [1.0] + [TIMED_OUT] * (len(completions) - 1)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {},  # the lockstep rollout: one callback per device shard
    {"rollout.engine": "paged", "rollout.dynamic_sampling": True,  # streamed, rounds
     "rollout.dynamic_sampling_max_rounds": 2},
], ids=["lockstep", "paged_streaming"])
def test_each_steps_timeouts_reach_its_metrics(tmp_path, overrides):
  from grpojax.train import loop  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
  import arithmetic_tiny  # pylint: disable=import-outside-toplevel

  cfg = arithmetic_tiny.get_config("smoke")
  cfg.train.steps, cfg.train.eval_every, cfg.train.save_every, cfg.sft.steps = 2, 0, 0, 0
  cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.eval.num_prompts = 4, 4, 0
  cfg.rewards.functions = "test_rewards_rows:times_out_but_first"
  for key, value in overrides.items():
    section, name = key.split(".")
    cfg[section][name] = value
  SEEN_TIMEOUTS.clear()
  workdir = str(tmp_path / "w")
  assert loop.train(cfg, workdir)["step"] == 2  # timeouts do not stop it
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [m for m in map(json.loads, f) if m["step"] > 0]
  per_step = read_settings(cfg).updates_per_step
  name = "rewards/times_out_but_first"
  got = {m["step"]: m[f"{name}/timeouts"] for m in rows}
  assert got == {s + 1: float(SEEN_TIMEOUTS[s * per_step]) for s in range(2)}, SEEN_TIMEOUTS
  assert all(v > 0 for v in got.values())
  for m in rows:
    assert m[f"{name}/errors"] == 0 and m[f"{name}/mean"] == 1.0  # left out, not zeros
