"""Multi-turn tool rollouts (sampling/engine/turns.py, grpojax/tools.py): a row pauses at
its tool call, the host runs the call, the template's response joins the row by ids,
untrained, and the row answers; checked against uncached decoding under the same
rule, token for token, whatever the slots, pages and preemptions."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models, ops
from grpojax.models.tokenizers import HFTokenizer
from grpojax.sampling import engine, strategies
from grpojax.sampling.engine.turns import TurnHook
from grpojax.tools import PythonTool, ToolRunner, parse_calls, schema_tools
from tool_helpers import write_tool_tokenizer
from grpojax.run.settings import read as read_settings

G, T = 2, 128
GREEDY = strategies.SamplingParams(0.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return HFTokenizer(write_tool_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def tiny():
  m = models.build_model("tiny", seed=0)
  return m, ops.resolve(m.config), m.param_dict()


class Counter:
  """A tool with state of its own per row: each call returns how many calls came before."""

  def __init__(self):
    self.n = 0

  def count(self) -> str:
    """Counts this row's calls.
    """
    self.n += 1
    return f"call {self.n}"


def _always_count(text):
  return [{"name": "count", "arguments": {}}]


def _prompts(tok):
  texts = ["<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
  ids = [tok.encode(t) for t in texts]
  P = max(map(len, ids))
  tokens = np.array([[0] * (P - len(i)) + i for i in ids], np.int32)
  return jnp.asarray(tokens), jnp.asarray(tokens != 0).astype(jnp.int32) | (
      jnp.arange(P)[None] >= P - np.array([[len(i)] for i in ids]))


def _reference(model, prompts, eos, response, max_calls):
  """Per prompt: (tokens, trained, calls run) of uncached greedy decoding where each EOS
  the model draws, while it has calls left and room, is followed by response(k) for its
  k-th call (a call whose response would not fit runs, and its row ends)."""
  forward = jax.jit(model)
  out = []
  for p in prompts:
    seq, trained, calls = list(p), [], 0
    width = len(p) + T
    while len(seq) - len(p) < T:
      logits = forward(jnp.array([seq + [0] * (width - len(seq))]))
      token = int(jnp.argmax(logits[0, len(seq) - 1]))
      seq.append(token)
      trained.append(True)
      n = len(seq) - len(p)
      if token in eos:
        if calls == max_calls or n >= T:
          break
        calls += 1
        ids = response(calls)
        if n + len(ids) > T:
          break  # TRL rolls back a response past the budget: the row ends at its EOS
        seq += ids
        trained += [False] * len(ids)
    out.append((seq[len(p):], trained, calls))
  return out


def _frequent_eos(model, cfg, tokens, mask):
  """(the prompts' ids, an EOS of the two tokens greedy decoding of them draws most): so
  that the rows reach their calls often."""
  prompts = [[int(t) for t, m in zip(tokens[b], mask[b]) if m] for b in range(tokens.shape[0])]
  plain = _reference(model, prompts, (), lambda k: [], 0)
  counts = np.bincount(np.concatenate([s for s, _, _ in plain]), minlength=cfg.vocab_size)
  return prompts, tuple(int(i) for i in np.argsort(-counts)[:2])


@pytest.mark.parametrize("ec,shards", [
    (engine.EngineConfig(slots=3, page_size=4, pages=40), 1),
    (engine.EngineConfig(page_size=8, tail_slots=(2,)), 1),
    # An engine per prompt, each asking the one host for its own rows.
    (engine.EngineConfig(slots=4, page_size=4, pages=40), 2),
], ids=["preempt", "tail", "row-shards"])
def test_three_tool_turns_equal_uncached_decoding_under_the_same_rule(tok, tiny, ec, shards):
  model, cfg, weights = tiny
  tokens, mask = _prompts(tok)
  prompts, eos = _frequent_eos(model, cfg, tokens, mask)
  runner = ToolRunner(tok, [Counter], parse=_always_count)
  response = lambda k: runner.response_ids([{"role": "tool", "name": "count",  # noqa: E731
                                             "content": f"call {k}"}])
  want = _reference(model, prompts, eos, response, max_calls=3)
  assert max(sum(1 for i in range(1, len(t)) if t[i - 1] and not t[i]) for _, t, _ in want) == 3
  hook = TurnHook(host=runner, eos=eos, max_calls=3, response_tokens=32, handoff=2)
  runner.begin()
  mesh = None
  if shards > 1:
    devices = np.array(jax.devices()[:shards]).reshape(shards, 1, 1)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
    assert engine.row_shards(mesh, 2) == shards
  out, stats = engine.generate(cfg, weights, tokens, mask, rng=jax.random.key(0), num_samples=G,
                               max_new_tokens=T, sampling=GREEDY, eos_ids=eos, pad_id=0,
                               engine=ec, with_stats=True, hook=hook, mesh=mesh)
  got_tokens, got_mask = np.asarray(out.tokens), np.asarray(out.mask)
  loss_mask = np.asarray(out.loss_mask)
  for r in range(4):
    ref, trained, _ = want[r // G]
    n = len(ref)
    np.testing.assert_array_equal(got_tokens[r, :n], ref, err_msg=f"row {r}")
    assert got_mask[r].sum() == n, f"row {r}"
    np.testing.assert_array_equal(loss_mask[r, :n].astype(bool), trained, err_msg=f"row {r}")
    assert not np.asarray(out.logps)[r][:n][~np.array(trained)].any()
  # Each (row, turn) ran once, whatever the preemptions: the counter's state per row.
  assert runner.calls == sum(calls for _, _, calls in want) * G
  if ec.pages and shards == 1:
    assert int(stats.preempted) > 0


def test_the_response_is_joined_by_ids_not_by_retokenising(tok):
  runner = ToolRunner(tok, [Counter])
  ids = runner.response_ids([{"role": "tool", "name": "count", "content": "call 1"}])
  # The ids after the assistant's EOS: the template's tool turn and the next header.
  assert tok.decode(ids, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\ncall 1\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n")
  # A turn's ids that a round trip through text would change: special-token text the
  # model spelled out character by character encodes back as one id.
  spelled = tok.encode("<") + tok.encode("tool_call") + tok.encode(">")
  assert tok.encode(tok.decode(spelled, skip_special_tokens=False)) != spelled


def test_calls_parse_in_hermes_syntax_and_bad_ones_become_errors():
  text = ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
          '<tool_call>\n{"name": "g", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
          '<tool_call>\nnot json\n</tool_call>')
  calls = parse_calls(text)
  assert calls[:2] == [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": 2}}]
  assert "does not parse" in calls[2]["error"]
  assert parse_calls("no call here") == []


def _call(name, **arguments):
  return ('<tool_call>\n' + json.dumps({"name": name, "arguments": arguments})
          + '\n</tool_call><|im_end|>')


def _content(tok, ids):
  text = tok.decode(ids, skip_special_tokens=False)
  return text.split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0]


def test_a_failing_tool_ends_its_turn_with_an_error_and_never_the_run(tok):
  def hangs() -> str:
    """Never returns."""
    import time
    time.sleep(60)

  def raises(x: int) -> str:
    """Raises.

    Args:
      x: anything.
    """
    raise KeyError("no such key")

  def floods() -> str:
    """Returns 10 MB."""
    return "a" * 10_000_000

  def exits() -> str:
    """Exits the process the way a careless tool might."""
    raise SystemExit(3)

  runner = ToolRunner(tok, [hangs, raises, floods, exits], timeout_s=0.5, response_tokens=300)
  answer = lambda text, row=0: runner._answer((row, 0), tok.encode(text), 10, 1000)  # noqa: E731
  assert "did not return within 0.5 s" in _content(tok, answer(_call("hangs")))
  assert "KeyError" in _content(tok, answer(_call("raises", x=1)))
  assert "not found" in _content(tok, answer(_call("nope")))
  flood = answer(_call("floods"))
  assert len(flood) <= 300 and "[cut" in _content(tok, flood)
  assert "SystemExit" in _content(tok, answer(_call("exits")))
  assert runner.calls == 5 and runner.failures == 4
  # A response past the row's budget is rolled back: the row ends (None).
  assert runner._answer((1, 0), tok.encode(_call("raises", x=1)), 990, 1000) is None


def test_a_tool_using_completion_reaches_conversational_rewards_as_trls_messages(tok):
  """TRL 1.16 hands a conversational reward function a tool-using completion as the
  messages its turn loop built: each turn an assistant message with its parsed
  `tool_calls`, then the "tool" messages, the last turn at the end. Built here by hand
  from a scripted 3-turn row, and compared with what a reward function receives."""
  from grpojax.rewards.runtime.host import HostRewards

  def multiply(a: int, b: int) -> int:
    """Multiplies.

    Args:
      a: one factor.
      b: the other.
    """
    return a * b

  runner = ToolRunner(tok, [multiply])
  first = tok.encode("Let me compute. " + _call("multiply", a=3, b=4))
  completion = first + runner._answer((0, 0), first, len(first), 1000)
  second = tok.encode(_call("multiply", a=12, b=2))
  completion += second
  completion += runner._answer((0, 1), second, len(completion), 1000)
  completion += tok.encode("So 24.<|im_end|>")
  call = lambda a, b: {"type": "function", "function": {  # noqa: E731
      "name": "multiply", "arguments": {"a": a, "b": b}}}
  want = [{"role": "assistant", "content": "Let me compute.", "tool_calls": [call(3, 4)]},
          {"role": "tool", "name": "multiply", "content": "12"},
          {"role": "assistant", "content": "", "tool_calls": [call(12, 2)]},
          {"role": "tool", "name": "multiply", "content": "24"},
          {"role": "assistant", "content": "So 24."}]
  assert runner.conversation(0, completion) == want
  assert runner.conversation(1, completion) is None  # a row that made no call

  seen = []

  def reads(completions, **unused):
    seen.extend(completions)
    return [0.0] * len(completions)

  plain = tok.encode("No tools.<|im_end|>")
  tokens = np.zeros((2, len(completion)), np.int32)
  mask = np.zeros((2, len(completion)), np.int32)
  for r, ids in enumerate((completion, plain)):
    tokens[r, :len(ids)], mask[r, :len(ids)] = ids, 1
  with HostRewards([reads], decode=lambda rows: [tok.decode(r) for r in rows],
                   lookup=lambda i: {"prompt": [{"role": "user", "content": "3 * 4 * 2?"}]},
                   num_workers=0, conversation=runner.conversation) as host:
    host.compute([0, 0], tokens, mask, rows=[0, 1])
    assert seen == [want, [{"role": "assistant", "content": tok.decode(plain)}]]
    host.compute([0], tokens[:1], mask[:1], rows=[1])  # row 1 of the rollout made no call
    assert seen[-1] == [{"role": "assistant", "content": tok.decode(completion)}]
  # A new rollout keeps nothing of the last one's turns.
  runner.begin()
  assert runner.conversation(0, completion) is None


@pytest.mark.slow
def test_the_python_tool_keeps_a_rows_state_and_nothing_between_rows(tok):
  runner = ToolRunner(tok, [PythonTool])
  answer = lambda code, row: _content(tok, runner._answer((row, 0), tok.encode(  # noqa: E731
      _call("python", code=code)), 10, 2000))
  assert answer("x = 6\nx * 7", 0) == "42"
  assert answer("print(x + 1)", 0) == "7"
  assert "NameError" in answer("print(x)", 1)  # another row's interpreter
  assert "exited with status 3" in answer("import os; os._exit(3)", 0)
  assert "did not finish" in answer("while True: pass", 0)
  assert answer("x", 0) == "6"  # the calls that ended their interpreter left no trace
  assert "schema" not in str(schema_tools([PythonTool])[0].__doc__)


@pytest.mark.slow
def test_tool_tokens_exist_but_are_never_trained_through_the_rollout_and_update(tok, tiny):
  import optax

  from grpojax.core import losses
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.train import rollout as rollout_lib
  from grpojax.train import state as state_lib
  from grpojax.train import step as step_lib
  from grpojax.train import strategy as strategy_lib

  model, cfg, weights = tiny
  tokens, mask = _prompts(tok)
  _, eos = _frequent_eos(model, cfg, tokens, mask)
  runner = ToolRunner(tok, [Counter], parse=_always_count)
  hook = TurnHook(host=runner, eos=eos, max_calls=2, response_tokens=32)
  examples = {i: {"prompt": str(i)} for i in range(2)}

  def length(completions, **unused):
    return [float(len(c)) for c in completions]

  config = rollout_lib.RolloutConfig(
      group_size=G, max_new_tokens=T, sampling=strategies.SamplingParams(1.0), eos_ids=eos,
      pad_id=0, with_old_logps=True, engine=engine.EngineConfig(slots=3, page_size=8), hook=hook)
  state = state_lib.create_train_state(cfg, weights, optax.sgd(0.1), with_reference=False)
  batch = {"prompt_tokens": tokens, "prompt_mask": mask,
           "example_ids": jnp.arange(2, dtype=jnp.int32)}
  decode = lambda rows: [tok.decode(r, skip_special_tokens=False) for r in rows]  # noqa: E731
  with HostRewards([length], decode=decode, lookup=examples.__getitem__, num_workers=0) as host:
    rollout, metrics = strategy_lib.make("plain", config, host, num_prompts=2)(
        state, batch, jax.random.key(1))
  assert metrics["tools/call_frequency"] > 0 and metrics["tools/failure_frequency"] == 0
  got, exists = np.asarray(rollout.tokens), np.asarray(rollout.mask) > 0
  trained = np.asarray(rollout.loss_mask) > 0
  untrained = exists & ~trained
  assert untrained.any() and trained.any()
  # Every untrained span is the template's response to that row's k-th call.
  for r in range(got.shape[0]):
    starts = np.flatnonzero(untrained[r] & ~np.concatenate([[False], untrained[r, :-1]]))
    for k, s in enumerate(starts, start=1):
      want = runner.response_ids([{"role": "tool", "name": "count", "content": f"call {k}"}])
      n = min(len(want), T - s)
      np.testing.assert_array_equal(got[r, s:s + n], want[:n])
      assert got[r, s - 1] in eos and trained[r, s - 1]  # the model's own EOS is trained
  # The update reads nothing of the tool tokens but their presence.
  kw = dict(loss_config=losses.LossConfig(loss_type="dapo"), group_size=G)
  step = lambda r: step_lib.update(jax.tree.map(jnp.copy, state), r, jax.random.key(2),  # noqa: E731
                                  **kw)[0].params
  gap = lambda a, b: max(jax.tree.leaves(jax.tree.map(  # noqa: E731
      lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))
  base = step(rollout)
  garbled = step(rollout.replace(old_logps=jnp.where(jnp.asarray(untrained), 5.0,
                                                     rollout.old_logps)))
  changed = step(rollout.replace(old_logps=jnp.where(jnp.asarray(trained),
                                                     rollout.old_logps - 0.5, rollout.old_logps)))
  assert gap(base, garbled) == 0.0
  assert gap(base, changed) > 0.0


def multiply(a: int, b: int) -> int:
  """Multiplies two integers (TRL's documented example tool).

  Args:
    a: The first integer.
    b: The second integer.

  Returns:
    The product of the two integers.
  """
  return a * b


@pytest.mark.slow
def test_trls_tools_argument_runs_through_the_python_api(tok, tmp_path):
  import grpojax
  from grpojax.train import metrics as metrics_lib

  tok_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments", "data", "tool_tokenizer")
  rows = [{"prompt": [{"role": "user", "content": f"{a} times 7?"}]} for a in range(4)]

  def reward_len(completions, **kw):
    return [float(len(c)) for c in completions]

  args = grpojax.GRPOConfig(max_steps=1, per_device_train_batch_size=8, num_generations=4,
                            max_completion_length=64, max_tool_calling_iterations=2,
                            output_dir=str(tmp_path / "run"),
                            config={"model.arch": "tiny", "rollout.max_prompt_length": 512})
  trainer = grpojax.GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args,
                                train_dataset=rows, processing_class=tok_dir, tools=[multiply])
  assert trainer.config.rollout.tools == "test_tools:multiply"
  assert trainer.config.rollout.max_tool_calling_iterations == 2
  trainer.train()
  written = metrics_lib.read_metrics(str(tmp_path / "run"))
  assert {"tools/call_frequency", "tools/failure_frequency"} <= set(written[-1])


def test_the_shipped_tool_tokenizer_is_the_one_the_helper_writes(tmp_path):
  shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments", "data", "tool_tokenizer")
  fresh = write_tool_tokenizer(str(tmp_path))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(shipped, name)) as a, open(os.path.join(fresh, name)) as b:
      assert json.load(a) == json.load(b), name


@pytest.mark.parametrize("override,words", [
    ({"rollout.tools": "no_such_module:tool"}, "cannot import 'no_such_module:tool'"),
    ({"rollout.tools": "tool"}, "must be an import path"),
    ({"rollout.engine": "lockstep"}, "rollout.engine='paged'"),
    ({"rollout.max_staleness": 1}, "rollout.max_staleness=0"),
    ({"rollout.dynamic_sampling": True}, "rollout.dynamic_sampling=False"),
    ({"rollout.max_tool_calling_iterations": -2}, "must be an int >= 0, or -1"),
])
def test_tool_configs_refused_in_one_line(override, words):
  from grpojax import config as config_lib
  from grpojax.train import wiring

  cfg = config_lib.apply(config_lib.get_config(), {"rollout.tools": "test_tools:multiply",
                                                   **override})
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg)
    wiring.tool_hook(read_settings(cfg), None)
  assert words in str(e.value) and "\n" not in str(e.value)


def test_tools_need_a_template_that_renders_them():
  from grpojax import config as config_lib
  from grpojax.train import wiring

  cfg = config_lib.apply(config_lib.get_config(), {"rollout.tools": "test_tools:multiply"})
  with pytest.raises(config_lib.ConfigError, match="renders tools"):
    wiring.run_tokenizer(read_settings(cfg))  # the character tokenizer has no template


def test_async_tools_are_awaited_as_trls_are(tok):
  async def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
      a: The first integer.
      b: The second integer.
    """
    import asyncio
    await asyncio.sleep(0.01)
    return a + b

  runner = ToolRunner(tok, [add])
  ids = runner._answer((0, 0), tok.encode(_call("add", a=2, b=40)), 10, 1000)
  assert _content(tok, ids) == "42" and runner.failures == 0


def test_a_tool_in_a_process_of_its_own_cannot_end_or_hang_the_run(tok):
  def exits() -> str:
    """Ends its process."""
    os._exit(7)

  def hangs() -> str:
    """Never returns."""
    while True:
      pass

  def floods() -> str:
    """Returns 10 MB."""
    return "a" * 10_000_000

  runner = ToolRunner(tok, [exits, hangs, floods, multiply], timeout_s=2.0,
                      response_tokens=300, isolation="process")
  answer = lambda text: _content(tok, runner._answer((0, 0), tok.encode(text), 10, 1000))  # noqa: E731
  assert "exited with status 7" in answer(_call("exits"))
  assert "did not return within 2 s" in answer(_call("hangs"))
  assert "[cut" in answer(_call("floods"))
  assert answer(_call("multiply", a=6, b=7)) == "42"
  assert runner.calls == 4 and runner.failures == 2


def test_only_an_eos_after_the_calls_closing_ids_in_its_turn_asks_the_host():
  """TurnHook.draw on hand-made rows: the closing ids (two here) must end in the turn,
  in order, before its EOS; an EOS without them, or with them split by the turn's
  start, ends the row."""
  EOS, A, B = 9, 5, 6
  hook = TurnHook(host=None, eos=(EOS,), call_end=(A, B), max_calls=2, response_tokens=4)
  tokens = jnp.array([[1, A, B, 2, 0, 0],    # closed, then EOS at 4: asks
                      [1, A, 3, B, 0, 0],    # A and B apart: no call
                      [A, B, 2, 2, 0, 0],    # closed before its turn began (at 2)
                      [1, 2, 3, A, 0, 0]],   # B drawn now, EOS later
                     jnp.int32)
  from grpojax.sampling.engine.hooks import Drawn, Rows
  state = hook.init(4, 1)
  state = state.replace(turn_start=jnp.array([0, 0, 2, 0], jnp.int32),
                        closed=jnp.array([True, False, False, False]))
  rows = Rows(tokens=tokens, length=jnp.full((4,), 4, jnp.int32), status=jnp.ones(4, jnp.int32),
              eos=jnp.zeros(4, bool), slot_row=jnp.arange(4, dtype=jnp.int32),
              step=jnp.zeros((), jnp.int32))
  drawn = Drawn(row=jnp.arange(4, dtype=jnp.int32), position=jnp.full((4,), 4, jnp.int32),
                token=jnp.array([EOS, EOS, EOS, B], jnp.int32), active=jnp.ones(4, bool))
  state, token, forced = hook.draw(state, rows, drawn)
  assert not np.asarray(forced).any()
  np.testing.assert_array_equal(np.asarray(state.asked), [True, False, False, False])
  np.testing.assert_array_equal(np.asarray(hook.goes_on(state, drawn)), [True, False, False, False])
  np.testing.assert_array_equal(np.asarray(state.closed), [True, False, False, True])


def test_a_response_the_template_alone_overfills_ends_the_row(tok):
  def long() -> str:
    """Returns a long text."""
    return "x" * 500

  runner = ToolRunner(tok, [long], response_tokens=20)  # the template takes ~30 ids
  assert runner._answer((0, 0), tok.encode(_call("long")), 10, 1000) is None
  assert runner.calls == 1 and runner.turns == 0
