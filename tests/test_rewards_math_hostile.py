"""The math grader against hostile input and a hostile machine (issue 49).

Work in the caller's process is linear in the completion and only the final
answer is parsed; Math-Verify's share runs in a worker under a CPU-time
budget, and running out of it is TIMED_OUT, never a 0. Costs are measured in
CPU time of this process and compared across input sizes, never against the
wall clock: a busy machine must not fail these tests, nor change a verdict.
"""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import grpojax.rewards.math as m
from grpojax.rewards.base import TIMED_OUT, compute_rewards
from grpojax.rewards.math import MathAccuracy, answer_key, extract_answer, grade_many

# (name, make(n) -> a completion whose length grows with n). Each aims at one
# way a scan or a regex goes quadratic: nesting, long runs of one token,
# statements repeated, spaces between the parts of a pattern.
HOSTILE = [
    ("nested_fbox", lambda n: "\\fbox{" * n + "1" + "}" * n),  # the 700 deep
    ("unclosed_fbox", lambda n: "\\fbox{" * n),
    ("nested_boxed_fbox", lambda n: "\\boxed{\\fbox{" * n + "1" + "}}" * n),
    ("bare_boxes", lambda n: "\\boxed\\boxed" * n),
    ("one_box_group", lambda n: "\\boxed{1}, " * n),
    ("boxes_apart", lambda n: "\\boxed{1} then. " * n),
    ("phrases", lambda n: "The answer is 5. " * n),
    ("bare_phrases", lambda n: "answer is " * n),
    ("corrections", lambda n: "Wait, it's " * n),
    ("cues_then_a_long_word", lambda n: "wait " * n + "a" * (4 * n)),
    ("dollars", lambda n: "$" * n),
    ("unclosed_parens", lambda n: "\\( x" * n),
    ("unclosed_brackets", lambda n: "\\[ x" * n),
    ("braces", lambda n: "{" * n),
    ("gsm8k_marks", lambda n: "#### " * n),
    ("answer_tags", lambda n: "<answer>" * n),
    ("nested_exponents", lambda n: "\\boxed{" + "2^{" * n + "2" + "}" * n + "}"),
    ("nested_parens", lambda n: "\\boxed{" + "(" * n + "1" + ")" * n + "}"),
    ("nested_fracs", lambda n: "\\boxed{" + "\\frac{1}{" * n + "2" + "}" * n + "}"),
    ("digits", lambda n: "\\boxed{" + "1" * n + "}"),
    ("spaced_digits", lambda n: "The answer is " + "1 " * n),
    ("number_words", lambda n: "The answer is " + "10 million " * n),
    ("spaces_before_factorial", lambda n: "\\boxed{5" + " " * n + "!}"),
    ("spaces_before_and", lambda n: "\\boxed{1" + " " * n + "and 2}"),
    ("spaces_before_word", lambda n: "\\boxed{1" + " " * n + "x}"),
    ("spaces_around_slash", lambda n: "\\boxed{1" + " " * n + "x/2}"),
    ("equations", lambda n: "The answer is " + "1 = " * n),
    ("units", lambda n: "\\boxed{5" + "\\text{ km}" * n + "}"),
    ("text_groups", lambda n: "\\boxed{" + "\\text{" * n + "}"),
]
# Lengths of the smaller completion: within one answer's bound, and far past it.
LENGTHS = (400, 4000)
GROWTH = 8  # the larger is this much longer; a quadratic cost grows GROWTH**2 = 64 times


def cpu_seconds(fn, *args, repeats=3):
  """The least CPU time of this process over `repeats` calls: a garbage
  collection or a neighbour's cache traffic is not the function's cost."""
  best = math.inf
  for _ in range(repeats):
    start = time.process_time()
    fn(*args)
    best = min(best, time.process_time() - start)
  return best


def sized(make, length):
  unit = len(make(1))
  return make(max(1, length // unit))


@pytest.fixture
def no_worker(monkeypatch):
  """Math-Verify's share answered False at once, so that what is measured is
  this process's work; the requests it would have got are kept."""
  asked = []

  def ask_many(requests, timeout_s):
    asked.extend(requests)
    return [False] * len(requests)
  monkeypatch.setattr(m._SYMBOLIC, "ask_many", ask_many)
  return asked


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name,make", HOSTILE, ids=[name for name, _ in HOSTILE])
def test_grading_is_linear_in_the_completion(name, make, length, no_worker):
  small, large = sized(make, length), sized(make, GROWTH * length)

  def grade(text):
    grade_many([text], ["1"])
    extract_answer(text)
    answer_key(text)
  floor = 1e-3  # below this, a call is overhead: no ratio to speak of
  ratio = cpu_seconds(grade, large) / max(cpu_seconds(grade, small), floor)
  assert ratio < GROWTH * 3, f"{name}: {GROWTH}x longer input took {ratio:.0f}x the CPU time"


@pytest.mark.parametrize("name,make", HOSTILE, ids=[name for name, _ in HOSTILE])
def test_math_verify_parses_a_bounded_answer(name, make, no_worker):
  grade_many([sized(make, 100_000)], ["1"])
  assert all(len(r["c"]) <= m.MAX_VERIFY_CHARS for r in no_worker), (
      name, [len(r["c"]) for r in no_worker])


def test_nested_boxes_are_read_once():
  # A box holding only a box is that box; 700 deep (the 5 KB of
  # `\fbox{`) is junk, refused without reading it 700 times over.
  reward = MathAccuracy()
  assert reward(completions=[r"\boxed{\boxed{7}}", r"\fbox{\boxed{ 7 }}"], answer=["7", "7"]) == [
      1.0, 1.0]
  assert reward(completions=["\\fbox{" * 700 + "1" + "}" * 700], answer=["1"]) == [0.0]


@pytest.mark.parametrize("filler", [100, 5_000, 30_000, 300_000])
def test_where_the_answer_sits_does_not_change_the_verdict(filler):
  text = " Let me double-check the arithmetic once more." * (filler // 46 + 1)
  rows = [
      (rf"\boxed{{3}}{text}", "3", 1.0),  # a right box, then a long check
      (rf"\boxed{{3}}{text} 7", "7", 0.0),  # a wrong box, a matching stray number
      (rf"The answer is 3.{text} 7", "3", 1.0),
      (rf"{text} So the answer is \boxed{{3}}.", "3", 1.0),
      (rf"\boxed{{2}}{text} Actually, it's 3.", "3", 1.0),
  ]
  reward = MathAccuracy()
  assert reward(completions=[c for c, _, _ in rows], answer=[g for _, g, _ in rows]) == [
      v for _, _, v in rows]


def _fake_worker(tmp_path, body):
  """A stand-in for _math_worker.py that answers "ready", then runs `body`
  for each request: a worker whose own SIGPROF never fires (as when sympy
  spins in C) or that has stopped."""
  path = tmp_path / "fake_worker.py"
  path.write_text("import sys, time\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
                  + textwrap.indent(body, "  ") + "\n")
  return str(path)


@pytest.mark.parametrize("body,why", [("while True: pass", "cpu"), ("time.sleep(3600)", "wall")])
def test_a_worker_that_ignores_its_budget_is_killed(body, why, tmp_path, monkeypatch):
  # "cpu": its CPU time, read by the parent, passes the budget; "wall": it uses
  # none but never answers (stopped, swapping), for longer than wall_bound.
  monkeypatch.setattr(m, "_WORKER", _fake_worker(tmp_path, body))
  monkeypatch.setattr(m, "_MIN_WALL_S", 1.0 if why == "wall" else 600.0)
  monkeypatch.setattr(m, "WALL_FACTOR", 1)
  reasons, overran = [], m._Symbolic._overran

  def spy(worker, cpu_limit, wall_limit):
    reason = overran(worker, cpu_limit, wall_limit)
    reasons.append(reason)
    return reason
  monkeypatch.setattr(m._Symbolic, "_overran", staticmethod(spy))
  symbolic = m._Symbolic(processes=1)
  try:
    symbolic._ensure()
    working = symbolic._workers[0]
    assert symbolic.ask_many([{"p": "1", "g": "1"}], timeout_s=0.2) == [TIMED_OUT]
    assert why in reasons
    assert working.proc.poll() is not None  # killed, and the spare took its place
    assert working not in symbolic._workers and len(symbolic._workers) == 2
  finally:
    symbolic.close()


def test_a_timed_out_row_is_left_out_of_the_group_and_counted():
  slow = r"$(x+1)^{3000}$"
  out = compute_rewards([MathAccuracy(timeout_s=0.3)], [""] * 3,
                        [slow, r"\boxed{2}", r"\boxed{3}"], {"answer": ["x^{3000}+1", "2", "2"]})
  np.testing.assert_array_equal(out.rewards[:, 0], [np.nan, 1.0, 0.0])
  assert list(out.timeouts) == [1] and list(out.errors) == [0]


@pytest.mark.slow
def test_verdicts_do_not_depend_on_machine_load():
  # Answers that each take a fraction of a CPU second of Math-Verify's work
  # (parsing a degree-32 polynomial, expanding a power), right and wrong. Each
  # is first graded alone with no budget to speak of, its CPU cost read from the
  # worker; then fresh workers (no answer cached) grade them all under a budget
  # of 2.5x the dearest one's cost, with four CPU-bound processes per core beside
  # them. There each answer's wall time is about 5x its CPU time, so a wall-clock
  # budget of that size runs out on the dearest; a CPU budget does not. The
  # budget is measured, not fixed: a slower machine has dearer answers.
  import sympy
  x = sympy.Symbol("x")
  rows = []
  for k in range(2, 6):
    gold = sympy.latex(sympy.expand((x + k) ** 32))
    right = k % 2 == 0
    power = rf"$(x+{k if right else k + 1})^{{32}}$"
    rows.append((f"The answer is {power}.", f"${gold}$", float(right)))
  warm_up = dict(completions=[r"$\sqrt{8}$"], answer=[r"2\sqrt{2}"])
  unbounded = MathAccuracy(timeout_s=120.0)
  m._SYMBOLIC.close()
  unbounded(**warm_up)
  working = m._SYMBOLIC._workers[:m._SYMBOLIC.processes]  # the spare never grades
  costs = []
  for completion, gold, expected in rows:  # each row's own gold: nothing cached between them
    before = sum(w.cpu_seconds() for w in working)
    assert unbounded(completions=[completion], answer=[gold]) == [expected]
    costs.append(sum(w.cpu_seconds() for w in working) - before)
  reward = MathAccuracy(timeout_s=max(0.5, 2.5 * max(costs)))
  m._SYMBOLIC.close()  # fresh workers: no answer is cached in them
  reward(**warm_up)
  completions, golds, expected = zip(*rows)
  burn = "import time\nend = time.time() + 120\nwhile time.time() < end: pass"  # ends itself
  burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(4 * os.cpu_count())]
  try:
    assert reward(completions=list(completions), answer=list(golds)) == list(expected), costs
  finally:
    for p in burners:
      p.send_signal(signal.SIGKILL)
      p.wait()
