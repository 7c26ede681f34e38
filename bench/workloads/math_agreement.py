"""The math verifier against Math-Verify's own test verdicts (tests/data/math_verify_cases.json).

Each case's prediction is graded as a completion against its gold as the answer
column, with the `verify` options its test passes to Math-Verify; a None reward
and a timeout count as 0. Prints the agreement, the false positives (we reward,
Math-Verify's test says wrong) and false negatives, the time per case, then every
disagreement (--only-fp: the false positives alone). tests/test_math_verify_suite.py
holds the same verdicts case by case. The CPU alone works here; --device changes
nothing. --quick: the first 40 cases.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from grpojax.rewards.base import TIMED_OUT
from grpojax.rewards.math import MathAccuracy

CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "tests", "data", "math_verify_cases.json")
WIDTH = 120


def add_arguments(parser) -> None:
  parser.add_argument("--cases", default=CASES)
  parser.add_argument("--only-fp", action="store_true", help="list only the false positives")


def reward_for(case) -> MathAccuracy:
  """MathAccuracy with the `verify` options the case's test passes to Math-Verify."""
  settings = case["settings"]
  return MathAccuracy(float_rounding=settings.get("precision") or 6,
                      strict=settings.get("strict", True) is not False,
                      allow_set_relation_comp=bool(settings.get("allow_set_relation_comp")))


def grade(case) -> int:
  r = reward_for(case)(completions=[case["pred"]], answer=[case["gold"]])[0]
  return int(r is not TIMED_OUT and bool(r))


def short(value) -> str:
  s = repr(value)
  return s if len(s) <= WIDTH else s[:WIDTH - 3] + "..."


def run(args) -> dict:
  with open(args.cases, encoding="utf-8") as f:
    cases = json.load(f)["cases"][:40 if args.quick else None]
  # The first call starts the math-verify child process (imports sympy): start-up,
  # not grading, so it stays out of the per-case times.
  MathAccuracy()(completions=["1"], answer=[r"\frac{1}{2}"])
  rows, seconds = [], []
  start = time.perf_counter()
  for case in cases:
    t = time.perf_counter()
    ours = grade(case)
    seconds.append(time.perf_counter() - t)
    if ours != int(case["expected"]):
      rows.append({"id": case["id"], "gold": case["gold"], "pred": case["pred"],
                   "expected": int(case["expected"]), "ours": ours, "kind": "fp" if ours else "fn"})
  total_s = time.perf_counter() - start
  n = len(cases)
  fp = sum(r["kind"] == "fp" for r in rows)
  out = dict(cases=n, agreement=(n - len(rows)) / n, false_positives=fp,
             false_negatives=len(rows) - fp, median_ms=1e3 * statistics.median(seconds),
             max_ms=1e3 * max(seconds), total_s=total_s)
  print(f"cases: {n}; agreement {n - len(rows)}/{n} = {out['agreement']:.1%}; false positives "
        f"(ours 1, expected 0): {fp}; false negatives (ours 0, expected 1): {len(rows) - fp}")
  print(f"time per case: median {out['median_ms']:.1f} ms, max {out['max_ms']:.1f} ms; total "
        f"{total_s:.1f} s")
  shown = [r for r in rows if r["kind"] == "fp"] if args.only_fp else rows
  if shown:
    print(f"\n{'false positives' if args.only_fp else 'disagreements'}: {len(shown)}")
  for r in shown:
    print(f"{r['id'].replace('::', ':')}  gold={short(r['gold'])} pred={short(r['pred'])} "
          f"expected={r['expected']} ours={r['ours']}")
  out["disagreements"] = [r["id"] for r in shown]
  return out
