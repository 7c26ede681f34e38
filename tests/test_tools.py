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


@pytest.mark.parametrize("ec", [
    engine.EngineConfig(slots=3, page_size=4, pages=40),
    engine.EngineConfig(page_size=8, tail_slots=(2,)),
], ids=["preempt", "tail"])
def test_three_tool_turns_equal_uncached_decoding_under_the_same_rule(tok, tiny, ec):
  model, cfg, weights = tiny
  tokens, mask = _prompts(tok)
  prompts = [[int(t) for t, m in zip(tokens[b], mask[b]) if m] for b in range(2)]
  # EOS: tokens greedy decoding of these prompts draws often, so rows reach 3 calls.
  plain = _reference(model, prompts, (), lambda k: [], 0)
  counts = np.bincount(np.concatenate([s for s, _, _ in plain]), minlength=cfg.vocab_size)
  eos = tuple(int(i) for i in np.argsort(-counts)[:2])
  runner = ToolRunner(tok, [Counter], parse=_always_count)
  response = lambda k: runner.response_ids([{"role": "tool", "name": "count",  # noqa: E731
                                             "content": f"call {k}"}])
  want = _reference(model, prompts, eos, response, max_calls=3)
  assert max(sum(1 for i in range(1, len(t)) if t[i - 1] and not t[i]) for _, t, _ in want) == 3
  hook = TurnHook(host=runner, eos=eos, max_calls=3, response_tokens=32, handoff=2)
  runner.begin()
  out, stats = engine.generate(cfg, weights, tokens, mask, rng=jax.random.key(0), num_samples=G,
                               max_new_tokens=T, sampling=GREEDY, eos_ids=eos, pad_id=0,
                               engine=ec, with_stats=True, hook=hook)
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
  if ec.pages:
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
  answer = lambda text, row=0: runner._answer(row, tok.encode(text), 10, 1000)  # noqa: E731
  assert "did not return within 0.5 s" in _content(tok, answer(_call("hangs")))
  assert "KeyError" in _content(tok, answer(_call("raises", x=1)))
  assert "not found" in _content(tok, answer(_call("nope")))
  flood = answer(_call("floods"))
  assert len(flood) <= 300 and "[cut" in _content(tok, flood)
  assert "SystemExit" in _content(tok, answer(_call("exits")))
  assert runner.calls == 5 and runner.failures == 4
  # A response past the row's budget is rolled back: the row ends (None).
  assert runner._answer(1, tok.encode(_call("raises", x=1)), 990, 1000) is None


@pytest.mark.slow
def test_the_python_tool_keeps_a_rows_state_and_nothing_between_rows(tok):
  runner = ToolRunner(tok, [PythonTool])
  answer = lambda code, row: _content(tok, runner._answer(row, tok.encode(  # noqa: E731
      _call("python", code=code)), 10, 2000))
  assert answer("x = 6\nx * 7", 0) == "42"
  assert answer("print(x + 1)", 0) == "7"
  assert "NameError" in answer("print(x)", 1)  # another row's interpreter
  assert "exited with status 3" in answer("import os; os._exit(3)", 0)
  assert "did not finish" in answer("while True: pass", 0)
  assert answer("x", 0) == "6"  # the calls that ended their interpreter left no trace
  assert "schema" not in str(schema_tools([PythonTool])[0].__doc__)
