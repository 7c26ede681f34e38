"""Math answers: extraction from completions and equivalence with the gold answer.

`extract_answer` finds the final answer (last \\boxed{...}, GSM8K's `#### 42`,
an <answer> tag, then a configurable fallback). `is_equivalent` decides
plain numbers itself, exactly (fractions, decimals, thousands separators,
percent, currency, units, `x = 5`; a tolerance only where the gold is itself
inexact), refuses equations, prose around an answer and numbers too large to
build, and hands everything else (radicals, π, ∞, tuples/sets/intervals,
algebra) to math-verify in a child process with a hard per-call timeout.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from fractions import Fraction

from grpojax.rewards.base import completion_text

DEFAULT_TIMEOUT_S = 2.0
MAX_ANSWER_CHARS = 1000
MAX_SCAN_CHARS = 20_000  # extraction reads at most this many final characters
MAX_DIGITS = 100_000  # a number with more digits is refused, never built
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")

# ----------------------------------------------------------------- extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"####\s*([^\n]+)")
_ANSWER_PHRASE = re.compile(r"(?i)\banswer\s*(?:is|:|=)\s*:?\s*([^\n]+)")
_BARE = re.compile(r"[^\s$]+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _closing_braces(text: str) -> dict[int, int]:
  """Position of each "{" -> its matching "}", in one pass over `text`.

  One scan for all groups keeps extraction linear: matching each \\boxed{
  on its own rescans the rest of the text for every unclosed box.
  """
  close, stack, i, n = {}, [], 0, len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2  # \{ and \} are literal braces (sets), not grouping
      continue
    if c == "{":
      stack.append(i)
    elif c == "}" and stack:
      close[stack.pop()] = i
    i += 1
  return close  # an unbalanced "{" (a completion cut off at max length) has no entry


def last_boxed(text: str) -> str | None:
  """Content of the last complete \\boxed{...} or \\fbox{...} (also `\\boxed 5`)."""
  close = None
  for m in reversed(list(_BOXED.finditer(text))):
    end = m.end()
    if end < len(text) and text[end] == "{":
      close = _closing_braces(text) if close is None else close
      content = text[end + 1:close[end]] if end in close else None
    elif m.group(0).endswith((" ", "\t")):
      bare = _BARE.match(text, end)
      content = bare.group(0) if bare else None
    else:
      content = None
    if content is not None and content.strip():
      return content.strip()
  return None


def _clean_tail(s: str) -> str:
  return s.strip().rstrip(".").strip().strip("$").strip()


def last_number(text: str) -> str | None:
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else None


def answer_phrase(text: str) -> str | None:
  """`The answer is X` / `Answer: X` (the last such phrase), else None."""
  matches = _ANSWER_PHRASE.findall(text)
  if not matches:
    return None
  ans = _clean_tail(re.split(r"\.\s", matches[-1])[0])
  return ans if 0 < len(ans) <= 100 else None


def _auto(text: str) -> str | None:
  return answer_phrase(text) or last_number(text)


FALLBACKS: dict[str, Callable[[str], str | None]] = {
    "auto": _auto,  # the answer phrase, else the last number
    "last_number": last_number,
    "answer_phrase": answer_phrase,
    "none": lambda text: None,
}


def extract_answer(text: str, *, fallback: str | Callable[[str], str | None] = "auto"
                   ) -> str | None:
  """The final answer in `text`, or None.

  In order: the last complete \\boxed{...} / \\fbox{...}; GSM8K's last
  `#### X`; the last <answer>...</answer>; then `fallback`, a name in
  FALLBACKS ("auto": `answer is X`, else the last number) or a callable.
  """
  if not isinstance(text, str):
    return None
  # Answers come last; the cap bounds the work on a runaway completion.
  text = text[-MAX_SCAN_CHARS:]
  if (boxed := last_boxed(text)) is not None:
    return boxed
  if m := _GSM8K.findall(text):
    return _clean_tail(m[-1]) or None
  # The last <answer>...</answer> by search from the end: a regex scan from
  # every unclosed "<answer>" would be quadratic.
  close = text.rfind("</answer>")
  if close >= 0 and (open_ := text.rfind("<answer>", 0, close)) >= 0:
    return text[open_ + len("<answer>"):close].strip() or None
  fn = FALLBACKS.get(fallback) if isinstance(fallback, str) else fallback
  if fn is None:
    raise ValueError(f"fallback={fallback!r} is unknown; known: {sorted(FALLBACKS)}")
  return fn(text)


# -------------------------------------------------------------- normalisation

_UNICODE = {"−": "-", "–": "-", "π": "\\pi ", "∞": "\\infty ", "×": "\\times ",
            "÷": "\\div ", "√": "\\sqrt ", "·": "\\cdot ", "°": "", "，": ","}
_SPACING = re.compile(r"\\left|\\right|\\[!,;: ]|~|\\displaystyle")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm|operatorname)\s*\{([^{}]*)\}")
# A unit after the value: 18\text{ cm}, 5\mathrm{m}^2 (letters only, at the very end).
_TRAILING_UNIT = re.compile(
    r"(?<=\S)\s*\\(?:text|textbf|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?$")
_PROSE = re.compile(r"\\(?:text|textbf|mbox|mathrm|operatorname)\s*\{")
_UNIT_WORDS = re.compile(r"^(-?[\d.,/]+)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})?$")
_ASSIGN = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?=[^=]+$)")


def normalise(ans: str) -> str:
  """Strip what never changes an answer's value: delimiters, spacing
  macros, units and currency, degree signs, `x =`, a final period."""
  s = ans.strip()
  for a, b in _UNICODE.items():
    s = s.replace(a, b)
  s = re.sub(r"^\$+|\$+$", "", s.strip())
  s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip())
  s = _SPACING.sub(" ", s)
  s = _DEGREES.sub("", s)
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  whole_text = _TEXT.fullmatch(s.strip())
  if whole_text:  # \text{(A)} is the answer itself, not a unit
    s = whole_text.group(1)
  else:
    s = _TRAILING_UNIT.sub("", s.strip())
    # Words anywhere else are prose around the answer (`4\text{ or }2`,
    # `\operatorname{foo}(42)`): they stay, so that such an answer matches
    # only a gold written the same way. Wrapped digits (\mathrm{42}) unwrap.
    s = _TEXT.sub(lambda m: m.group(0) if re.search(r"[A-Za-z]", m.group(1))
                  else m.group(1), s)
  s = re.sub(r"\\?\$|\\?%|\\euro|€|£|¥", "", s)
  s = s.strip().rstrip(".").strip()
  s = _ASSIGN.sub("", s)
  s = _UNIT_WORDS.sub(r"\1", s)
  return s.strip()


_PLAIN = re.compile(r"(-?)(\d{1,3}(?:,\d{3})+|\d*\.?\d+)(?:/(\d+))?")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?)\\frac(\d)(\d)")


def as_number(s: str) -> Fraction | None:
  """Exact value of a plain number (int, 1,234, -0.5, 3/4, \\frac{3}{4}), else None."""
  t = s.replace(" ", "")
  if m := _PLAIN.fullmatch(t):
    sign, num, den = m.groups()
    if len(num) > 50:
      return None
    value = Fraction(num.replace(",", ""))
    if den is not None:
      if int(den) == 0:
        return None
      value /= int(den)
    return -value if sign else value
  if m := _FRAC.fullmatch(t):
    sign, a, b, sign2, a2, b2 = m.groups()
    a, b = (a, b) if a is not None else (a2, b2)
    if int(b) == 0:
      return None
    value = Fraction(int(a), int(b))
    return -value if (sign or sign2) else value
  return None


def _terminates(x: Fraction) -> bool:
  """Has x a finite decimal expansion (its denominator is 2^a 5^b)?"""
  d = x.denominator
  for f in (2, 5):
    while d % f == 0:
      d //= f
  return d == 1


def _numbers_equal(p: Fraction, g: Fraction, p_text: str, g_text: str) -> bool:
  if p == g:
    return True
  # Tolerance only where the gold is itself inexact: a gold written as a
  # decimal may be rounded (3.14159265, 0.0), and 1/3 can only be written
  # rounded as a decimal (0.333333). There the check is 6 significant
  # digits, as math-verify's, with an absolute floor of 1e-6 for golds
  # below 1. An integer or terminating gold (1234567, 0, 3/4) is exact:
  # 1234568.0 is not 1234567, and 0.0000009 is not 0.
  if "." in g_text or ("." in p_text and not _terminates(g)):
    return abs(p - g) <= Fraction(1, 10**6) * max(abs(g), 1)
  return False


_POWER = re.compile(r"\d+(?:\s*\^\s*[{(]*\s*\d+)+")
_FACTORIAL = re.compile(r"(\d{5,})\s*!")
_NUMERIC_GROUP = re.compile(r"[\d\s^{}()]+")
MAX_EXPONENT = 100_000  # 2^100000 already has 30,103 digits


def _tower_digits(numbers: list[int]) -> float:
  """Decimal digits of a^(b^(c^...)), inf when beyond MAX_DIGITS."""
  exponent = numbers[-1]
  for base in reversed(numbers[:-1]):
    if base in (0, 1):
      exponent = base
      continue
    if exponent.bit_length() > 64 or exponent * math.log10(base) > MAX_DIGITS:
      return math.inf
    exponent = base ** exponent
  return math.log10(exponent + 1)


def _exponents(s: str):
  """The text of every exponent: `^{...}`, `^(...)` or `^token`."""
  for m in re.finditer(r"\^\s*", s):
    i = m.end()
    if i < len(s) and s[i] in "{(":
      close, depth = {"{": "}", "(": ")"}[s[i]], 0
      for j in range(i, len(s)):
        depth += s[j] == s[i]
        depth -= s[j] == close
        if depth == 0:
          yield s[i + 1:j]
          break
    elif tok := re.match(r"\d+", s[i:]):
      yield tok.group(0)


def too_large(s: str) -> bool:
  """Would building this number take unbounded time or memory?"""
  s = s.replace("**", "^")
  for m in _POWER.finditer(s):
    nums = [int(x) for x in re.findall(r"\d+", m.group(0))]
    if any(len(str(x)) > 12 for x in nums[1:]) or _tower_digits(nums) > MAX_DIGITS:
      return True
  for exp in _exponents(s):
    # Whatever the base, a numeric exponent past MAX_EXPONENT is refused.
    if _NUMERIC_GROUP.fullmatch(exp) and (nums := [int(x) for x in re.findall(r"\d+", exp)]):
      if _tower_digits(nums) > math.log10(MAX_EXPONENT):
        return True
  return bool(_FACTORIAL.search(s))


def _shape(s: str) -> str:
  """Outer bracket kind: a set never equals a tuple or an interval."""
  if s.startswith("\\{") and s.endswith("\\}"):
    return "set"
  if s[:1] in "([" and s[-1:] in ")]" and "," in s:
    return "sequence"
  return "other"


# ------------------------------------------------------------ symbolic checks

class _Symbolic:
  """math-verify in a child process; replaced when a call overruns."""

  def __init__(self):
    self._proc = None
    self._owner = None
    self._ready = False
    self._lock = threading.Lock()

  def _spawn(self):
    self._proc = subprocess.Popen(
        [sys.executable, "-I", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
    self._owner, self._ready = os.getpid(), False

  def _await_ready(self):
    if not select.select([self._proc.stdout], [], [], 120)[0] or \
            self._proc.stdout.readline().strip() != "ready":
      self.close()
      raise RuntimeError("the math-verify worker did not start; is math-verify installed?")
    self._ready = True

  def close(self):
    if self._proc is not None and self._owner == os.getpid():
      self._proc.kill()
      self._proc.wait()
    self._proc = None

  def equivalent(self, pred: str, gold: str, timeout_s: float) -> bool:
    with self._lock:
      if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
        self._proc = None  # a forked copy must not share its parent's pipes
        self._spawn()
      if not self._ready:
        self._await_ready()
      request = json.dumps({"p": pred, "g": gold, "t": math.ceil(timeout_s)})
      try:
        self._proc.stdin.write(request + "\n")
        self._proc.stdin.flush()
        if select.select([self._proc.stdout], [], [], timeout_s)[0]:
          return self._proc.stdout.readline().strip() == "1"
      except (OSError, ValueError):
        pass
      # Late or broken: its next answer would be stale. The replacement
      # starts now, so its import time overlaps the caller's other work.
      self.close()
      self._spawn()
      return False


_SYMBOLIC = _Symbolic()
atexit.register(_SYMBOLIC.close)


def is_equivalent(prediction: str | None, gold: str | None, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
  """Is the predicted answer mathematically the gold one?

  Both are answers already extracted (see `extract_answer`). Plain numbers
  are compared here, exactly; other forms go to math-verify (symbolic,
  sets/tuples/intervals, units) in a child process killed after
  `timeout_s`. Answers that would build astronomically large numbers are
  refused (False) without evaluation, and nothing is ever eval'd.
  """
  if not isinstance(prediction, str) or not isinstance(gold, str):
    return False
  if max(len(prediction), len(gold)) > 4 * MAX_ANSWER_CHARS:
    return False  # before normalising: its regexes should not see a whole essay
  p, g = normalise(prediction), normalise(gold)
  if not p or not g or len(p) > MAX_ANSWER_CHARS or len(g) > MAX_ANSWER_CHARS:
    return False
  if p.replace(" ", "") == g.replace(" ", ""):
    return True
  # An equation (`0 = 42`, `x+1 = 42`) is not its right-hand side; a single
  # variable's `x = 42` was already reduced to 42 by normalise. Words left
  # after normalising are prose, equal only when written as in the gold.
  if ("=" in p) != ("=" in g) or _PROSE.search(p) or _PROSE.search(g):
    return False
  pn, gn = as_number(p), as_number(g)
  if pn is not None and gn is not None:
    return _numbers_equal(pn, gn, p, g)
  if too_large(p) or too_large(g):
    return False
  if {_shape(p), _shape(g)} == {"set", "sequence"}:
    return False
  return _SYMBOLIC.equivalent(p, g, timeout_s)


def answer_key(text: str, *, fallback: str = "auto") -> str | None:
  """The final answer of a completion in a canonical form for majority voting, or None.

  The answer MathAccuracy would judge (same extraction), normalised as
  `is_equivalent` normalises it, without spaces; a plain number as its exact
  value (0.5, 1/2 and \\frac{1}{2} are one answer: "1/2"; 1,000 is "1000").
  """
  pred = extract_answer(text, fallback=fallback)
  if pred is None or len(pred) > 4 * MAX_ANSWER_CHARS:
    return None
  key = normalise(pred).replace(" ", "")
  if not key or len(key) > MAX_ANSWER_CHARS:
    return None
  number = as_number(key)
  return str(number) if number is not None else key


# ------------------------------------------------------------------- rewards

def gold_answer(reference) -> str | None:
  """The answer inside a reference: a bare answer, a GSM8K `#### X` rationale
  or a MATH solution with \\boxed{X}."""
  if reference is None:
    return None
  ref = str(reference)
  return extract_answer(ref, fallback="none") or ref.strip() or None


@dataclasses.dataclass(frozen=True)
class MathAccuracy:
  """TRL-style reward: 1.0 when the completion's final answer equals the gold.

  Gold comes from the first present column of `gold_columns` (row None:
  reward None). A completion without an answer scores 0.0.
  """

  gold_columns: tuple[str, ...] = ("answer", "solution")
  fallback: str = "auto"
  timeout_s: float = DEFAULT_TIMEOUT_S
  name: str = "math_accuracy"

  @property
  def __name__(self) -> str:
    return self.name

  def __call__(self, prompts=None, completions=(), **columns) -> list[float | None]:
    col = next((columns[c] for c in self.gold_columns if c in columns), None)
    if col is None:
      raise KeyError(f"{self.name} needs one of the dataset columns {self.gold_columns}")
    out = []
    for completion, ref in zip(completions, col):
      gold = gold_answer(ref)
      if gold is None:
        out.append(None)
        continue
      pred = extract_answer(completion_text(completion), fallback=self.fallback)
      out.append(float(is_equivalent(pred, gold, timeout_s=self.timeout_s)))
    return out


math_accuracy_reward = MathAccuracy()
