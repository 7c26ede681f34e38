"""Math answers: extraction and equivalence on hand-worked cases, hostile ones included.

Nothing here asserts on wall-clock time: a busy machine must not fail it.
Hostile inputs (linear cost, bounded parses, CPU budgets, load) are in
test_rewards_math_hostile.py.
"""

import pytest

from grpojax.rewards.base import TIMED_OUT
from grpojax.rewards.math import (GradingTimeout, MathAccuracy, extract_answer, gold_answer,
                                  grade, grade_many, is_equivalent, read_number_words,
                                  spelled_number, too_large, unreadable)

# (text, expected answer)
EXTRACTION = [
    (r"so the result is \boxed{42}.", "42"),
    (r"first \boxed{1} then finally \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
    (r"nested \boxed{\frac{\sqrt{2}}{2}} done", r"\frac{\sqrt{2}}{2}"),
    (r"a set \boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed 5 is it", "5"),
    (r"\boxed{3} and then a cut-off \boxed{4", "3"),  # an unclosed box is skipped
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,234.", "1,234"),
    ("<think>hmm</think><answer> 12 </answer>", "12"),
    ("The answer is 42. Checking: 42 * 2 = 84", "42"),
    ("Answer: -3/4", "-3/4"),
    ("we get 3 apples, then 5, then 7.5 in total", "7.5"),
    ("no digits at all", None),
    # The last answer the text commits to wins, whatever its kind.
    (r"The answer is $\boxed{5}$. Wait, 3+3=6, so the answer is 6.", "6"),
    (r"The answer is 6. Let me box it: \boxed{5}", "5"),
    ("The answer is 12. Hmm, actually I think it's 15.", "15"),
    ("Hmm, actually I think it's 15. No: the answer is 12.", "12"),
    (r"\boxed{4}. Wait, 3+3=6.", "4"),  # a computation after the box commits to nothing
    (r"The roots are \boxed{2} and \boxed{3}.", "2, 3"),  # one answer, two boxes
    (r"\boxed{5}. Wait, actually it's \boxed{6}", "6"),  # a correction is no separator
    ("#### 72\nThe answer is 73.", "73"),
    (r"\boxed{72}<answer>73</answer>", "73"),
    (r"\boxed{\text{the answer is 5}}", r"\text{the answer is 5}"),  # inside a box: the box
    ("So the answer is 18 because 9 * 2 = 18.", "18"),
    ("The answer is 5 (since 2+3=5).", "5"),
    ("The answer is $x = 7$, which we check: 7 - 2 = 5.", "x = 7"),
    ("The answer is 5 (or 6).", "5 (or 6)"),  # a second value is no explanation
    ("The answer is as follows: 4 + 4 = 8", "8"),  # no value stated: the last number
]


@pytest.mark.parametrize("text,expected", EXTRACTION)
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


def test_extraction_fallbacks():
  text = "The answer is 3. Later 9"
  assert extract_answer(text, fallback="last_number") == "9"
  assert extract_answer(text, fallback="answer_phrase") == "3"
  assert extract_answer(text, fallback="none") is None
  assert extract_answer(text, fallback=lambda t: "custom") == "custom"
  with pytest.raises(ValueError, match="fallback='nope' is unknown"):
    extract_answer(text, fallback="nope")


# (prediction, gold, equivalent?)
EQUIVALENT = [
    # integers, separators, decimals, signs
    ("72", "72", True), ("72", "73", False), ("1,234", "1234", True),
    ("1,000,000", "1000000", True), ("1000000", "100000", False), ("3.0", "3", True),
    ("3.50", "3.5", True), ("-7", "−7", True), ("-7", "7", False), ("0.5", ".5", True),
    # fractions in every form
    ("3/4", r"\frac{3}{4}", True), ("0.75", r"\dfrac{3}{4}", True), ("0.75", r"\frac34", True),
    (r"-\frac{3}{4}", "-3/4", True), (r"\frac{-3}{4}", "-0.75", True), ("3/4", "4/3", False),
    (r"\tfrac{1}{2}", "2/4", True), ("0.333333", "1/3", True), ("0.33", "1/3", False),
    (r"\frac{1}{0}", "1", False),
    # radicals, powers, constants
    (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"\sqrt{3}", r"\sqrt{2}", False), ("2^{10}", "1024", True), ("2^{2^3}", "256", True),
    ("2^{10}", "1000", False), (r"\pi", "π", True), (r"2\pi", "6.283185307", True),
    (r"\frac{\pi}{2}", r"\pi/2", True), (r"\pi", "3.14", False),
    (r"\infty", "∞", True), (r"-\infty", r"\infty", False),
    # tuples, sets, intervals
    ("(1, 2)", "(1,2)", True), ("(1, 3)", "(1, 2)", False), ("(1,2)", "(2,1)", False),
    (r"\{1,2\}", r"\{2,1\}", True), (r"\{1,2\}", "(1,2)", False), ("(1,2)", "[1,2]", False),
    ("(1,2]", "(1,2]", True), ("(1,2]", "(1,2)", False), (r"[0,\infty)", r"[0, \infty)", True),
    ("2, 1", "1, 2", True),
    # x = 5, units, currency, percent, degrees, text answers
    ("x = 5", "5", True), ("5", "x=5", True), ("x = 6", "5", False), (r"\$18", "18", True),
    (r"18\text{ cm}", "18", True), ("18 dollars", "18", True), (r"18\text{ cm}", "19", False),
    (r"50\%", "50", True), (r"30^\circ", "30", True), (r"\text{(A)}", "A", True),
    (r"\text{(B)}", "A", False),
    # algebra
    ("x^2+2x+1", "(x+1)^2", True), ("x^2+2x+1", "(x+1)^3", False),
    (r"\frac{x}{2}", "0.5x", True), ("a+b", "b+a", True),
    # nothing to compare
    ("", "1", False), (None, "1", False), ("1", None, False),
]


@pytest.mark.parametrize("pred,gold,expected", EQUIVALENT)
def test_is_equivalent(pred, gold, expected):
  assert is_equivalent(pred, gold) is expected


HOSTILE = [
    r"9^{9^{9^9}}",
    r"10^{100000000}",
    "10**10**10",
    r"2^{2^{2^{2^{2^{2}}}}}",
    "99999999999!",
    r"(10^{10})^{10^{10}}",
]


@pytest.mark.parametrize("pred", HOSTILE)
def test_huge_numbers_are_refused_before_any_evaluation(pred, monkeypatch):
  import grpojax.rewards.math as m

  def ask_many(requests, timeout_s):
    raise AssertionError(f"{requests[0]} reached math-verify")
  assert too_large(pred)
  monkeypatch.setattr(m._SYMBOLIC, "ask_many", ask_many)
  assert is_equivalent(pred, "1") is False


def test_code_in_an_answer_never_runs(tmp_path):
  marker = tmp_path / "pwned"
  for payload in [rf"__import__('os').system('touch {marker}')",
                  rf"\boxed{{__import__('os').system('touch {marker}')}}",
                  f"exec(\"open('{marker}','w')\")"]:
    assert is_equivalent(payload, "0") is False
    assert is_equivalent("0", payload) is False
  assert not marker.exists()


def test_slow_symbolic_work_times_out_without_a_verdict():
  # Expanding this is far too slow for the budget: no verdict, which is no
  # False either; and the next call works again.
  with pytest.raises(GradingTimeout):
    is_equivalent("(x+1)^{3000}", "x^{3000}+1", timeout_s=0.3)
  slow, gold = r"$(x+1)^{3000}$", "x^{3000}+1"
  assert grade_many([slow, r"\boxed{2}"], [gold, "2"], timeout_s=0.3) == [TIMED_OUT, True]
  with pytest.raises(GradingTimeout):
    grade(slow, gold, timeout_s=0.3)
  assert MathAccuracy(timeout_s=0.3)(completions=[slow], answer=[gold]) == [TIMED_OUT]
  assert is_equivalent(r"\sqrt{8}", r"2\sqrt{2}") is True


def test_plain_numbers_never_need_the_symbolic_worker(monkeypatch):
  import grpojax.rewards.math as m

  def boom(*args):
    raise AssertionError("plain numbers must be decided without math-verify")
  monkeypatch.setattr(m._SYMBOLIC, "equivalent", boom)
  assert is_equivalent("1,234", "1234.0") and not is_equivalent("12", "13")
  assert is_equivalent(r"\frac{3}{4}", "0.75") and not is_equivalent("x = 2", "3")


def test_gold_answer_from_references():
  assert gold_answer("Natalia sold 24 in May.\n#### 72") == "72"
  assert gold_answer(r"So $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
  assert gold_answer("  17 ") == "17"
  assert gold_answer(None) is None


def test_math_accuracy_reward():
  reward = MathAccuracy()
  completions = [r"... so \boxed{72}", "I think it is 71", "no answer here",
                 [{"role": "assistant", "content": "#### 72"}], "anything"]
  golds = ["#### 72", "72", "72", "72", None]
  assert reward(prompts=["q"] * 5, completions=completions, answer=golds) == [
      1.0, 0.0, 0.0, 1.0, None]
  # TRL's column name for MATH-style data.
  assert reward(completions=[r"\boxed{\dfrac{1}{2}}"],
                solution=[r"Thus \boxed{\frac12}."]) == [1.0]
  with pytest.raises(KeyError, match="answer"):
    reward(completions=["1"], target=["1"])


def test_a_forked_copy_starts_its_own_worker():
  # Reward workers may fork; a child must not talk over its parent's pipes.
  import grpojax.rewards.math as m
  assert is_equivalent(r"\sqrt{4}", "2")
  parents = [w.proc for w in m._SYMBOLIC._workers]
  m._SYMBOLIC._owner = -1  # what the copy in a forked child sees
  try:
    assert is_equivalent(r"\sqrt{9}", "3") and not is_equivalent(r"\sqrt{9}", "4")
    ours = [w.proc for w in m._SYMBOLIC._workers]
    assert not set(ours) & set(parents) and all(p.poll() is None for p in parents)
  finally:
    for proc in parents:
      proc.kill()
      proc.wait()


# Issue 16: answers that merely contain the gold, or sit within a float tolerance
# of an exact gold, are not the gold.
FALSE_POSITIVES = [
    (r"1234568.0", "1234567"), ("1234567.1", "1234567"), ("0.0000009", "0"),
    ("0 = 42", "42"), ("x+1 = 42", "42"), (r"4\text{ or }2", "42"),
    (r"\operatorname{foo}(42)", "42"), (r"\mathrm{idk}\ 42", "42"),
]


@pytest.mark.parametrize("pred,gold", FALSE_POSITIVES)
def test_near_misses_and_prose_around_the_gold_score_0(pred, gold):
  assert is_equivalent(pred, gold) is False
  assert MathAccuracy()(completions=[rf"\boxed{{{pred}}}"], answer=[gold]) == [0.0]


# Forms that are the gold: kept.
TRUE_FORMS = [
    (r"\boxed{42}", "42"), ("42.0", "42"), (r"\$42", "42"), (r"42\%", "42"), ("x = 42", "42"),
    (r"\text{42}", "42"), (r"\mathrm{42}", "42"), (r"42\text{ cm}", "42"),
    ("0.0000009", "0.0"), ("0.1428571", "1/7"), ("3.1415927", "3.14159265"),
]


@pytest.mark.parametrize("pred,gold", TRUE_FORMS)
def test_legitimate_forms_of_the_gold_score_1(pred, gold):
  pred = extract_answer(pred) if pred.startswith("\\boxed") else pred
  assert is_equivalent(pred, gold) is True


# Issue 29: graded as the reference grader (Math-Verify) reads answers, and as a
# careful human where it does not: (completion, gold, verdict). Named by what
# each shows; most fail at ed51e61 (unboxed LaTeX, boxes, relations, number
# formats and words), the rest are controls that must keep passing.
GRADED = [
 # (completion, gold, expected)
 ("So the answer is $\\frac13$.", "\\frac{1}{3}", 1),
 ("So the answer is $\\sqrt3$.", "\\sqrt{3}", 1),
 ("So the answer is $\\sqrt3$.", "3", 0),
 ("The ratio is $\\frac{1+\\sqrt{5}}{2}$.", "2", 0),
 ("The ratio is $\\frac{1+\\sqrt{5}}{2}$.", "\\frac{1+\\sqrt{5}}{2}", 1),
 ("The roots are \\boxed{2} and \\boxed{3}.", "\\{2, 3\\}", 1),
 ("Therefore $x \\geq 5$.", "x >= 5", 1),
 ("Therefore $x \\leq 5$.", "x >= 5", 0),
 ("The pair is $\\boxed{(3, 2)}$.", "(p,q)=(3,2)", 1),
 ("The pair is $\\boxed{(2, 3)}$.", "(p,q)=(3,2)", 0),
 ("Total: \\boxed{16,\\!386.20}", "16386.2", 1),
 ("It is 0,111", "111", 0),
 ("It is 0,111", "0.111", 1),
 ("\\boxed{14{,}916}", "14916", 1),
 ("The answer is $\\text{odd}$.", "\\text{odd}", 1),
 ("The answer is $\\text{odd}$.", "\\text{even}", 0),
 ("The answer is 10 million.", "10", 0),
 ("The answer is 10 million.", "10000000", 1),
 ("The answer is 2 thousand.", "2", 0),
 ("The answer is 2 thousand.", "2000", 1),
 ("The answer is 3 dozen.", "3", 0),
 ("The answer is 3 dozen.", "36", 1),
 ("The answer is 5 squared.", "5", 0),
 ("The answer is 5 squared.", "25", 1),
 ("The answer is 2 times pi.", "2", 0),
 ("The answer is 5 or more.", "5", 0),
 ("The answer is 4 2.", "42", 0),
 ("The answer is 4 2.", "2", 0),
 ("The answer is 2 1/2.", "21/2", 0),
 ("The answer is 2 1/2.", "5/2", 1),
 ("The answer is 2.5e6.", "2500000", 1),
 ("The answer is 12 cm.", "12", 1),
 ("The answer is 10.", "10.0", 1),
 ("The answer is 1/2.", "0.5", 1),
 # variants
 ("\\boxed{1.5 \\text{ billion}}", "1500000000", 1),
 ("\\boxed{1.5 \\text{ billion}}", "1.5", 0),
 ("The answer is about 5.", "5", 0),
 ("The answer is at least 5.", "5", 0),
 ("The answer is 3 or 4.", "4", 0),
 ("The answer is 5 cubed.", "125", 1),
 ("$2\\frac{1}{2}$ cups", "\\frac{5}{2}", 1),
 ("The answer is 2.5E-3.", "0.0025", 1),
 ("\\[ \\frac{1}{2} \\]", "0.5", 1),
 ("so \\( \\sqrt{2} \\) it is", "\\sqrt{2}", 1),
 ("$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1),
 ("\\boxed{0 = 42}", "42", 0),
 ("\\boxed{x = 42}", "42", 1),
 ("\\boxed{[0, \\infty)}", "[0,\\infty)", 1),
 ("The answer is 7 hundred.", "700", 1),
 ("The answer is 6 times 7.", "42", 1),
 ("The answer is 12 over 4", "3", 1),
 ("The answer is ten.", "10", 1),
 ("\\boxed{5+x}", "x+5", 1),
 ("There are 10+ people.", "10", 0),
 ("\\boxed{72} is wrong, so the final answer is $73$. I hope it is correct.", "73", 1),
 ("<answer>6</answer>", "6", 1),
 ("\\boxed{2x + 1 = y}", "y=2x+1", 1),
 ("The answer is \\$5.00.", "5", 1),
 ("The answer is 3 1/3.", "10/3", 1),
 ("The answer is 5 and 6.", "5", 0),
 ("The answer is ≈ 5.", "5", 0),
 ("The answer is ~5.", "5", 0),
 ("The answer is 5 (or 6).", "5", 0),
 ("The answer is not 5.", "5", 0),
 ("The answer is roughly 5.", "5", 0),
 ("The answer is one million.", "1000000", 1),
 ("The answer is $x = 5$ or $x = 6$.", "5", 0),
 ("The answer is twenty-five.", "25", 1),
 ("The answer is ten.", "11", 0),
 ("\\boxed{\\text{one hundred and two}}", "102", 1),
]


@pytest.mark.parametrize("completion,gold,expected", GRADED,
                         ids=[f"{c[:40]}|{g}" for c, g, _ in GRADED])
def test_answers_graded_as_a_careful_grader_would(completion, gold, expected):
  assert MathAccuracy()(completions=[completion], answer=[gold]) == [float(expected)]


# Issue 49, each class with cases of our own beside the issue's:
# (completion, gold, verdict). Math-Verify and TRL take any box over any
# phrase; here the last answer the completion commits to is graded.
LAST_ANSWER_WINS = [
    (r"The answer is $\boxed{5}$. Wait, 3+3=6, so the answer is 6.", "6", 1),
    (r"The answer is $\boxed{5}$. Wait, 3+3=6, so the answer is 6.", "5", 0),
    ("The answer is 12. Hmm, actually I think it's 15.", "15", 1),
    ("The answer is 12. Hmm, actually I think it's 15.", "12", 0),
    (r"So the answer is 6. Let me box the result: $\boxed{5}$", "5", 1),  # the other order
    (r"So the answer is 6. Let me box the result: $\boxed{5}$", "6", 0),
    (r"\boxed{5}. Oops, that's wrong: it should be 7.", "7", 1),
    (r"\boxed{4}. Checking: 2+2=4, and 4 - 1 = 3.", "4", 1),  # arithmetic commits to nothing
    (r"\boxed{4}. Checking: 2+2=4, and 4 - 1 = 3.", "3", 0),
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", r"\{2, 3\}", 1),  # one answer in two boxes
    (r"\boxed{2}, or wait, actually it's \boxed{3}", r"\{2, 3\}", 0),
    (r"\boxed{2}, or wait, actually it's \boxed{3}", "3", 1),
    (r"<think>\boxed{8}</think><answer>9</answer>", "9", 1),
    ("#### 72\nThe answer is 73.", "73", 1),
]
TIMES = [
    (r"$3 \times 4$", r"3 \times 4", 1), (r"The answer is $4.5 \times 10^{-3}$.", "0.0045", 1),
    (r"\boxed{4.5 × 10^{-3}}", "0.0045", 1), (r"\boxed{2 \times 10^{3}}", "2000", 1),
    (r"\boxed{{1 \over 2}}", "0.5", 1), (r"\boxed{2 \times 10^{3}}", "200", 0),
    ("The answer is 6 times 7.", "42", 1), ("The answer is 2 times pi.", "2", 0),  # words: controls
]
EXPLANATION_AFTER = [
    ("So the answer is 18 because 9 * 2 = 18.", "18", 1),
    ("The answer is 5 (since 2+3=5).", "5", 1),
    ("The answer is 12, which is 3 * 4 = 12.", "12", 1),
    ("The answer is $7$; indeed 7 = 3 + 4.", "7", 1),
    ("The answer is 18 because 9 * 2 = 18.", "9", 0), ("The answer is 5 (or 6).", "5", 0),
    ("The answer is x + 1 = 6 since x = 5.", "6", 0),  # an equation, then its explanation
]
UNITS = [
    (r"\boxed{5\text{ km}}", r"5\text{ m}", 0), (r"\boxed{5\text{ m}}", r"5\text{ m}", 1),
    (r"\boxed{5}", r"5\text{ m}", 1), (r"\boxed{5\text{ m}}", "5", 1),
    ("The answer is 5 meters.", r"5\text{ m}", 1), ("The answer is 5 km.", r"5\text{ m}", 0),
    (r"\boxed{12\text{ cm}^2}", r"12\text{ cm}", 0),
    (r"\boxed{12\text{ cm}^2}", r"12\text{ cm}^2", 1),
    ("The answer is 6 square units.", "6", 1), ("The answer is 20 dollars.", "20 cents", 0),
]
FALSE_NEGATIVES = [
    ("$x > 4$", r"(4,\infty)", 1), (r"$(4, \infty)$", "x > 4", 1),
    (r"$x \geq 5$", r"[5,\infty)", 1), ("$x > 4$", r"[4,\infty)", 0),
    (r"\boxed{\{1, 2\}}", "1, 2", 1), (r"\boxed{\{1, 3\}}", "1, 2", 0),
    ("The answer is five apples.", "5", 1), ("The answer is five apples.", "6", 0),
    ("The answer is twenty-five dollars.", "25", 1),
]


@pytest.mark.parametrize("completion,gold,expected",
                         LAST_ANSWER_WINS + TIMES + EXPLANATION_AFTER + UNITS + FALSE_NEGATIVES,
                         ids=lambda x: str(x)[:40])
def test_issue_49_classes(completion, gold, expected):
  assert MathAccuracy()(completions=[completion], answer=[gold]) == [float(expected)]


@pytest.mark.parametrize("pred,gold,expected", [
    (r"3 \times 4", r"3 \times 4", True), (r"4.5 \times 10^{-3}", "0.0045", True),
    ("4.5 × 10^{-3}", "0.0045", True), (r"5\text{ km}", r"5\text{ m}", False),
    (r"5\text{ km}", "5", True), ("5 kilometers", r"5\text{ km}", True),
    ("x > 4", r"(4,\infty)", True), (r"(4,\infty)", "x > 4", True), (r"\{1, 2\}", "1, 2", True),
    ("five apples", "5", True), ("five apples", "5 pears", False)])
def test_is_equivalent_on_issue_49_classes(pred, gold, expected):
  assert is_equivalent(pred, gold) is expected


@pytest.mark.parametrize("text,expected", [
    ("10 million", "10000000"), ("1.5 billion", "1500000000"), ("3 dozen", "36"),
    ("7 hundred", "700"), ("5 squared", "5^2"), ("6 times 7", "42"), ("12 over 4", "3"),
    ("2 1/2", "5/2"), (r"2\frac{1}{2}", r"\frac{5}{2}"), ("2.5e6", "2500000"),
    ("2.5E-3", "0.0025"), ("3 4/2", "3 4/2"), ("1e100000", None)])
def test_number_words_are_read(text, expected):
  assert read_number_words(text) == expected


def test_spelled_numbers():
  cases = {"ten": 10, "twenty-five": 25, "one hundred and two": 102, "three thousand": 3000,
           "two million five hundred thousand": 2_500_000, r"\text{seven}": 7}
  assert {t: spelled_number(t) for t in cases} == cases
  assert spelled_number("ten apples") is None and spelled_number("the") is None


@pytest.mark.parametrize("text", ["5 or more", "about 5", "at least 5", "4 or 5", "4 2",
                                  "2 times pi", "between 3 and 4", "3 to 5", "5+"])
def test_uncertain_answers_are_unreadable(text):
  assert unreadable(read_number_words(text))


@pytest.mark.parametrize("text", ["1 000", "12 cm", "x \\geq 5", "x = 5-3", "10", "5+x",
                                  "1/3 \\approx 0.33"])
def test_plain_answers_are_readable(text):
  assert not unreadable(read_number_words(text))


# Hostile answers. Numbers too large to build are refused before anything
# evaluates them: they never reach (or stall) the Math-Verify worker.
HUGE_ANSWERS = [
    "The answer is $(2^{99999})^{99999}$.", r"\boxed{(9999!)!}", "(2^99999)^99999",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", "so it is 1e100000", r"\boxed{10^{10^{10}}} cm"]
# Long junk: Math-Verify reads only a bounded part of it.
LONG_ANSWERS = ["x" * 100_000, r"\[ x" * 25_000, r"\( x" * 25_000, "1 " * 50_000,
                "$" * 100_000, r"\boxed{" * 14_000 + "1" + "}" * 14_000,
                r"\boxed{1} \[ x" + r"\[ x" * 25_000]


@pytest.mark.parametrize("completion", HUGE_ANSWERS, ids=range(len(HUGE_ANSWERS)))
def test_huge_answers_never_reach_the_worker(completion, monkeypatch):
  import grpojax.rewards.math as m

  def ask_many(requests, timeout_s):
    assert not requests, f"a hostile answer reached Math-Verify: {requests[0]['c'][:80]!r}"
    return []
  monkeypatch.setattr(m._SYMBOLIC, "ask_many", ask_many)
  assert MathAccuracy()(completions=[completion], answer=["1"]) == [0.0]


@pytest.mark.parametrize("completion", LONG_ANSWERS, ids=range(len(LONG_ANSWERS)))
def test_long_junk_scores_0_and_math_verify_reads_a_bounded_part(completion, monkeypatch):
  import grpojax.rewards.math as m
  asked, ask_many = [], m._SYMBOLIC.ask_many

  def spy(requests, timeout_s):
    asked.extend(requests)
    return ask_many(requests, timeout_s)
  monkeypatch.setattr(m._SYMBOLIC, "ask_many", spy)
  assert MathAccuracy()(completions=[completion], answer=["2"]) == [0.0]
  assert all(len(r["c"]) <= m.MAX_VERIFY_CHARS for r in asked), [len(r["c"]) for r in asked]


def test_too_large_sees_through_brackets_and_factorials():
  for text in [r"(2^{99999})^{99999}", "(9999!)!", r"\left(10^{10}\right)^{10^{10}}",
               r"2^{2^{2^{2^{2^{2}}}}}", "x^{100000000}", "99999999999!"]:
    assert too_large(text), text
  for text in [r"2^{99999}", "1000!", r"\left(2^{10}\right)^{10}", r"2^{2^{2^{2^{2}}}}",
               r"\frac{1}{2} + 3", "1,234,567"]:
    assert not too_large(text), text


def test_a_timeout_costs_only_its_own_row(monkeypatch):
  # Two answers whose expansion is far too slow, among right ones: each is
  # TIMED_OUT (not 0), the rest are graded, and each timeout's worker is
  # replaced by the spare while one new spare starts.
  import grpojax.rewards.math as m
  slow = (r"$(x+1)^{3000}$", "x^{3000}+1")
  right = [(rf"$\sqrt{{{n * n * 2}}}$", rf"{n}\sqrt{{2}}") for n in range(2, 12)]
  rows = [slow] + right + [slow] + right
  reward = MathAccuracy(timeout_s=0.5)
  reward(completions=[r"$\sqrt{8}$"], answer=[r"2\sqrt{2}"])  # workers up
  started, init = [], m._Worker.__init__

  def counting_init(self):
    started.append(self)
    init(self)
  monkeypatch.setattr(m._Worker, "__init__", counting_init)
  out = reward(completions=[c for c, _ in rows], answer=[g for _, g in rows])
  assert out == [TIMED_OUT] + [1.0] * 10 + [TIMED_OUT] + [1.0] * 10
  assert len(started) == 2
  assert reward(completions=[r"$\sqrt{8}$"], answer=[r"2\sqrt{2}"]) == [1.0]
