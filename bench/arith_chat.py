"""The 2-digit arithmetic chat task of the trl_side_by_side workload, in TRL's formats: rows
of a conversational `prompt` and a `solution`, and one reward function with TRL's
signature. A module of its own, so that both trainers, and grpojax's command line
resuming a run from its config, import the same function by the same name
(arith_chat:correct)."""

from __future__ import annotations

import random
import re

INSTRUCTION = "Answer with the number only."


def rows(n: int, seed: int) -> list[dict]:
  """n rows of "What is a + b?" / "a - b" with 2-digit operands, from `seed`."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
    out.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}],
                "solution": str(a + b if op == "+" else a - b)})
  return out


def answer(text: str) -> str | None:
  """The completion's answer: its last integer, or None."""
  found = re.findall(r"-?\d+", text.replace(",", ""))
  return found[-1] if found else None


def correct(completions, solution, **kwargs) -> list[float]:
  """1.0 where the completion's last integer is the solution (TRL's signature)."""
  return [float(answer(c[0]["content"]) == s) for c, s in zip(completions, solution)]


# The split the side-by-side trains on and the one it scores, fixed whatever the run's seed.
TRAIN = dict(n=2000, seed=1234)
HELD_OUT = dict(n=200, seed=98765)
