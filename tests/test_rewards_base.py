"""Reward protocol, format/length rewards and the countdown verifier."""

import math
from fractions import Fraction

import numpy as np
import pytest

from grpojax.rewards import math_accuracy_reward
from grpojax.rewards.base import (BatchCopies, RewardFunctionError, completion_text,
                                  compute_rewards, fresh_kwargs, unique_names, validate_weights)
from grpojax.rewards.countdown import (CountdownReward, evaluate, extract_equation,
                                       is_valid_solution)
from grpojax.rewards.format import OverlongPenalty, TagFormat, soft_overlong_penalty


# ------------------------------------------------------------------ protocol

def length_reward(completions, **kwargs):  # a TRL user's function, unchanged
  return [float(len(c)) for c in completions]


def only_for_odd(prompts, completions, parity, **kwargs):
  return [1.0 if p == "odd" else None for p in parity]


def test_trl_functions_run_unchanged_and_none_becomes_nan():
  out = compute_rewards([length_reward, only_for_odd], ["a", "b", "c"], ["x", "yy", "zzz"],
                        {"parity": ["odd", "even", "odd"]})
  expected = np.array([[1, 1], [2, np.nan], [3, 1]], np.float32)
  np.testing.assert_array_equal(out.rewards, expected)
  assert out.rewards.dtype == np.float32 and out.rewards.shape == (3, 2)
  assert out.names == ("length_reward", "only_for_odd")
  assert out.errors.tolist() == [0, 0]
  m = out.metrics()
  assert m["rewards/only_for_odd/mean"] == 1.0 and m["rewards/length_reward/errors"] == 0.0


def test_functions_without_kwargs_get_only_what_they_name():
  def strict(completions, completion_ids):
    return [float(len(ids)) for ids in completion_ids]
  out = compute_rewards([strict], ["p"], ["abc"], {"answer": ["1"]}, completion_ids=[[1, 2]])
  assert out.rewards.tolist() == [[2.0]]

  def wants_missing(completions, solution):
    return [0.0]
  with pytest.raises(RewardFunctionError, match=r"'wants_missing' needs \['solution'\]"):
    compute_rewards([wants_missing], ["p"], ["c"], {"answer": ["1"]})


def test_a_raising_function_costs_only_its_bad_rows():
  def fragile(completions, **kw):
    return [1.0 / float(c) for c in completions]  # raises on "0"
  out = compute_rewards([fragile, length_reward], ["p"] * 4, ["1", "0", "2", "4"])
  np.testing.assert_array_equal(out.rewards[:, 0], [1.0, np.nan, 0.5, 0.25])
  assert out.errors.tolist() == [1, 0]


def test_mostly_failing_function_stops_the_run_naming_it():
  def broken_reward(completions, **kw):
    return [float(c) for c in completions]  # most rows are not numbers
  with pytest.raises(RewardFunctionError, match=r"'broken_reward' failed on 3 of 4") as e:
    compute_rewards([length_reward, broken_reward], ["p"] * 4, ["1", "a", "b", "c"])
  # The exception is in the first line, which the trainer's one-line report shows; its
  # traceback follows.
  first, *rest = str(e.value).splitlines()
  assert "ValueError: could not convert string to float: 'a'" in first
  assert any("Traceback" in line or "File" in line for line in rest)
  out = compute_rewards([broken_reward], ["p"] * 4, ["1", "a", "b", "c"],
                        max_error_fraction=None)
  assert out.errors.tolist() == [3]


@pytest.mark.parametrize("bad,match", [
    (lambda completions, **kw: [1.0], "returned 1 values for 2 completions"),
    (lambda completions, **kw: ["1", "2"], "returned '1'"),
    (lambda completions, **kw: 3.0, "returned float"),
])
def test_junk_return_values_are_bugs(bad, match):
  with pytest.raises(RewardFunctionError, match=match):
    compute_rewards([bad], ["p", "q"], ["a", "b"])


def test_names_and_weights():
  assert unique_names([length_reward, length_reward]) == ("length_reward", "length_reward_2")
  np.testing.assert_array_equal(validate_weights([length_reward] * 2, None), [1, 1])
  with pytest.raises(ValueError, match="2 finite numbers"):
    validate_weights([length_reward] * 2, [1.0])


# Issue 28: each call gets its own copy of the batch. A function that edits its
# arguments in place must not change what the next one sees: here MathAccuracy,
# which would score a wrong answer 1.0.
def as_messages(texts):
  return [[{"role": "assistant", "content": t}] for t in texts]


def overwrite_completions(completions, **kw):
  completions[0] = "\\boxed{42}"
  return [0.0] * len(completions)


def overwrite_gold(completions, answer, **kw):
  answer[0] = "41"
  return [0.0] * len(completions)


def edit_a_message(completions, **kw):
  completions[0][-1]["content"] = "\\boxed{42}"
  return [0.0] * len(completions)


def replace_a_message(completions, **kw):
  completions[0][-1] = {"role": "assistant", "content": "\\boxed{42}"}
  return [0.0] * len(completions)


@pytest.mark.parametrize("cheat,chat", [
    (overwrite_completions, False), (overwrite_gold, False), (overwrite_gold, True),
    (edit_a_message, True), (replace_a_message, True)])
def test_a_function_cannot_change_what_the_next_one_sees(cheat, chat):
  completions = ["so \\boxed{41}"]
  if chat:
    completions = as_messages(completions)
  prompts, columns = ["6 * 7?"], {"answer": ["42"]}
  out = compute_rewards([cheat, math_accuracy_reward], prompts, completions, columns)
  assert out.rewards[:, 1].tolist() == [0.0]  # 41 is still wrong
  # Nor the caller's (the dataset's) own values.
  assert columns == {"answer": ["42"]} and completion_text(completions[0]) == "so \\boxed{41}"


def test_nested_columns_and_token_ids_are_each_calls_own():
  def grow(completion_ids, tests, **kw):
    for ids, t in zip(completion_ids, tests):
      ids.append(0)
      t.append("assert False")
    return [0.0] * len(tests)

  def sizes(completion_ids, tests, **kw):
    return [float(len(ids) + 100 * len(t)) for ids, t in zip(completion_ids, tests)]
  tests = [["assert f(1) == 1"], ["assert f(2) == 2", "assert f(3) == 3"]]
  ids = [[5, 6, 7], [8]]
  out = compute_rewards([grow, sizes, grow, sizes], ["p", "q"], ["a", "b"], {"tests": tests},
                        completion_ids=ids)
  np.testing.assert_array_equal(out.rewards[:, 1], [103.0, 201.0])
  np.testing.assert_array_equal(out.rewards[:, 3], [103.0, 201.0])
  # The dataset's rows are the same next epoch.
  assert tests == [["assert f(1) == 1"], ["assert f(2) == 2", "assert f(3) == 3"]]


def test_a_row_retry_sees_the_batch_as_it_came():
  def edits_then_fails_on_the_batch(completions, answer, **kw):
    scores = math_accuracy_reward(completions=completions, answer=answer)
    completions[:] = ["\\boxed{42}"] * len(completions)
    answer[:] = ["42"] * len(answer)
    if len(completions) > 1:
      raise ValueError("fails on the batch, as a row-dependent bug does")
    return scores
  out = compute_rewards([edits_then_fails_on_the_batch, math_accuracy_reward], ["p"] * 2,
                        ["\\boxed{41}", "\\boxed{7}"], {"answer": ["42", "7"]})
  np.testing.assert_array_equal(out.rewards, [[0.0, 0.0], [1.0, 1.0]])
  assert out.errors.tolist() == [0, 0]  # each row alone worked


def test_copies_share_what_cannot_change_and_copy_the_rest():
  frozen = ("a", 1, (2.0, None), frozenset({b"x"}))
  array = np.arange(3)
  kwargs = {"s": ["x" * 100], "ids": [[1, 2], [3]], "nested": [{"k": [1, {2, 3}]}],
            "arr": [array], "t": [frozen, ([1],)], "scalar": 3, "np": [np.int64(4)]}
  kwargs["loop"] = [1]
  kwargs["loop"].append(kwargs["loop"])  # a list holding itself: no endless recursion
  for copy in (fresh_kwargs(kwargs), BatchCopies(kwargs)(list(kwargs))):
    assert copy["s"] == kwargs["s"] and copy["s"] is not kwargs["s"]
    assert copy["s"][0] is kwargs["s"][0]  # strings shared, not duplicated
    assert copy["ids"] == kwargs["ids"] and copy["ids"][0] is not kwargs["ids"][0]
    assert copy["nested"][0]["k"][1] is not kwargs["nested"][0]["k"][1]
    assert copy["arr"][0] is not array and (copy["arr"][0] == array).all()
    assert copy["t"][0] is frozen and copy["t"][1][0] is not kwargs["t"][1][0]
    assert copy["loop"][1] is copy["loop"] and copy["loop"] is not kwargs["loop"]
    assert copy["np"][0] is kwargs["np"][0]


# -------------------------------------------------------------------- format

@pytest.mark.parametrize("text,expected", [
    ("<think>a</think><answer>1</answer>", 1.0),
    ("<think>\nsteps\n</think>\n<answer>\n42\n</answer>\n", 1.0),
    ("<answer>1</answer>", 0.0),
    ("<think>a</think>", 0.0),
    ("<answer>1</answer><think>a</think>", 0.0),
    ("intro <think>a</think><answer>1</answer>", 0.0),
    ("<think>a</think><answer>1</answer> trailing", 0.0),
    ("<think>a<think>b</think><answer>1</answer>", 0.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
])
def test_tag_format(text, expected):
  assert TagFormat().score(text) == expected


def test_tag_format_options():
  custom = TagFormat(think_tag="reasoning", answer_tag="final")
  assert custom.score("<reasoning>r</reasoning><final>f</final>") == 1.0
  assert custom.score("<think>r</think><answer>f</answer>") == 0.0
  prefilled = TagFormat(think_prefilled=True)
  assert prefilled.score("steps</think><answer>1</answer>") == 1.0
  assert prefilled(completions=[[{"role": "assistant", "content": "x</think><answer>1</answer>"}]]
                   ) == [1.0]


def test_soft_overlong_penalty_hand_worked():
  # L_max = 100, L_cache = 20: free up to 80, then linear to -1 at 100.
  for length, expected in [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0),
                           (150, -1.0)]:
    assert soft_overlong_penalty(length, 100, 20) == pytest.approx(expected)
  with pytest.raises(ValueError):
    soft_overlong_penalty(10, 100, 0)
  reward = OverlongPenalty(max_length=100, cache_length=20)
  assert reward(completions=["a", "b"], completion_ids=[[0] * 90, [0] * 10]) == [-0.5, 0.0]
  with pytest.raises(KeyError, match="completion_ids"):
    reward(completions=["a"])


# ----------------------------------------------------------------- countdown

@pytest.mark.parametrize("expr,numbers,target,ok", [
    ("(25 - 5) * 4 + 3", [25, 5, 4, 3], 83, True),
    ("25 - 5 * 4 + 3", [25, 5, 4, 3], 8, True),      # precedence
    ("25 - 5 * 4 + 3", [25, 5, 4, 3], 83, False),
    ("(6 / 4) * 2 + 1", [6, 4, 2, 1], 4, True),      # exact: 1.5 * 2 + 1
    ("1 / 3 * 3", [1, 3, 3], 1, True),               # floats would give 0.999...
    ("8 / (3 - 8 / 3)", [8, 3, 8, 3], 24, True),     # the classic
    ("6 × 4 ÷ 2", [6, 4, 2], 12, True),
    ("(1 + 2) * 3", [1, 2, 3, 4], 9, False),         # 4 unused
    ("(1 + 2) * 3 * 3", [1, 2, 3], 27, False),       # 3 used twice
    ("12 * 2", [1, 2, 2], 24, False),                # digits glued into 12
    ("-3 + 5", [3, 5], 2, False),                    # unary minus
    ("2.5 * 4", [2.5, 4], 10, False),                # decimals
    ("2 ** 3", [2, 3], 8, False),                    # no powers
    ("4 / (2 - 2)", [4, 2, 2], 0, False),            # division by zero
    ("__import__('os')", [1], 1, False),
    ("(1 + 2", [1, 2], 3, False),
    ("1 + 2)", [1, 2], 3, False),
    ("", [1], 1, False),
])
def test_countdown_cases(expr, numbers, target, ok):
  assert is_valid_solution(expr, numbers, target) is ok


def test_countdown_exact_values_and_limits():
  assert evaluate("8 / (3 - 8 / 3)") == (Fraction(24), [8, 3, 8, 3])
  assert is_valid_solution("1 + 2", [1, 2, 3], 3, use_all=False)
  assert not is_valid_solution("1 + 1", [1, 2, 3], 2, use_all=False)
  assert not is_valid_solution("(" * 100 + "1" + ")" * 100, [1], 1)
  assert not is_valid_solution("1+" * 150 + "1", [1] * 151, 151)


def test_countdown_reward():
  completions = ["<think>try</think><answer>(25 - 5) * 4 + 3</answer>",
                 "<answer>25 + 5 + 4 + 3 = 37</answer>",
                 "so: 25 * 4 - 5 * 3 = 85",
                 "I give up"]
  got = CountdownReward()(completions=completions, target=[83, 83, 85, 1],
                          nums=[[25, 5, 4, 3]] * 4)
  assert got == [1.0, 0.0, 1.0, 0.0]
  assert extract_equation("<answer>$3 \\times 4$</answer>") == "3 × 4"
  assert not math.isnan(got[0])
