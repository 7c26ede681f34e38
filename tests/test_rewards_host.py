"""The host bridge: jitted callers, sharding, the persistent worker pool."""

import os
import re
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpojax.rewards import format_reward, math_accuracy_reward
from grpojax.rewards.base import RewardFunctionError
from grpojax.rewards.runtime.host import HostRewards
from grpojax.rewards.runtime.pool import RewardPool
from reward_helpers import decode_chars

EXAMPLES = {i: {"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)}
G, T = 2, 48  # completions per prompt, completion length


def encode(texts, length=T):
  tokens = np.zeros((len(texts), length), np.int32)
  mask = np.zeros((len(texts), length), np.int32)
  for r, text in enumerate(texts):
    ids = [ord(c) for c in text][:length]
    tokens[r, :len(ids)], mask[r, :len(ids)] = ids, 1
  return tokens, mask


def batch():
  """16 rows (8 prompts × G): even rows right and well-formed, odd rows not."""
  ids = np.repeat(np.arange(8), G).astype(np.int32)
  texts = [f"<think>ok</think><answer>{2 * i}</answer>" if r % 2 == 0 else f"{2 * i + 1}"
           for r, i in enumerate(ids)]
  return (ids, *encode(texts))


# Module-level so that worker processes can import them.
def hangs_on_seven(completions, **kw):
  if any("7" in c for c in completions):
    time.sleep(60)
  return [1.0] * len(completions)


def dies_on_five(completions, **kw):
  if any("5" in c for c in completions):
    os._exit(3)
  return [2.0] * len(completions)


def always_broken(completions, **kw):
  raise ValueError("reward code bug")


def pid_reward(completions, **kw):
  return [float(os.getpid())] * len(completions)


def test_host_rewards_in_process_match_hand_worked():
  ids, tokens, mask = batch()
  with HostRewards([math_accuracy_reward, format_reward], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=0) as host:
    out = host.compute(ids, tokens, mask)
  expected = np.tile([[1.0, 1.0], [0.0, 0.0]], (8, 1)).astype(np.float32)
  np.testing.assert_array_equal(out.rewards, expected)
  assert out.names == ("math_accuracy", "format")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_score_calls_only_the_verifier_on_whole_rows(num_workers):
  """HostRewards.score (held-out eval): rows given whole, the first function only
  (always_broken would raise), the same values compute gives."""
  ids, tokens, mask = batch()
  rows = [EXAMPLES[i] for i in ids.tolist()]
  texts = decode_chars([t[m > 0].tolist() for t, m in zip(tokens, mask)])
  with HostRewards([math_accuracy_reward, always_broken], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=num_workers) as host:
    scored = host.score(rows, texts, [t[m > 0].tolist() for t, m in zip(tokens, mask)])
  np.testing.assert_array_equal(scored[:, 0], np.tile([1.0, 0.0], 8))
  assert np.isnan(scored[:, 1]).all()


def test_jitted_bridge_same_rewards_on_1_and_8_devices():
  assert len(jax.devices()) == 8, "tests/conftest.py sets 8 fake CPU devices"
  seen = []

  def batch_sizes(completions, **kw):  # records what each callback saw
    seen.append(len(completions))
    return [float(len(c)) for c in completions]

  ids, tokens, mask = batch()
  with HostRewards([math_accuracy_reward, format_reward, batch_sizes], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=0) as host:
    one = jax.jit(lambda i, t, m: host(i, t, m))
    r1, e1 = jax.block_until_ready(one(ids, tokens, mask))
    assert seen == [16]
    seen.clear()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    rows2d = NamedSharding(mesh, P(("data", "fsdp"), None))
    eight = jax.jit(lambda i, t, m: host(i, t, m, mesh=mesh))
    r8, e8 = eight(jax.device_put(ids, rows), jax.device_put(tokens, rows2d),
                   jax.device_put(mask, rows2d))
    jax.block_until_ready((r1, e1, r8, e8))  # dispatch is asynchronous
  assert sorted(seen) == [2] * 8  # each device verified only its own rows
  np.testing.assert_array_equal(np.asarray(r1), np.asarray(r8))
  assert np.asarray(r1)[:, :2].tolist() == [[1.0, 1.0], [0.0, 0.0]] * 8
  assert r8.sharding.spec[0] == ("data", "fsdp")
  assert np.asarray(e1).tolist() == np.asarray(e8).tolist() == [0, 0, 0]


@pytest.mark.parametrize("sharded", [False, True])
def test_the_rewards_run_once_a_call_even_when_their_result_is_unused(sharded):
  """The bridge is an effect (io_callback): XLA neither drops it when the caller
  ignores its result (the loop's recent samples, the reward workers' logs still
  happen) nor runs it twice. A pure_callback here was dropped."""
  calls = []

  def counted(completions, **kw):
    calls.append(len(completions))
    return [1.0] * len(completions)

  ids, tokens, mask = batch()
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",)) if sharded else None
  with HostRewards([counted], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=0) as host:
    def ignore(i, t, m):
      host(i, t, m, mesh=mesh)
      return t.sum()

    def twice(i, t, m):
      r, _ = host(i, t, m, mesh=mesh)
      return r + r

    jax.block_until_ready(jax.jit(ignore)(ids, tokens, mask))
    assert sum(calls) == len(ids)
    calls.clear()
    jax.block_until_ready(jax.jit(twice)(ids, tokens, mask))
    assert sum(calls) == len(ids)


def test_pool_through_jit_matches_in_process():
  ids, tokens, mask = batch()
  kw = dict(decode=decode_chars, lookup=EXAMPLES.__getitem__)
  with HostRewards([math_accuracy_reward, format_reward], num_workers=0, **kw) as local:
    expected = local.compute(ids, tokens, mask).rewards
  mesh = Mesh(np.array(jax.devices()), ("data",))
  with HostRewards([math_accuracy_reward, format_reward], num_workers=2, **kw) as host:
    got, errors = jax.jit(lambda i, t, m: host(i, t, m, mesh=mesh))(ids, tokens, mask)
    np.testing.assert_array_equal(np.asarray(got), expected)  # before the pool closes
  assert np.asarray(errors).tolist() == [0, 0]


@pytest.mark.slow
def test_pool_survives_hangs_and_crashes():
  n = 12
  completions = [str(i) for i in range(n)]  # row 7 hangs, row 5 kills its worker
  kwargs = {"prompts": [""] * n, "completions": completions}
  with RewardPool([hangs_on_seven, dies_on_five, pid_reward], num_workers=2,
                  row_timeout_s=1.0, chunk_rows=4) as pool:
    rewards, errors, firsts, *_ = pool.run(kwargs, n)
    # Only the bad rows lose their reward; their neighbours are retried. The hung
    # row is NaN and "timed out": the pool cut it off at row_timeout_s rather than
    # wait out its 60 s sleep, which would have given it 1.0 (no wall-clock bound
    # here: a busy machine must not fail this test).
    hang, die = rewards[:, 0], rewards[:, 1]
    assert np.isnan(hang[7]) and np.all(hang[np.arange(n) != 7] == 1.0)
    assert np.isnan(die[5]) and np.all(die[np.arange(n) != 5] == 2.0)
    assert errors.tolist() == [1, 1, 0]
    assert "timed out" in firsts[0] and "died" in firsts[1]
    # Still persistent and working: the same workers serve the next batches. Which
    # worker takes which chunk is the scheduler's choice, so compare against the
    # pool's workers, not one batch's pids against the next's.
    workers = {w.proc.pid for w in pool._workers}
    for _ in range(2):
      pids = set(pool.run(kwargs | {"completions": ["1"] * n}, n)[0][:, 2].tolist())
      assert pids <= workers
    assert {w.proc.pid for w in pool._workers} == workers


def test_bridge_stops_the_run_when_a_function_is_broken(caplog):
  ids, tokens, mask = batch()
  with HostRewards([format_reward, always_broken], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=1) as host:
    with pytest.raises(RewardFunctionError, match="'always_broken' failed on 16 of 16"):
      host.compute(ids, tokens, mask)
    with pytest.raises(Exception, match="always_broken"):
      jax.block_until_ready(jax.jit(lambda i, t, m: host(i, t, m))(ids, tokens, mask))
  assert isinstance(host.error, RewardFunctionError)  # the run reports it, in one line
  # JAX's own log of the callback's traceback is left out (the run reports it).
  assert not [r for r in caplog.records if "io_callback failed" in r.getMessage()]


def test_closing_the_pool_never_leaves_a_caller_waiting():
  pool = RewardPool([hangs_on_seven], num_workers=1, row_timeout_s=30.0)
  result = {}

  def call():
    try:
      pool.run({"prompts": [""], "completions": ["7"]}, 1)
    except Exception as e:  # noqa: BLE001
      result["error"] = e
  caller = threading.Thread(target=call)
  caller.start()
  time.sleep(0.5)
  pool.close()
  caller.join(timeout=15)
  assert not caller.is_alive() and "closed" in str(result["error"])


def test_unpicklable_functions_get_a_clear_error():
  with pytest.raises(ValueError, match="picklable"):
    RewardPool([lambda completions, **kw: [0.0] * len(completions)], num_workers=1)


# Issue 16: in-process rewards (num_workers=0, the default) get the pool's guarantees.
def none_reward(completions, **kw):
  return [None] * len(completions)


def test_in_process_hangs_and_exits_cost_only_their_row(caplog):
  n = 12
  ids = np.arange(n, dtype=np.int32) % 8
  tokens, mask = encode([str(i) for i in range(n)])  # row 7 hangs, row 5 calls os._exit(3)
  with HostRewards([hangs_on_seven, dies_on_five, pid_reward], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=0, row_timeout_s=0.5,
                   max_error_fraction=None) as host:
    out = host.compute(ids, tokens, mask)
  hang, die = out.rewards[:, 0], out.rewards[:, 1]
  assert np.isnan(hang[7]) and np.all(hang[np.arange(n) != 7] == 1.0)
  assert np.isnan(die[5]) and np.all(die[np.arange(n) != 5] == 2.0)
  assert np.all(out.rewards[:, 2] == os.getpid())  # in this process, as promised
  assert out.errors.tolist() == [1, 1, 0]
  # NaN, not the 1.0 the hang returns after its 60 s: cut off at row_timeout_s.
  said = [r.getMessage() for r in caplog.records]
  assert any("hangs_on_seven" in m and "timed out" in m for m in said)
  assert any("dies_on_five" in m and "exit" in m and "3" in m for m in said)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 1])
def test_interrupt_ends_a_hanging_reward_at_once(num_workers):
  tokens, mask = encode(["7"])
  with HostRewards([hangs_on_seven], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=num_workers, row_timeout_s=300.0) as host:
    host.compute(np.zeros(1, np.int32), *encode(["1"]))  # started and warm
    assert not host.interrupted
    threading.Timer(0.5, host.interrupt).start()  # what SIGTERM does in the loop
    out = host.compute(np.zeros(1, np.int32), tokens, mask)
  # NaN, not the 1.0 the hang gives after its 60 s sleep: the interrupt ended it.
  assert np.isnan(out.rewards[0, 0]) and host.interrupted


def test_a_function_returning_only_none_warns_once(caplog):
  ids, tokens, mask = batch()
  with HostRewards([none_reward, format_reward], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=0) as host:
    host.compute(ids, tokens, mask)
    host.compute(ids, tokens, mask)
  said = [r.getMessage() for r in caplog.records if "none_reward" in r.getMessage()]
  assert len(said) == 1 and "None for all 16" in said[0]


def _traced_sleep():
  time.sleep(1.5)


def under_a_debugger(completions, **kw):
  # What pdb.set_trace() does to the frames it steps through, without a prompt.
  def tracer(frame, event, arg):
    return tracer
  sys.settrace(tracer)
  try:
    _traced_sleep()
  finally:
    sys.settrace(None)
  return [1.0] * len(completions)


def test_a_reward_under_a_debugger_is_not_timed_out():
  with HostRewards([under_a_debugger], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=0, row_timeout_s=0.5) as host:
    out = host.compute(np.zeros(1, np.int32), *encode(["1"]))
  assert out.rewards.tolist() == [[1.0]] and out.errors.tolist() == [0]


def test_a_worker_that_exits_is_reported_in_one_line(caplog):
  with HostRewards([dies_on_five], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=1, max_error_fraction=None) as host:
    out = host.compute(np.zeros(2, np.int32), *encode(["5", "1"]))
  assert np.isnan(out.rewards[0, 0]) and out.rewards[1, 0] == 2.0
  said = [r.getMessage() for r in caplog.records if "dies_on_five" in r.getMessage()]
  assert len(said) == 1 and "exit code 3" in said[0]


CONFIG_WITH_REWARD = '''
import helper_next_to_it


def length_reward(completions, **kw):
  return [helper_next_to_it.SCALE * len(c) for c in completions]


def get_config(arg=None):
  from grpojax import config
  return config.get_config()
'''


def test_rewards_defined_in_a_config_file_run_in_worker_processes(tmp_path):
  """ml_collections loads a --config file as module "config_config", which a fresh
  interpreter cannot import by name: the workers load it from its file (and its
  sibling imports) before unpickling the functions."""
  from absl import flags
  from ml_collections import config_flags

  (tmp_path / "my_exp.py").write_text(CONFIG_WITH_REWARD)
  (tmp_path / "helper_next_to_it.py").write_text("SCALE = 2.0\n")
  sys.path.insert(0, str(tmp_path))  # as grpojax.main puts the config's directory
  try:
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", str(tmp_path / "my_exp.py"), flag_values=values,
                                    sys_argv=["x"])
    values(["x"])
    module = next(m for m in sys.modules.values()
                  if getattr(m, "__file__", "") == str(tmp_path / "my_exp.py"))
    fn = module.length_reward
    ids, tokens, mask = batch()
    with HostRewards([fn], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                     num_workers=1) as host:
      out = host.compute(ids, tokens, mask)
  finally:
    sys.path.remove(str(tmp_path))
  texts = decode_chars([t[m > 0].tolist() for t, m in zip(tokens, mask)])
  np.testing.assert_array_equal(out.rewards[:, 0], [2.0 * len(t) for t in texts])


# Issue 28: os._exit on a thread the reward function started ends that thread, not the
# trainer. Each case runs in its own interpreter, so that a broken guard kills it, not pytest.
EXIT_FROM_A_THREAD = {
    "Thread": "t = threading.Thread(target=os._exit, args=(3,)); t.start(); t.join()",
    "Timer": "threading.Timer(0.05, os._exit, (3,)).start()",  # fires after the call
    "ThreadPoolExecutor": "ex = ThreadPoolExecutor(2); ex.submit(os._exit, 3); "
                          "ex.shutdown(wait=True)",
    "_thread": "_thread.start_new_thread(os._exit, (3,)); time.sleep(0.3)",
    "a thread's thread": "t = threading.Thread(target=lambda: threading.Thread("
                         "target=os._exit, args=(3,)).start()); t.start(); t.join()",
}

TRAINER = '''
import _thread, logging, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from grpojax.rewards.runtime.inprocess import InProcessRunner

def reward(completions, **kw):
  {body}
  return [1.0] * len(completions)

logging.basicConfig(stream=sys.stdout, format="%(message)s")
runner = InProcessRunner([reward], row_timeout_s=5.0)
rewards, errors, *_ = runner.run({{"prompts": ["p"] * 2, "completions": ["a", "b"]}}, 2)
time.sleep(0.5)  # the Timer's thread, and any late exit, come and go
print("TRAINER ALIVE", rewards[:, 0].tolist(), errors.tolist(), flush=True)
'''


def run_trainer(body):
  return subprocess.run([sys.executable, "-c", TRAINER.format(body=body)],
                        capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("how", list(EXIT_FROM_A_THREAD))
def test_os_exit_on_a_thread_the_reward_started_spares_the_trainer(how):
  proc = run_trainer(EXIT_FROM_A_THREAD[how])
  assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
  assert "TRAINER ALIVE [1.0, 1.0] [0]" in proc.stdout, proc.stdout
  said = [line for line in proc.stdout.splitlines() if "os._exit(3)" in line]
  assert len(said) == 1 and "thread" in said[0], proc.stdout  # one line, naming it
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_os_exit_waited_on_through_an_executor_fails_the_call_like_its_own():
  proc = run_trainer("with ThreadPoolExecutor(1) as ex: ex.submit(os._exit, 3).result()")
  assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
  assert "TRAINER ALIVE [nan, nan] [2]" in proc.stdout, proc.stdout
  assert "exited with code 3" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fork", [
    "os.fork()",  # by hand, on the reward's thread
    "multiprocessing.get_context('fork').Process(target=time.sleep, args=(0,))",
])
def test_a_child_forked_by_the_reward_still_exits(fork):
  """The guard is the trainer's alone: a forked child's os._exit ends the child (a
  child kept alive would go on running the trainer's code)."""
  if fork == "os.fork()":
    body = ("pid = os.fork()\n  if pid == 0:\n    os._exit(7)\n"
            "  code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])")
  else:  # multiprocessing's child ends with os._exit(exitcode): 0 here
    body = (f"import multiprocessing\n  p = {fork}\n  p.start(); p.join(30)\n"
            "  code = 7 if p.exitcode == 0 else p.exitcode")
  proc = run_trainer(body + "\n  print('CHILD', os.getpid(), code, flush=True)")
  assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
  assert "TRAINER ALIVE [1.0, 1.0] [0]" in proc.stdout, proc.stdout
  children = [line.split() for line in proc.stdout.splitlines() if line.startswith("CHILD")]
  # Called once on the batch, by the trainer's own process, and each child exited 7.
  assert len(children) == 1 and children[0][2] == "7", proc.stdout


# Issue 28: reward functions in the trainer get their own copies of the batch.
def boxed_batch():
  """16 rows (8 prompts × G): even rows right, odd rows wrong, each a \\boxed{} number."""
  ids = np.repeat(np.arange(8), G).astype(np.int32)
  texts = [f"\\boxed{{{2 * i + r % 2}}}" for r, i in enumerate(ids)]
  return (ids, *encode(texts))


def answers_itself(completions, answer, **kw):  # makes every row's gold its own answer
  answer[:] = [re.findall(r"\d+", c)[-1] for c in completions]
  return [0.0] * len(completions)


def boxes_the_gold(completions, answer, **kw):  # rewrites every completion as right
  completions[:] = [f"\\boxed{{{a}}}" for a in answer]
  return [0.0] * len(completions)


def adds_a_test(completions, tests, **kw):
  for t in tests:
    t.append("assert False")
  return [0.0] * len(completions)


def count_tests(completions, tests, **kw):
  return [float(len(t)) for t in tests]


def test_in_process_a_function_cannot_change_what_the_next_one_sees():
  ids, tokens, mask = boxed_batch()
  examples = {i: dict(EXAMPLES[i], tests=[f"assert f() == {2 * i}"]) for i in EXAMPLES}
  with HostRewards([answers_itself, boxes_the_gold, adds_a_test, math_accuracy_reward,
                    count_tests], decode=decode_chars, lookup=examples.__getitem__,
                   num_workers=0) as host:
    for _ in range(2):  # two epochs over the same dataset rows
      out = host.compute(ids, tokens, mask)
      np.testing.assert_array_equal(out.rewards[:, 3], np.tile([1.0, 0.0], 8))
      np.testing.assert_array_equal(out.rewards[:, 4], np.ones(16))
  assert all(len(row["tests"]) == 1 for row in examples.values())


def edits_then_exits_on_the_batch(completions, answer, **kw):
  scores = math_accuracy_reward(completions=completions, answer=answer)
  completions[:] = [f"\\boxed{{{a}}}" for a in answer]
  if len(completions) > 1:
    os._exit(3)  # in-process: abandoned, then retried row by row
  return scores


def test_in_process_a_retry_after_an_exit_sees_the_batch_as_it_came():
  with HostRewards([edits_then_exits_on_the_batch], decode=decode_chars,
                   lookup=EXAMPLES.__getitem__, num_workers=0) as host:
    out = host.compute(*boxed_batch())
  np.testing.assert_array_equal(out.rewards[:, 0], np.tile([1.0, 0.0], 8))
