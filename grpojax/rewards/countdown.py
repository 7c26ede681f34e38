"""Countdown: reach the target with + − × ÷ using each given number exactly once.

The equation is parsed by a small recursive-descent parser over exact
fractions (nothing is eval'd); unary minus, decimals, concatenated digits
and numbers not in the list are all rejected.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence
from fractions import Fraction

from grpojax.rewards.base import completion_text

MAX_CHARS = 200
MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/×÷()]))")
_OPS = {"×": "*", "÷": "/"}


class _ParseError(ValueError):
  pass


def _tokens(expr: str) -> list[str]:
  out, pos, expr = [], 0, expr.strip()
  while pos < len(expr):
    m = _TOKEN.match(expr, pos)
    if not m:
      raise _ParseError(f"unexpected {expr[pos:pos + 10]!r}")
    num, op = m.groups()
    if num is not None and len(num) > 9:
      raise _ParseError("number too long")
    out.append(num if num is not None else _OPS.get(op, op))
    pos = m.end()
  return out


class _Parser:
  """expr := term (('+'|'-') term)* ; term := atom (('*'|'/') atom)* ;
  atom := NUMBER | '(' expr ')'."""

  def __init__(self, tokens: list[str]):
    self.tokens, self.i, self.numbers = tokens, 0, []

  def peek(self):
    return self.tokens[self.i] if self.i < len(self.tokens) else None

  def take(self):
    tok = self.peek()
    self.i += 1
    return tok

  def expr(self, depth=0) -> Fraction:
    value = self.term(depth)
    while self.peek() in ("+", "-"):
      op, rhs = self.take(), self.term(depth)
      value = value + rhs if op == "+" else value - rhs
    return value

  def term(self, depth) -> Fraction:
    value = self.atom(depth)
    while self.peek() in ("*", "/"):
      op, rhs = self.take(), self.atom(depth)
      if op == "/" and rhs == 0:
        raise _ParseError("division by zero")
      value = value * rhs if op == "*" else value / rhs
    return value

  def atom(self, depth) -> Fraction:
    if depth > MAX_DEPTH:
      raise _ParseError("too deeply nested")
    tok = self.take()
    if tok == "(":
      value = self.expr(depth + 1)
      if self.take() != ")":
        raise _ParseError("unbalanced parentheses")
      return value
    if tok is not None and tok.isdigit():
      self.numbers.append(int(tok))
      return Fraction(int(tok))
    raise _ParseError(f"expected a number or '(', got {tok!r}")


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
  """Exact value of an arithmetic expression and the numbers it uses.

  Raises ValueError on anything that is not + − × ÷, parentheses and
  non-negative integers (so `-3+5`, `2.5`, `2**3` and names are rejected).
  """
  if len(expr) > MAX_CHARS:
    raise _ParseError(f"longer than {MAX_CHARS} characters")
  parser = _Parser(_tokens(expr))
  value = parser.expr()
  if parser.peek() is not None:
    raise _ParseError(f"unexpected {parser.peek()!r}")
  return value, parser.numbers


def is_valid_solution(expr: str, numbers: Sequence[int], target: int | Fraction, *,
                      use_all: bool = True) -> bool:
  """Does `expr` reach `target` using the given numbers at most (or, with
  `use_all`, exactly) once each?"""
  try:
    value, used = evaluate(expr)
  except ValueError:
    return False
  have, want = collections.Counter(used), collections.Counter(int(n) for n in numbers)
  if use_all and have != want:
    return False
  if any(have[n] > want[n] for n in have):
    return False
  return value == Fraction(target)


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


_ARITHMETIC = re.compile(r"[\d\s()+\-*/×÷.]*\d[\d\s()+\-*/×÷.]*")


def extract_equation(text: str) -> str | None:
  """The equation in the last <answer>…</answer>, else on the last line
  that has a digit: its last run of arithmetic before any `= target`."""
  found = _ANSWER.findall(text)
  if found:
    candidate = found[-1]
  else:
    lines = [l for l in text.strip().splitlines() if re.search(r"\d", l)]
    if not lines:
      return None
    candidate = lines[-1]
  candidate = candidate.replace("\\times", "×").replace("\\div", "÷").split("=")[0]
  runs = _ARITHMETIC.findall(candidate)
  return runs[-1].strip().rstrip(".").strip() if runs else None


@dataclasses.dataclass(frozen=True)
class CountdownReward:
  """TRL-style reward: 1.0 for a valid equation, else 0.0.

  Columns: the numbers (`nums`, as in the TinyZero countdown data, or
  `numbers`) and `target`.
  """

  use_all: bool = True
  name: str = "countdown"

  @property
  def __name__(self) -> str:
    return self.name

  def __call__(self, prompts=None, completions=(), target=None, **columns) -> list[float]:
    nums = columns.get("nums", columns.get("numbers"))
    if nums is None or target is None:
      raise KeyError(f"{self.name} needs dataset columns 'target' and 'nums' (or 'numbers')")
    out = []
    for completion, numbers, t in zip(completions, nums, target):
      eq = extract_equation(completion_text(completion))
      ok = eq is not None and is_valid_solution(eq, numbers, t, use_all=self.use_all)
      out.append(1.0 if ok else 0.0)
    return out


countdown_reward = CountdownReward()
