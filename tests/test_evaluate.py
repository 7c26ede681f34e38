"""Eval's estimators against brute force over every k-subset (pass@k, maj@k), by hand
(mean@n), the tasks' answer keys, eval.k / eval.n / eval.sets validation, and the
metric names of several eval sets through a tiny run."""

import collections
import itertools
import json
import math
import random

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from grpojax import config
from grpojax.data import tasks
from grpojax.default_experiment import get_config as arithmetic_config
from grpojax.train import checkpoint as checkpoint_lib
from grpojax.train import evaluate
from grpojax.train import loop
from grpojax.run.settings import read as read_settings





def brute_pass_at_k(n, c, k):
  correct = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(correct, k))
  return sum(any(s) for s in subsets) / len(subsets)


def brute_maj_at_k(keys, correct, k):
  """The vote of each k-subset, as maj_at_k documents it, counted one by one."""
  right = collections.defaultdict(bool)
  for key, ok in zip(keys, correct):
    if key is not None:
      right[key] |= ok
  wins = []
  for subset in itertools.combinations(range(len(keys)), k):
    votes = collections.Counter(keys[i] for i in subset if keys[i] is not None)
    top = max(votes.values(), default=0)
    wins.append(bool(votes) and all(right[a] for a, m in votes.items() if m == top))
  return sum(wins) / len(wins)


# ------------------------------------------------------------------ pass@k


def test_pass_at_k_by_hand():
  # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6.
  assert evaluate.pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
  assert evaluate.pass_at_k(4, 0, 2) == 0.0
  assert evaluate.pass_at_k(4, 3, 2) == 1.0  # n - c < k: every pair holds a correct one
  assert evaluate.pass_at_k(5, 1, 1) == pytest.approx(1 / 5)  # pass@1 is c/n


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in (1, 2, 5, 8) for c in range(n + 1)
                                     for k in range(1, n + 1)])
def test_pass_at_k_equals_enumerating_every_k_subset(n, c, k):
  assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_a_float():
  n, c, k = 2000, 7, 600  # C(2000, 600) ~ 1e522
  exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python's exact integers, then one division
  assert evaluate.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)


# ------------------------------------------------------------------ maj@k


def test_maj_at_k_by_hand():
  # Two votes for the right "7", one for a wrong "3", one sample with no answer.
  keys, correct = ["7", "7", "3", None], [True, True, False, False]
  # k=1: 2 of the 4 samples vote rightly. k=2: of the 6 pairs, {7,7}, {7,None} x2 win;
  # {7,3} x2 tie (wrong); {3,None} loses. k=3: {7,7,3}, {7,7,None} win; {7,3,None} x2
  # tie. k=4: 7 has 2 votes against 1.
  assert [evaluate.maj_at_k(keys, correct, k) for k in (1, 2, 3, 4)] == pytest.approx(
      [2 / 4, 3 / 6, 2 / 4, 1.0])
  # No answer anywhere, or no right answer: 0.
  assert evaluate.maj_at_k([None, None], [False, False], 2) == 0.0
  assert evaluate.maj_at_k(["1", "2", "2"], [False, False, False], 3) == 0.0
  # Two right forms tied at the top (1/2 and 0.5 as different keys): right.
  assert evaluate.maj_at_k(["a", "b", "c"], [True, True, False], 2) == pytest.approx(1 / 3)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    evaluate.maj_at_k(["a"], [True], 2)


def test_maj_at_k_equals_enumerating_every_k_subset():
  rng = random.Random(0)
  for _ in range(150):
    n = rng.randint(1, 9)
    keys = [rng.choice(["a", "b", "c", "d", None]) for _ in range(n)]
    good = set(rng.sample("abcd", rng.randint(0, 2)))
    # A right answer's samples are all scored right but one in four (a failed verifier
    # call): one is enough to make the answer right.
    correct = [k in good and rng.random() > 0.25 for k in keys]
    for k in range(1, n + 1):
      assert evaluate.maj_at_k(keys, correct, k) == pytest.approx(
          brute_maj_at_k(keys, correct, k), abs=1e-12), (keys, correct, k)


def test_maj_at_k_holds_its_precision_for_many_samples():
  # Too many subsets to enumerate: the ends, which need none. k=1 is the answered
  # fraction that is right; k=n is the one vote of all samples.
  rng = random.Random(1)
  keys = [str(rng.randint(0, 3)) for _ in range(1000)]
  right = collections.Counter(keys).most_common()
  correct = [k == right[0][0] for k in keys]
  assert evaluate.maj_at_k(keys, correct, 1) == pytest.approx(right[0][1] / 1000, abs=1e-12)
  assert evaluate.maj_at_k(keys, correct, 1000) == pytest.approx(1.0, abs=1e-12)
  correct = [k == right[1][0] for k in keys]  # the runner-up: never the vote of all
  assert evaluate.maj_at_k(keys, correct, 1000) == pytest.approx(0.0, abs=1e-12)
  assert 0 < evaluate.maj_at_k(keys, correct, 10) < evaluate.maj_at_k(keys, correct, 1)


# --------------------------------------------------------- metrics of one set


def test_sampled_metrics_by_hand():
  correct = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
  keys = [["7", "7", "3", None], [None, "1", "2", "2"], ["5", "4", "4", None]]
  m = evaluate.sampled_metrics(correct, keys, (1, 2))
  assert list(m) == ["pass@1", "pass@2", "maj@1", "maj@2", "mean@4"]
  assert m["mean@4"] == pytest.approx(3 / 12)  # correct samples over all
  assert m["pass@1"] == pytest.approx(m["mean@4"])  # pass@1 is the mean, unbiased
  assert m["pass@2"] == pytest.approx((5 / 6 + 0 + 1 / 2) / 3)
  # maj@2, per prompt: 3/6 (above); 0; row 3's pairs: {5,4} x2 and {5,None} of 6 win
  # ({5,4} ties 1-1, wrong), so 1/6.
  assert m["maj@2"] == pytest.approx((3 / 6 + 0 + 1 / 6) / 3)
  assert "maj@1" not in evaluate.sampled_metrics(correct, None, (1,))  # no answer keys


# ----------------------------------------------------------------- answer keys


def test_answer_keys_of_the_built_in_tasks():
  key = tasks.get_task("arithmetic").answer_key
  assert key(" 12 ", {}) == "12" and key("-3", {}) == "-3"
  assert key("012", {}) == "012"  # exact_answer marks it wrong for 12: not the same answer
  assert key("12x", {}) is None and key("", {}) is None
  for name in ("gsm8k", "math"):
    key = tasks.get_task(name).answer_key
    assert key("so \\boxed{0.5}", {}) == key("\\boxed{\\frac{1}{2}}", {}) == "1/2"
    assert key("#### 1,000", {}) == key("The answer is $1000.", {}) == "1000"
    assert key("\\boxed{x = 3}", {}) == "3"
    assert key("\\boxed{\\sqrt{2}}", {}) == "\\sqrt{2}"
    assert key("no answer here", {}) is None
  for name in ("countdown", "code", "prompt"):
    assert tasks.get_task(name).answer_key is None  # no maj@k


# --------------------------------------------------------------- eval config


def parse(*argv):
  values = flags.FlagValues()
  argv = ["prog", *argv]
  config_flags.DEFINE_config_dict("config", config.get_config(), flag_values=values,
                                  sys_argv=argv)
  values(argv)
  return config.validate(values.config)


def test_eval_keys_from_the_command_line():
  cfg = parse("--config.eval.k=1,4,8")
  assert read_settings(cfg).eval.k == (1, 4, 8) and read_settings(cfg).eval.samples == 8
  cfg = parse("--config.eval.k=4", "--config.eval.n=16")
  assert read_settings(cfg).eval.k == (4,) and read_settings(cfg).eval.samples == 16
  cfg = parse("--config.eval.n=4")  # no k: mean@4 only
  assert read_settings(cfg).eval.k == () and read_settings(cfg).eval.samples == 4
  assert read_settings(parse()).eval.samples == 0  # greedy accuracy only
  assert read_settings(parse("--config.eval.k=")).eval.k == ()  # "" is off, as 0
  with pytest.raises(config.ConfigError, match="'./data.jsonl@a' for set 'x'"):  # not here
    parse("--config.eval.sets=hard=arithmetic:3:+,x=./data.jsonl@a@test")
  cfg = parse("--config.eval.sets=hard=arithmetic:3:+, train=@train[:16]")
  assert read_settings(cfg).eval.sets == (("hard", "arithmetic:3:+", ""),
                                          ("train", "", "train[:16]"))
  cfg.eval.k = "2, 1, 2"  # a string from Python: sorted, once each
  assert read_settings(config.validate(cfg)).eval.k == (1, 2)


@pytest.mark.parametrize("key, value, words", [
    ("eval.k", (0, 4), "eval.k=(0, 4) must be >= 1 each"),
    ("eval.k", -1, "eval.k=-1 must be >= 1 each"),
    ("eval.k", "1,four", "eval.k='1,four' must be an integer or comma-separated integers"),
    ("eval.k", 2.5, "eval.k=2.5 must be an integer"),
    ("eval.k", (1, 8), "eval.k=(1, 8) needs eval.n >= 8 samples per prompt (eval.n=4"),
    ("eval.n", -1, "eval.n=-1 must be >= 0"),
    ("eval.temperature", -1.0, "eval.temperature=-1.0 must be >= 0"),
    ("eval.sets", "arithmetic:3:+", "entry 'arithmetic:3:+' must be name=dataset[@split]"),
    ("eval.sets", "accuracy=arithmetic", "(not 'accuracy')"),
    ("eval.sets", "a=x,a=y", "names 'a' twice"),
    ("eval.sets", "a=x@test[:5", "entry 'a' has split 'test[:5'"),
    ("eval.sets", "a=./no_such_dir", "names './no_such_dir' for set 'a', which is not a file"),
])
def test_bad_eval_values_fail_with_one_line_naming_the_key(key, value, words):
  cfg = config.get_config()
  cfg.eval.n = 4 if key == "eval.k" else cfg.eval.n
  section, name = key.split(".")
  cfg[section][name] = value
  with pytest.raises(config.ConfigError) as e:
    config.validate(cfg)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"config: {key}="), msg
  assert words in msg, msg


# ------------------------------------------------------------ several sets, one run


@pytest.mark.slow
def test_several_eval_sets_in_one_run(tmp_path, capsys, monkeypatch):
  """The run's own set keeps eval/accuracy and eval/pass@k (and picks the best
  checkpoint); each of eval.sets is eval/<name>/...; all at the start and the end."""
  c = arithmetic_config("smoke")
  c.train.steps, c.sft.steps, c.train.eval_every, c.train.save_every = 1, 0, 0, 0
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 4  # as test_train_loop: its compiles
  c.eval.num_prompts, c.eval.batch_size = 3, 8
  c.eval.k, c.eval.n = (1, 2), 3
  c.eval.sets = "small=arithmetic:1:+,train=@train"
  c.train.loggers = ""
  saved = []
  save = checkpoint_lib.Checkpointer.save
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", lambda self, step, *a, **kw: (
      saved.append((step, kw.get("metrics"))), save(self, step, *a, **kw))[1])
  summary = loop.train(c, str(tmp_path))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  names = {f"{p}{m}" for p in ("eval/", "eval/small/", "eval/train/")
           for m in ("accuracy", "pass@1", "pass@2", "maj@1", "maj@2", "mean@3")}
  for row in (rows[0], rows[-1]):
    assert {k for k in row if k.startswith("eval/")} == names
    assert all(0 <= row[k] <= 1 for k in names)
    for p in ("eval/", "eval/small/", "eval/train/"):
      assert row[p + "pass@1"] == pytest.approx(row[p + "mean@3"])
      assert row[p + "pass@1"] <= row[p + "pass@2"]
  assert summary["end"] == {k: v for k, v in rows[-1].items() if k in names}
  # The best checkpoint is by the run's own set: the final save carries its eval/accuracy.
  assert checkpoint_lib.BEST_METRIC == "eval/accuracy"
  assert saved[-1] == (1, summary["end"])
  loop.print_summary(summary, str(tmp_path))
  assert "eval/small/maj@2" in capsys.readouterr().out
