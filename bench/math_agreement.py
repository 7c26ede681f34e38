"""Agreement of MathAccuracy with Math-Verify's own test verdicts (tests/data/math_verify_cases.json).

    python bench/math_agreement.py [--cases PATH] [--json OUT] [--only-fp]

Each case's prediction is graded as a completion against its gold as the
answer column; a None reward counts as 0. Prints the agreement, false
positives (we reward, Math-Verify's test says wrong), false negatives, the
time per case, then every disagreement. `--json OUT` also writes the
disagreements to OUT; `--only-fp` lists only the false positives.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpojax.rewards.base import TIMED_OUT  # noqa: E402
from grpojax.rewards.math import MathAccuracy  # noqa: E402

CASES = os.path.join(ROOT, "tests", "data", "math_verify_cases.json")
WIDTH = 120


def load_cases(path=CASES):
  with open(path) as f:
    return json.load(f)["cases"]


def reward_for(case) -> MathAccuracy:
  """MathAccuracy with the `verify` options the case's test passes to Math-Verify."""
  settings = case["settings"]
  return MathAccuracy(float_rounding=settings.get("precision") or 6,
                      strict=settings.get("strict", True) is not False,
                      allow_set_relation_comp=bool(settings.get("allow_set_relation_comp")))


def grade(reward, case) -> int:
  r = reward_for(case)(completions=[case["pred"]], answer=[case["gold"]])[0]
  return int(r is not TIMED_OUT and bool(r))  # None (no gold) and a timeout count as wrong


def short(value) -> str:
  s = repr(value)
  return s if len(s) <= WIDTH else s[:WIDTH - 3] + "..."


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default=CASES)
  ap.add_argument("--json", metavar="OUT", help="write the disagreements to OUT")
  ap.add_argument("--only-fp", action="store_true", help="list only the false positives")
  args = ap.parse_args()

  cases = load_cases(args.cases)
  reward = MathAccuracy()
  # The first call starts the math-verify child process (imports sympy):
  # start-up, not grading, so it stays out of the per-case times.
  reward(completions=["1"], answer=[r"\frac{1}{2}"])

  rows, seconds = [], []
  start = time.perf_counter()
  for case in cases:
    t = time.perf_counter()
    ours = grade(reward, case)
    seconds.append(time.perf_counter() - t)
    expected = int(case["expected"])
    if ours != expected:
      rows.append({"id": case["id"], "gold": case["gold"], "pred": case["pred"],
                   "expected": expected, "ours": ours, "mv": case.get("mv"),
                   "kind": "fp" if ours else "fn"})
  total_s = time.perf_counter() - start

  n = len(cases)
  fp = sum(r["kind"] == "fp" for r in rows)
  fn = len(rows) - fp
  print(f"cases: {n}")
  print(f"agreement: {n - len(rows)}/{n} = {100 * (n - len(rows)) / n:.1f}%")
  print(f"false positives (ours 1, expected 0): {fp}")
  print(f"false negatives (ours 0, expected 1): {fn}")
  print(f"time per case: median {1e3 * statistics.median(seconds):.1f} ms, "
        f"max {1e3 * max(seconds):.1f} ms; total {total_s:.1f} s")
  shown = [r for r in rows if r["kind"] == "fp"] if args.only_fp else rows
  if shown:
    print(f"\n{'false positives' if args.only_fp else 'disagreements'}: {len(shown)}")
  for r in shown:
    # file:test[index]: the index makes the line name its case id (DISAGREE keys).
    print(f"{r['id'].replace('::', ':')}  gold={short(r['gold'])} pred={short(r['pred'])} "
          f"expected={r['expected']} ours={r['ours']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(shown, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
  main()
