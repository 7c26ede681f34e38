"""MathAccuracy against Math-Verify's own test verdicts (data/math_verify_cases.json, MIT, HuggingFace).

Each case grades Math-Verify's prediction as a completion against its gold;
the verdict must be the test's, except the cases in DISAGREE, where we differ
on purpose. Regenerate the data with tests/data/make_math_verify_cases.py.
"""

import json
import os

import pytest

from grpojax.rewards.base import TIMED_OUT
from grpojax.rewards.math import MathAccuracy

with open(os.path.join(os.path.dirname(__file__), "data", "math_verify_cases.json")) as f:
  CASES = json.load(f)["cases"]

# case id -> why our verdict differs from Math-Verify's on purpose.
_ONE_LINE_SPAN = ("its test reads with LaTeX extraction alone, which takes no `$`/`\\(` span "
                  "across lines; the answer is plainly 9, and Math-Verify's default reading "
                  "(LaTeX and expressions, TRL's) gives 9 too")
DISAGREE: dict[str, str] = {
    "test_all.py::test_latex_notation[5]": _ONE_LINE_SPAN,
    "test_all.py::test_latex_notation[6]": _ONE_LINE_SPAN,
}

MIN_AGREEMENT = 0.98


def reward_for(case):
  """MathAccuracy with the `verify` options the case's test passes to Math-Verify
  (float_rounding, strict, allow_set_relation_comp); not its extraction targets."""
  settings = case["settings"]
  return MathAccuracy(float_rounding=settings.get("precision") or 6,
                      strict=settings.get("strict", True) is not False,
                      allow_set_relation_comp=bool(settings.get("allow_set_relation_comp")))


@pytest.fixture(scope="module")
def ours():
  """case id -> our verdict (0/1), graded once per module."""
  cache = {}

  def grade(case):
    if case["id"] not in cache:
      r = reward_for(case)(completions=[case["pred"]], answer=[case["gold"]])[0]
      # TIMED_OUT is no verdict (and truthy): the budget, not the grader, decided.
      assert r is not TIMED_OUT, f"{case['id']} ran out of its CPU budget"
      cache[case["id"]] = int(bool(r))  # None counts as wrong (the math_agreement workload too)
    return cache[case["id"]]
  return grade


def test_disagree_names_known_cases():
  unknown = sorted(set(DISAGREE) - {c["id"] for c in CASES})
  assert not unknown, f"DISAGREE names cases not in the data: {unknown}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case(case, ours):
  got, expected = ours(case), int(case["expected"])
  if case["id"] in DISAGREE:
    # An entry that no longer differs is stale: it would hide a regression.
    assert got != expected, f"we now agree with Math-Verify: remove {case['id']} from DISAGREE"
    return
  assert got == expected, (f"gold={case['gold']!r} pred={case['pred']!r}: "
                           f"Math-Verify's test expects {expected}, MathAccuracy gives {got}")


def test_aggregate(ours):
  got = [(ours(c), int(c["expected"])) for c in CASES]
  false_pos = sum(g == 1 and e == 0 for (g, e), c in zip(got, CASES) if c["id"] not in DISAGREE)
  agreement = sum(g == e for g, e in got) / len(got)
  assert false_pos == 0, (f"{false_pos} false positives "
                          "(see python bench/run.py math_agreement --only-fp)")
  assert agreement >= MIN_AGREEMENT, (
      f"agreement {agreement:.1%} < {MIN_AGREEMENT:.0%} over {len(got)} cases "
      "(see python bench/run.py math_agreement)")
