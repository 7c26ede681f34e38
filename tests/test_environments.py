"""TRL 1.16's environment_factory (grpojax.tools.Environments): an instance per row, reset
with its example's columns before the rollout (its text joins the prompt), its methods
the row's own tools, its get_reward() a reward column; checked against prompts rendered
by hand, calls counted from the rollout's own tokens, and TRL-shaped runs end to end."""

import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import config as config_lib
from grpojax.data import get_task
from grpojax.data.pipeline import PromptIterator
from grpojax.models.tokenizers import HFTokenizer
from grpojax.rewards import resolve
from grpojax.tools import Environments, EnvironmentReward, ToolRunner, schema_tools
from test_tools import _frequent_eos
from tool_helpers import write_tool_tokenizer
from grpojax.run.settings import read as read_settings

TOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "experiments", "data", "tool_tokenizer")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return HFTokenizer(write_tool_tokenizer(str(tmp_path_factory.mktemp("tok"))))


class Wordle:
  """TRL's documented shape: reset(**row) takes the example's columns, the public
  methods are tools, get_reward() scores the episode from the state."""

  def reset(self, target: str, **unused) -> str:
    self.target, self.guesses = target, []
    return f" The word has {len(target)} letters."

  def guess(self, word: str) -> str:
    """Guesses the word.

    Args:
      word: the guess.

    Returns:
      Per letter: G right place, Y elsewhere in the word, - absent.
    """
    self.guesses.append(word)
    return "".join("G" if a == b else "Y" if a in self.target else "-"
                   for a, b in zip(word, self.target))

  def get_reward(self) -> float:
    return float(self.target in self.guesses) + 0.1 * len(self.guesses)


class Counter:
  """An environment with no text at reset and no reward of its own."""

  def reset(self, **unused):
    self.n = 0

  def tick(self) -> str:
    """Counts.
    """
    self.n += 1
    return str(self.n)


def _rows():
  return [{"prompt": [{"role": "user", "content": "Guess my word."}], "target": t}
          for t in ("cat", "horse", "ox")]


def test_each_row_is_reset_with_its_example_and_the_text_joins_its_prompt(tok):
  envs = Environments(Wordle, group_size=3, tools=schema_tools([Counter]))
  tok.row_tools = envs.schema
  rows = _rows()
  it = PromptIterator(rows, get_task("prompt"), tok, batch_size=2, max_prompt_length=1024,
                      seed=0, environments=envs)
  assert envs.columns([0, 1, -1])["environments"] == [None] * 3  # nothing reset yet
  batch = it.next()
  ids = batch["example_ids"].tolist()
  rows_envs = envs.columns(range(6))["environments"]
  assert len({id(e) for e in rows_envs}) == 6  # one instance per row
  for k, i in enumerate(ids):
    for e in rows_envs[3 * k:3 * k + 3]:
      assert e.target == rows[i]["target"] and e.guesses == []
    # By hand: the message with the reset's text, the schemas of the other tools and
    # the environment's methods, through the template.
    messages = [{"role": "user", "content": "Guess my word." +
                 f" The word has {len(rows[i]['target'])} letters."}]
    want = tok.encode(tok.hf.apply_chat_template(
        messages, tools=[*schema_tools([Counter]), Wordle().guess], tokenize=False,
        add_generation_prompt=True))
    got = batch["prompt_tokens"][k][batch["prompt_mask"][k] > 0].tolist()
    assert got == want
    assert it.lookup(i)["prompt"] == messages  # the reward functions' prompt
  # The next batch reuses the instances (construct once, reset often).
  it.next()
  it.next()
  assert {id(e) for e in envs._rows} <= {id(e) for e in envs._pool[None]}
  assert len(envs._pool[None]) == 6


class Dice:
  """Draws from the OS, which no seed reaches: a group's resets disagree."""

  def reset(self, **unused) -> str:
    return f" You rolled {int.from_bytes(os.urandom(4), 'little')}."


class Lottery:
  """Draws its problem from Python's and NumPy's global generators, as TRL's examples do."""

  def reset(self, **unused) -> str:
    return f" Your numbers: {random.randrange(1 << 30)} {np.random.randint(1 << 30)}."


def test_keyed_resets_draw_one_problem_per_group_and_put_the_generators_back():
  envs = Environments(Lottery, group_size=3)
  random.seed(7)
  np.random.seed(7)
  before = random.random(), np.random.random()
  random.seed(7)
  np.random.seed(7)
  rows = [{}, {}, {}]
  texts = envs.reset(rows, keys=[(0, 0, 0), (0, 0, 1), (0, 1, 0)])
  assert len(set(texts)) == 3  # each key its own draw, and the G = 3 resets of each agreed
  assert envs.reset(rows, keys=[(0, 0, 0), (0, 0, 1), (0, 1, 0)]) == texts  # reproducible
  assert (random.random(), np.random.random()) == before  # the caller's streams untouched
  with pytest.raises(ValueError, match="different text for the 3 rows of one prompt"):
    envs.reset(rows)  # unkeyed: each reset draws anew


def test_resets_of_one_group_that_disagree_are_refused(tok):
  envs = Environments(Dice, group_size=2)
  it = PromptIterator(_rows(), get_task("prompt"), tok, batch_size=1, max_prompt_length=1024,
                      seed=0, environments=envs)
  with pytest.raises(ValueError, match="different text for the 2 rows of one prompt"):
    it.next()


def test_a_dict_of_environments_routes_rows_and_shows_each_only_its_tools(tok):
  envs = Environments({"word": Wordle, "count": Counter}, group_size=1)
  word = {"environment": "word", "prompt": "x", "target": "ab"}
  count = {"environment": "count", "prompt": "y"}
  assert [f.__name__ for f in envs.schema(word)] == ["guess"]
  assert [f.__name__ for f in envs.schema(count)] == ["tick"]
  assert envs.reset([word, count]) == [" The word has 2 letters.", None]
  assert [type(e) for e in envs._rows] == [Wordle, Counter]
  assert EnvironmentReward(Wordle)([""] * 2, environments=envs._rows) == [0.0, None]
  with pytest.raises(ValueError, match="environment='dice', which is none of"):
    envs.reset([{"environment": "dice"}])
  with pytest.raises(ValueError, match="has no reset"):
    Environments(dict, group_size=1)


def _guess_all(text):
  return [{"name": "guess", "arguments": {"word": "cat"}}]


def test_a_rollouts_calls_reach_their_rows_own_environment_and_its_reward(tok):
  """Each row's get_reward counts the calls its own instance saw: equal to the tool
  responses in that row's tokens (the spans out of loss_mask), row by row. On a mesh
  of 4 row shards: each shard's engine and reward call hold one row of a group, and
  find that row's own instance (a shard's host call sees its rows' indices)."""
  from grpojax import models, ops
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.sampling import engine, strategies
  from grpojax.sampling.engine.turns import TurnHook
  from grpojax.train import rollout as rollout_lib
  from grpojax.train import state as state_lib
  from grpojax.train import strategy as strategy_lib
  import optax

  G, T = 2, 96
  model = models.build_model("tiny", seed=0)
  cfg, weights = ops.resolve(model.config), model.param_dict()
  rows = _rows()[:2]
  envs = Environments(Wordle, group_size=G)
  tok.row_tools = envs.schema
  it = PromptIterator(rows, get_task("prompt"), tok, batch_size=2, max_prompt_length=1024,
                      seed=0, environments=envs)
  local = it.next()
  # The two ids greedy decoding draws most, as EOS: the rows reach their calls often.
  _, eos = _frequent_eos(model, cfg, local["prompt_tokens"], local["prompt_mask"])
  runner = ToolRunner(tok, [], parse=_guess_all, environments=envs)
  hook = TurnHook(host=runner, eos=eos, max_calls=3, response_tokens=32)
  config = rollout_lib.RolloutConfig(
      group_size=G, max_new_tokens=T, sampling=strategies.SamplingParams(1.0), eos_ids=eos,
      pad_id=0, engine=engine.EngineConfig(slots=3, page_size=8), hook=hook)
  state = state_lib.create_train_state(cfg, weights, optax.sgd(0.1), with_reference=False)
  decode = lambda ids: [tok.decode(r, skip_special_tokens=False) for r in ids]  # noqa: E731
  seen = []

  def reads_environments(completions, environments, **unused):
    seen.extend(environments)
    said.extend(zip(completions, [len(e.guesses) for e in environments]))
    return [0.0] * len(completions)

  said = []

  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, devices=jax.devices()[:4])
  batch = mesh_lib.global_batch(local, mesh)
  # The iterator was drawn already: the rollout takes that batch (a dict source).
  with HostRewards([reads_environments, EnvironmentReward(Wordle)], decode=decode,
                   lookup=it.lookup, num_workers=0, row_columns=envs.columns,
                   conversation=runner.conversation) as host:
    rollout, metrics = strategy_lib.make("plain", config, host, num_prompts=2, mesh=mesh)(
        state, batch, jax.random.key(1))
  exists = np.asarray(rollout.mask) > 0
  untrained = exists & ~(np.asarray(rollout.loss_mask) > 0)
  spans = [int((untrained[r] & ~np.concatenate([[False], untrained[r, :-1]])).sum())
           for r in range(2 * G)]
  assert sum(spans) > 0 and metrics["tools/failure_frequency"] == 0
  assert [len(e.guesses) for e in envs._rows] == spans
  assert sorted(map(id, seen)) == sorted(map(id, envs._rows))  # live instances, not copies
  # Each row's completion reached the (conversational) reward as TRL's messages: one
  # guess call and its tool message per answered turn, the last turn at the end.
  for messages, guesses in said:
    assert [m["role"] for m in messages] == ["assistant", "tool"] * guesses + ["assistant"]
    assert all(m["tool_calls"][0]["function"]["name"] == "guess" for m in messages[:-1:2])
  target = [rows[i]["target"] for i in np.repeat(local["example_ids"], G)]
  want = [float(t == "cat" and n > 0) + 0.1 * n for t, n in zip(target, spans)]
  got = np.concatenate([call["rewards"][:, 1] for call in host.recent])  # shards: any order
  np.testing.assert_allclose(np.sort(got), np.sort(want), rtol=1e-6)
  # Row by row: the group advantages' signs (the reward is Wordle's alone).
  want = np.asarray(want).reshape(-1, G)
  np.testing.assert_array_equal(np.sign(np.asarray(rollout.advantages)).reshape(-1, G),
                                np.sign(np.round(want - want.mean(1, keepdims=True), 6)))
  assert metrics["rewards/Wordle/mean"] == pytest.approx(np.mean(want), rel=1e-6)


def test_eval_resets_its_own_rows_environments_and_scores_with_them(tok):
  """Eval with environments: each batch resets eval's own instances with its rows'
  columns (one per prompt for greedy, n for the samples, padding rows too), the reset's
  text joins the prompt the verifier sees, the turn loop calls those instances, and the
  verifier (here the environment's reward alone) reads them: accuracy and mean@n equal
  what the instances saw, worked out row by row."""
  from grpojax import models, ops
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.sampling import engine
  from grpojax.sampling.engine.turns import TurnHook
  from grpojax.train.evaluate import Evaluator

  model = models.build_model("tiny", seed=0)
  cfg, weights = ops.resolve(model.config), model.param_dict()
  rows = _rows()  # 3 prompts, batches of 2: the second is padded with the first row
  envs = Environments(Wordle, group_size=4)  # the run's G; eval resets 1 and n per prompt
  tok.row_tools = envs.schema
  first = PromptIterator(rows, get_task("prompt"), tok, batch_size=2, max_prompt_length=1024,
                         seed=0, environments=Environments(Wordle, group_size=1)).next()
  _, eos = _frequent_eos(model, cfg, first["prompt_tokens"], first["prompt_mask"])
  hook = TurnHook(host=ToolRunner(tok, [], parse=_guess_all, environments=envs), eos=eos,
                  max_calls=2, response_tokens=32)
  seen = []

  def verifier(completions, prompts, environments, **unused):
    # A snapshot: the pool's instances are reset again by the next batch.
    seen.append((list(prompts), [(e.target, list(e.guesses), id(e)) for e in environments]))
    return [float(e.target in e.guesses) for e in environments]

  evaluator = Evaluator(rows, get_task("prompt"), tok, batch_size=2, max_prompt_length=1024,
                        max_new_tokens=48, ks=(2,), n=2,
                        engine=engine.EngineConfig(slots=3, page_size=8), hook=hook,
                        environments=envs)
  with HostRewards([verifier], decode=lambda ids: [tok.decode(r) for r in ids],
                   lookup=lambda i: rows[i], num_workers=0) as host:
    evaluator.rewards = host
    metrics = evaluator(cfg, weights, jax.random.key(0))

  # Two greedy batches (2 rows, then 1 scored and 1 padding), two sampled (4, then 2 of 4).
  assert [len(p) for p, _ in seen] == [2, 1, 4, 2]
  correct = []
  for prompts, lives in seen:
    for prompt, (target, guesses, _) in zip(prompts, lives):
      assert prompt == [{"role": "user", "content":
                         f"Guess my word. The word has {len(target)} letters."}]
      correct.append(target in guesses)
    assert len({e[2] for e in lives}) == len(lives)  # one instance per row
  # The rows in order: greedy then samples, each prompt-major.
  assert [e[0] for _, lives in seen for e in lives] == [
      "cat", "horse", "ox", "cat", "cat", "horse", "horse", "ox", "ox"]
  assert metrics["eval/accuracy"] == pytest.approx(np.mean(correct[:3]))
  assert metrics["eval/mean@2"] == pytest.approx(np.mean(correct[3:]))
  assert any(e[1] for _, lives in seen for e in lives)  # the tools did run
  assert 0 < np.mean(correct) < 1  # both outcomes occur: the check can tell them apart


class OwnWordle(Wordle):
  """An environment that owns the data (TRL's run without a train_dataset): reset()
  draws the word and its text is the whole prompt; given a `target` column (eval's
  rows), it takes that one."""

  def reset(self, target: str | None = None, **unused) -> str:
    drawn = target or random.choice(["cat", "horse", "ox", "emu"])
    self.drawn = drawn
    return "Guess my word." + super().reset(drawn)


@pytest.mark.slow
def test_trls_environment_factory_runs_through_the_python_api(tmp_path):
  """No train_dataset (the environment owns the data: each step draws its words, a
  group's G resets agree) and eval on given rows, with the environment's reward as the
  verifier."""
  import grpojax
  from grpojax.train import metrics as metrics_lib

  rows = [{"prompt": [{"role": "user", "content": ""}], "target": t} for t in ("cat", "horse")]
  args = grpojax.GRPOConfig(max_steps=1, per_device_train_batch_size=8, num_generations=2,
                            max_completion_length=32, output_dir=str(tmp_path / "run"),
                            config={"model.arch": "tiny", "rollout.max_prompt_length": 512})
  with pytest.raises(config_lib.ConfigError, match="give a train_dataset with one"):
    grpojax.GRPOTrainer(model="tiny", reward_funcs=None, args=args, processing_class=TOK_DIR,
                        environment_factory={"a": OwnWordle, "b": OwnWordle})
  drawn = []

  def factory():
    env = OwnWordle()
    reset = env.reset
    env.reset = lambda **row: (reset(**row), drawn.append((env.drawn, "target" in row)))[0]
    return env

  trainer = grpojax.GRPOTrainer(model="tiny", reward_funcs=None, args=args, eval_dataset=rows,
                                processing_class=TOK_DIR, environment_factory=factory)
  assert trainer.config.rollout.environment == "__main__:factory"
  trainer.train()
  # Training resets come in groups of G = 2 that agree; the prompts' draws are not all one.
  train = [word for word, given in drawn if not given]
  groups = [train[i:i + 2] for i in range(0, len(train), 2)]
  assert len(groups) == 4  # one step of 4 prompts
  assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) > 1, groups
  assert {word for word, given in drawn if given} == {"cat", "horse"}  # eval's rows
  last = metrics_lib.read_metrics(str(tmp_path / "run"))[-1]
  # get_reward is the run's reward: 0.1 per guess, 1 for the word; a tiny random model
  # rarely calls, so the mean is that of what its rows did, at least 0.
  assert "rewards/OwnWordle/mean" in last and last["rewards/OwnWordle/mean"] >= 0.0
  assert "tools/call_frequency" in last
  # Eval ran the same environment: its reward is the verifier (a word guessed: correct).
  assert 0.0 <= last["eval/accuracy"] <= 1.0


@pytest.mark.parametrize("override,words", [
    ({"rollout.environment": "no_such_module:Env"}, "cannot import 'no_such_module:Env'"),
    ({"rollout.environment": "a=x:Y,x:Z"}, "several as name=module:Class"),
    ({"rewards.num_workers": 2}, "must be 0 with rollout.environment"),
    ({"rollout.engine": "lockstep"}, "rollout.engine='paged'"),
])
def test_environment_configs_refused_in_one_line(override, words):
  from grpojax.train import wiring

  cfg = config_lib.apply(config_lib.get_config(), {
      "rollout.environment": "test_environments:Wordle", "eval.num_prompts": 0, **override})
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg)
    wiring.run_environments(read_settings(cfg))
  assert words in str(e.value) and "\n" not in str(e.value)


def test_an_environment_without_reward_and_no_reward_functions_is_refused():
  from grpojax.train import wiring

  cfg = config_lib.validate(config_lib.apply(config_lib.get_config(), {
      "task.name": "prompt", "task.dataset": os.path.abspath(os.sep), "eval.num_prompts": 0,
      "rollout.environment": "test_environments:Counter"}))
  task = wiring.run_task(read_settings(cfg))
  with pytest.raises(config_lib.ConfigError, match="has no get_reward"):
    wiring.run_rewards(read_settings(cfg), task, wiring.run_environments(read_settings(cfg)))


def test_a_dict_factory_is_named_on_the_command_line_and_imported_back():
  from grpojax import api

  entries, own = api._environment_paths({"word": Wordle, "count": lambda: Counter()})
  assert entries[0] == "word=test_environments:Wordle" and entries[1].startswith("count=__main__:")
  resolve.IN_PROCESS_TOOLS.update(own)
  cfg = config_lib.validate(config_lib.apply(config_lib.get_config(), {
      "rollout.environment": ",".join(entries), "eval.num_prompts": 0}))
  got = resolve.environment_factories(read_settings(cfg).rollout.environment)
  assert got["word"] is Wordle and type(got["count"]()) is Counter
  with pytest.raises(config_lib.ConfigError, match="must be a word"):
    api._environment_paths({"a b": Wordle})


def test_the_start_check_runs_with_no_episode_reset_yet():
  from grpojax.rewards.runtime.host import HostRewards

  envs = Environments(Wordle, group_size=2)
  seen = []

  def reads(completions, environments, **unused):
    seen.extend(environments)
    return [0.0] * len(completions)

  with HostRewards([reads, EnvironmentReward(Wordle)], decode=lambda ids: [""] * len(ids),
                   lookup=lambda i: {"prompt": "x", "target": "ab"}, num_workers=0,
                   row_columns=envs.columns) as host:
    host.probe([0, 1])  # rewards.check_at_start: before any rollout
  assert seen == [None, None]
