"""Generated tasks that need no download: arithmetic problems with exact answers."""

from __future__ import annotations

import random

OPS = "+-*"


def arithmetic_rows(n: int, *, seed: int, digits: int = 2, ops: str = "+-",
                    terms: int = 2) -> list[dict]:
  """`n` problems like {"question": "37+8=", "answer": "45"}.

  Operands have 1..`digits` digits; `ops` picks among + - *; `terms` operands
  per problem. The same seed gives the same rows (train and eval use disjoint seeds).
  """
  if not set(ops) <= set(OPS) or not ops:
    raise ValueError(f"ops={ops!r} must be a non-empty subset of {OPS!r}")
  if digits < 1 or terms < 2:
    raise ValueError(f"digits={digits} must be >= 1 and terms={terms} >= 2")
  rng = random.Random(seed)
  rows = []
  for i in range(n):
    nums = [rng.randint(0, 10**rng.randint(1, digits) - 1) for _ in range(terms)]
    chosen = [rng.choice(ops) for _ in range(terms - 1)]
    expr = str(nums[0]) + "".join(f"{o}{x}" for o, x in zip(chosen, nums[1:]))
    rows.append({"id": i, "question": f"{expr}=", "answer": str(_value(nums, chosen))})
  return rows


def _value(nums: list[int], ops: list[str]) -> int:
  """The expression's value with * binding tighter than + and -."""
  total, product, sign = 0, nums[0], 1
  for op, x in zip(ops, nums[1:]):
    if op == "*":
      product *= x
    else:
      total += sign * product
      product, sign = x, (1 if op == "+" else -1)
  return total + sign * product
