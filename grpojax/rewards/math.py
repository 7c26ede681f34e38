"""Math answers: the reward's verdict, extraction, and equivalence of answers.

`MathAccuracy` (through `grade_many`) grades a completion as the reference
grader does: Math-Verify's own extraction (every box, unboxed LaTeX spans,
answer phrases, the last number last) and `verify` (relations, sets,
intervals, tuples, matrices, symbolic equality), in child processes with a
hard time budget per answer. Around it, what a careful human grader adds and
Math-Verify lacks: number words are read (`10 million`, `5 squared`, `2 1/2`,
`2.5e6`), an answer left uncertain by its words (`5 or more`, `4 2`) scores 0,
a boxed equation is not its right-hand side, numbers too large to build are
refused before anything evaluates them, and plain numbers in boxes (GSM8K)
are compared here, exactly, without a child process.

`extract_answer` and `is_equivalent` are the same pieces for one answer
already extracted (the last box, GSM8K's `#### 42`, an <answer> tag, then a
fallback): plain numbers exactly (fractions, decimals, thousands separators,
percent, currency, units, `x = 5`; a tolerance only where the gold is itself
inexact), everything else through Math-Verify. `answer_key` builds on them
for majority voting.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

from grpojax.rewards.base import completion_text

DEFAULT_TIMEOUT_S = 0.8  # one answer's verdict, all its work counted
MAX_ANSWER_CHARS = 1000
MAX_SCAN_CHARS = 20_000  # extraction reads at most this many final characters
MAX_DIGITS = 100_000  # a number with more digits is refused, never built
_STARTUP_S = 120.0  # a math-verify worker's import of sympy, on a loaded machine
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
# `x =`, `x_1 =`, `(p, q) =`, `f(x) =` before a single value: the name, not the answer.
_ASSIGN = re.compile(r"^(?:[A-Za-z](?:_\{?\w+\}?)?|\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])*\s*\)|"
                     r"[A-Za-z]\s*\(\s*[A-Za-z]\s*\))\s*=\s*(?=[^=<>]+$)")
_EQUALS = re.compile(r"(?<![<>!\\])=(?!=)")


def normalise(ans: str) -> str:
  """Strip what never changes an answer's value: delimiters, spacing
  macros, units and currency, degree signs, `x =`, a final period."""
  s = ans.strip()
  for a, b in _UNICODE.items():
    s = s.replace(a, b)
  s = re.sub(r"^\$+|\$+$", "", s.strip())
  s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip())
  s = s.replace("{,}", ",")
  # 16,\!386.20: a thousands comma with a thin space, not a list.
  s = re.sub(r"(?<=\d),\s*\\[!,;: ]\s*(?=\d{3}(?!\d))", ",", s)
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


# Math-Verify's number formats: thousands in groups of three after a 1-3
# digit lead, split by "," or a space (decimals may follow); otherwise a
# decimal point or a decimal comma (`0,111`, `1,22`, `1000,99`: these cannot
# be thousands). So `1,234` is 1234 and `4 2` is no number at all.
_PLAIN = re.compile(r"([-+]?)([1-9]\d{0,2}([ ,])\d{3}(?:\3\d{3})*(?:\.\d+)?|\d+(?:[.,]\d+)?|\.\d+)"
                    r"(?:/(\d+))?")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?)\\frac(\d)(\d)")


def as_number(s: str) -> Fraction | None:
  """Exact value of a plain number (int, 1,234, 1 000, -0.5, 0,111, 3/4, \\frac{3}{4}), else None."""
  t = re.sub(r"\s*/\s*", "/", s.strip())
  if m := _PLAIN.fullmatch(t):
    sign, num, sep, den = m.groups()
    if len(num) > 50:
      return None
    if sep:
      num = num.replace(sep, "")
    value = Fraction(num.replace(",", "."))
    if den is not None:
      if int(den) == 0:
        return None
      value /= int(den)
    return -value if sign == "-" else value
  if m := _FRAC.fullmatch(t.replace(" ", "")):
    sign, a, b, sign2, a2, b2 = m.groups()
    a, b = (a, b) if a is not None else (a2, b2)
    if int(b) == 0:
      return None
    value = Fraction(int(a), int(b))
    return -value if (sign or sign2) else value
  return None


def is_decimal(s: str) -> bool:
  """Is a plain number written with decimals (so possibly rounded)?"""
  m = _PLAIN.fullmatch(re.sub(r"\s*/\s*", "/", s.strip()))
  return bool(m) and ("." in m.group(2) or (not m.group(3) and "," in m.group(2)))


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


_FACTORIAL = re.compile(r"(\d{5,})\s*!")
_NUMERIC_GROUP = re.compile(r"[\d\s^{}()]+")
MAX_EXPONENT = 100_000  # 2^100000 already has 30,103 digits


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


_MAG_MACROS = ((r"\left", ""), (r"\right", ""), (r"\cdot", "*"), (r"\times", "*"),
               (r"\div", "/"), (r"\dfrac", ""), (r"\tfrac", ""), (r"\frac", ""), ("**", "^"))
_MAG_RUN = re.compile(r"[0-9.+\-*/^!(){}\[\]\s]+")


def _log10_bound(run: str) -> float:
  """An upper bound on log10 |value| of an arithmetic run (digits, + - * / ^ !,
  brackets; adjacent groups multiply), inf when it is astronomically large.

  Never builds a number: a value is its log10, an exponent's value is
  10**log10 only while that is small enough to mean anything.
  """
  toks = re.findall(r"\d+(?:\.\d*)?|\.\d+|[-+*/^!(){}\[\]]", run)
  pos = 0

  def peek():
    return toks[pos] if pos < len(toks) else None

  def take():
    nonlocal pos
    pos += 1
    return toks[pos - 1]

  def atom():
    t = peek()
    if t is None:
      return 0.0
    if t in "({[":
      take()
      v = expr()
      if peek() in (")", "}", "]"):
        take()
      return v
    if t[0].isdigit() or t[0] == ".":
      take()
      whole = t.split(".")[0].lstrip("0")
      if len(whole) > 15:
        return float(len(whole))
      return math.log10(int(whole)) if whole else 0.0
    return None  # an operator where a value belongs

  def postfix():
    v = atom()
    if v is None:
      return None
    while peek() == "!":
      take()
      if v > 15:  # n >= 10**15: n! is beyond any bound we allow
        return math.inf
      n = 10 ** v
      v = n * max(v, 1.0)  # log10(n!) <= n log10(n)
    return v

  def power():
    base = postfix()
    if base is None:
      return None
    if peek() == "^":
      take()
      exp = unary()
      if exp is None:
        return base
      if base <= 0:  # |base| <= 1 (up to a digit): no growth
        return base
      if exp > 300:
        return math.inf
      return base * 10 ** exp
    return base

  def unary():
    while peek() in ("-", "+"):
      take()
    return power()

  def term():
    v = unary()
    if v is None:
      return None
    while peek() is not None and peek() not in ("+", "-", ")", "}", "]"):
      if peek() in ("*", "/"):
        op = take()
        w = unary()
        if w is None:
          break
        v = v + w if op == "*" else v  # a quotient is no larger than its dividend (|divisor| >= 1)
      else:
        w = unary()  # juxtaposition: \frac{a}{b} and (a)(b) multiply
        if w is None:
          take()
          continue
        v += w
    return v

  def expr():
    v = term()
    if v is None:
      v = 0.0
    while peek() in ("+", "-"):
      take()
      w = term()
      v = max(v, w or 0.0) + 0.31  # |a + b| <= 2 max(|a|, |b|)
    return v

  try:
    total = 0.0
    while pos < len(toks):
      start = pos
      total = max(total, expr())
      if pos == start:
        pos += 1  # a stray closing bracket or operator
    return total
  except RecursionError:
    return math.inf


def too_large(s: str) -> bool:
  """Would building this number take unbounded time or memory?

  `(2^{99999})^{99999}`, `(9999!)!`, `9^{9^{9^9}}`, `10^{10^8}` are; a
  numeric exponent past MAX_EXPONENT is, whatever its base (`x^{10^8}`).
  """
  t = s
  for a, b in _MAG_MACROS:
    t = t.replace(a, b)
  # Without ^ or !, a run's value has at most as many digits as the run has
  # characters (fewer than MAX_DIGITS in any text read here): not worth a look.
  if any(_log10_bound(run) > MAX_DIGITS for run in _MAG_RUN.findall(t)
         if "^" in run or "!" in run):
    return True
  # Whatever the base, a numeric exponent past MAX_EXPONENT is refused.
  if any(_NUMERIC_GROUP.fullmatch(exp) and _log10_bound(exp) > math.log10(MAX_EXPONENT)
         for exp in _exponents(t)):
    return True
  return bool(_FACTORIAL.search(t))


def _shape(s: str) -> str:
  """Outer bracket kind: a set never equals a tuple or an interval."""
  if s.startswith("\\{") and s.endswith("\\}"):
    return "set"
  if s[:1] in "([" and s[-1:] in ")]" and "," in s:
    return "sequence"
  return "other"


# ------------------------------------------------------- words around numbers

# What a careful grader reads in words next to a number. A word that changes
# the value is applied (`10 million` is 10000000, `5 squared` is 25, `2 1/2`
# is 5/2, `2.5e6` is 2500000); a word that makes the value uncertain (`5 or
# more`, `about 5`, `4 or 5`) or digits run together by spaces (`4 2`) make the
# answer unreadable: it scores 0, never the gold by dropping the words.
_DIGITS = r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
_NUM = r"(?<![\w.,])" + _DIGITS
_SCALES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9,
           "trillion": 10**12}
_MULTIPLIERS = {**_SCALES, "dozen": 12, "score": 20}
_MULTIPLIER = re.compile(_NUM + r"[ \t]*(?:\\,|~)?[ \t]*(?:\\text\{\s*)?("
                         + "|".join(_MULTIPLIERS) + r")s?\b", re.IGNORECASE)
_POWER_WORD = re.compile(_NUM + r"[ \t]+(squared|cubed)\b", re.IGNORECASE)
_OPERATION = re.compile(_NUM + r"[ \t]+(times|plus|minus|over|divided[ \t]+by)[ \t]+" + _DIGITS,
                        re.IGNORECASE)
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?!\w|[.,]\d)")
_MIXED = re.compile(r"(?<![\w.,/])(\d+)[ \t]+(\d+)/(\d+)(?![\w/]|[.,]\d)")
_MIXED_TEX = re.compile(r"(?<![\w.,/}])(\d+)[ \t]*\\[dt]?frac[ \t]*\{(\d+)\}[ \t]*\{(\d+)\}")
_UNCERTAIN = re.compile(
    r"(?i)(?:\bor[ \t]+(?:more|less|fewer|greater|higher|lower|above|below|so)\b|"
    r"\bat[ \t]+(?:least|most)\b|\b(?:more|less|fewer|greater|higher|lower)[ \t]+than\b|"
    r"\bup[ \t]+to\b|(?<!\\)\b(?:approximately|approx|about|around|roughly|nearly|almost|"
    r"between|over|under)\b|\d[ \t(]*(?:\bor\b|\bto\b|–)[ \t(]*\$?\d|\d\+(?=[ \t]*(?:$|[.,;:!?)])|[ \t]+[A-Za-z]{2,})|"
    r"≈|^[\s$(]*(?:\\approx|~))")
_TWO_VALUES = re.compile(r"\d[ \t]*\$?[ \t]*,?[ \t]*\band\b[ \t]*\$?[ \t]*-?\d")
_SPACED_DIGITS = re.compile(r"(?<![\d.,])\d+(?:[ \t]+\d+)+(?![\d.,])")
_GROUPED = re.compile(r"[1-9]\d{0,2}(?:[ \t]\d{3})+")
_AFTER_WORD = re.compile(r"(?i)\b(?:times|plus|minus|over|divided[ \t]+by|to[ \t]+the[ \t]+power)\b")
MAX_WORD_EXPONENT = 100  # 2.5e6 is read; 1e100000 is a hostile number, not an answer


def _decimal_text(x: Fraction) -> str | None:
  """x as plain decimal digits, or None when it has no finite expansion."""
  if not _terminates(x):
    return None
  digits = 0
  while x.denominator != 1:
    x *= 10
    digits += 1
  text = str(abs(x.numerator)).rjust(digits + 1, "0")
  text = text if digits == 0 else f"{text[:-digits]}.{text[-digits:]}"
  return ("-" if x < 0 else "") + text


def read_number_words(text: str) -> str | None:
  """`text` with number words applied; None when one makes a value unreadable.

  `10 million` -> 10000000, `3 dozen` -> 36, `5 squared` -> 5^2, `6 times 7`
  -> 42, `2 1/2` -> 5/2, `2\\frac{1}{2}` -> \\frac{5}{2}, `2.5e6` -> 2500000.
  """
  def number(s):
    return Fraction(s.replace(",", ""))

  def multiply(m):
    return _decimal_text(number(m[1]) * _MULTIPLIERS[m[2].lower()])

  def operate(m):
    a, op, b = number(m[1]), m[2].lower().split()[0], number(m[3])
    if op in ("over", "divided") and b == 0:
      return m[0]
    value = (a * b if op == "times" else a + b if op == "plus" else
             a - b if op == "minus" else a / b)
    return _decimal_text(value) or f"{value.numerator}/{value.denominator}"

  def scientific(m):
    if abs(int(m[2])) > MAX_WORD_EXPONENT:
      raise OverflowError
    return _decimal_text(number(m[1]) * Fraction(10) ** int(m[2]))

  def mixed(m, tex=False):
    whole, num, den = int(m[1]), int(m[2]), int(m[3])
    if not 0 < num < den:
      return m[0]  # `3 4/2` is no mixed number: leave it to be unreadable
    top = whole * den + num
    return f"\\frac{{{top}}}{{{den}}}" if tex else f"{top}/{den}"

  try:
    text = _SCIENTIFIC.sub(scientific, text)
  except OverflowError:
    return None
  text = _MULTIPLIER.sub(multiply, text)
  text = _POWER_WORD.sub(lambda m: f"{m[1]}^{2 if m[2].lower() == 'squared' else 3}", text)
  text = _OPERATION.sub(operate, text)
  text = _MIXED_TEX.sub(lambda m: mixed(m, tex=True), text)
  return _MIXED.sub(mixed, text)


_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}


def spelled_number(text: str) -> int | None:
  """The value of a number written in words alone (`ten`, `twenty-five`,
  `one hundred and two`, `three thousand`), else None."""
  words = _TEXT.sub(r"\1", text)
  words = re.sub(r"[-,]", " ", words.strip(" \t$.!").lower()).split()
  words = [w for w in words if w != "and"]
  if not words or len(words) > 12:
    return None
  total = current = 0
  for w in words:
    if w in _UNITS:
      current += _UNITS[w]
    elif w in _TENS:
      current += _TENS[w]
    elif w == "hundred":
      current = max(current, 1) * 100
    elif w in _SCALES:
      total += max(current, 1) * _SCALES[w]
      current = 0
    else:
      return None
  return total + current


def unreadable(answer: str) -> bool:
  """Does this answer's text leave its value uncertain (`5 or more`, `about 5`,
  `4 or 5`, `4 2`, `2 times pi`)? Its words are read first (read_number_words)."""
  if not re.search(r"\d", answer):
    return False
  plain = _TEXT.sub(r" \1 ", answer)
  if _UNCERTAIN.search(plain) or _AFTER_WORD.search(plain):
    return True
  return any(not _GROUPED.fullmatch(m[0]) for m in _SPACED_DIGITS.finditer(plain))


# ------------------------------------------------------------ symbolic checks

class _Worker:
  """One Math-Verify child process (see _math_worker.py)."""

  def __init__(self):
    self.proc = subprocess.Popen(
        [sys.executable, "-I", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
    self.ready = False
    self.started = time.monotonic()
    self.job = None  # (request index, deadline) while it works on one

  def kill(self):
    self.proc.kill()
    self.proc.wait()


class _Symbolic:
  """Math-Verify in child processes: `processes` at work and one spare.

  A batch's requests are spread over the working processes (sympy holds the
  GIL, so parallel work needs processes). A request that overruns its
  budget gets False and its process is killed; the spare, which has been
  importing sympy meanwhile, takes its place and a new spare starts: a
  timeout costs its own budget, never a wait for a new worker, and one slow
  answer does not stall the rest of the batch.
  """

  def __init__(self, processes: int | None = None):
    self._processes = processes
    self._workers: list[_Worker] = []  # the working ones first, the spare last
    self._owner = None
    self._lock = threading.Lock()

  @property
  def processes(self) -> int:
    """Working processes: as set, else $GRPOJAX_MATH_PROCESSES, else up to 2 (one
    per core). The reward pool's workers set 1: they are the parallelism there."""
    if self._processes is not None:
      return self._processes
    return max(1, int(os.environ.get("GRPOJAX_MATH_PROCESSES", min(2, os.cpu_count() or 1))))

  @processes.setter
  def processes(self, n: int):
    self._processes = n

  def _ensure(self):
    if self._owner != os.getpid():
      self._workers = []  # a forked copy must not share its parent's pipes
      self._owner = os.getpid()
    self._workers = [w for w in self._workers if w.proc.poll() is None]
    while len(self._workers) < self.processes + 1:
      self._workers.append(_Worker())

  def close(self):
    if self._owner == os.getpid():
      for w in self._workers:
        w.kill()
    self._workers = []

  def ask_many(self, requests: list[dict], timeout_s: float) -> list[bool]:
    """The workers' verdicts on `requests` (see _math_worker.py); False when late."""
    results = [False] * len(requests)
    if not requests:
      return results
    with self._lock:
      self._ensure()
      pending = list(range(len(requests)))[::-1]
      while pending or any(w.job for w in self._workers):
        working = self._workers[:self.processes]
        for w in working:
          if w.ready and w.job is None and pending:
            i = pending.pop()
            try:
              w.proc.stdin.write(json.dumps(requests[i]) + "\n")
              w.proc.stdin.flush()
            except (OSError, ValueError):
              pass  # a dead worker: its job times out below
            w.job = (i, time.monotonic() + timeout_s)
        waiting = [w for w in working if w.job or not w.ready]
        deadlines = [w.job[1] for w in waiting if w.job]
        deadlines += [w.started + _STARTUP_S for w in waiting if not w.ready]
        left = max(0.0, min(deadlines) - time.monotonic())
        readable = select.select([w.proc.stdout for w in waiting], [], [], left)[0]
        for w in waiting:
          if w.proc.stdout in readable:
            line = w.proc.stdout.readline()
            if not line:  # it died (out of memory): its job, if any, stays False
              self._retire(w)
              continue
            line = line.strip()
            if not w.ready:
              w.ready = line == "ready"
              if not w.ready:
                self._retire(w)
                raise RuntimeError("the math-verify worker did not start; "
                                   "is math-verify installed?")
            elif w.job:
              results[w.job[0]] = line == "1"
              w.job = None
          elif w.job and time.monotonic() >= w.job[1]:
            self._retire(w)  # late: its next answer would be stale
          elif not w.ready and time.monotonic() >= w.started + _STARTUP_S:
            self._retire(w)
            raise RuntimeError("the math-verify worker did not start within "
                               f"{_STARTUP_S:.0f}s")
    return results

  def _retire(self, worker: _Worker):
    worker.kill()
    self._workers.remove(worker)
    self._ensure()  # the spare moves up; a new spare starts importing now

  def equivalent(self, pred: str, gold: str, timeout_s: float) -> bool:
    return self.ask_many([{"p": pred, "g": gold}], timeout_s)[0]


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
  prediction, gold = read_number_words(prediction), read_number_words(gold)
  if prediction is None or gold is None or unreadable(prediction):
    return False
  p, g = normalise(prediction), normalise(gold)
  if not p or not g or len(p) > MAX_ANSWER_CHARS or len(g) > MAX_ANSWER_CHARS:
    return False
  if p.replace(" ", "") == g.replace(" ", ""):
    return True
  # An equation (`0 = 42`, `x+1 = 42`) is not its right-hand side; a named
  # value's `x = 42`, `(p,q) = (3,2)` or `f(x) = 1` was already reduced to
  # its value by normalise, and `>=`, `<=`, `!=` are relations, compared as
  # such. Words left after normalising are prose, equal only when written as
  # in the gold.
  if (bool(_EQUALS.search(p)) != bool(_EQUALS.search(g)) or _PROSE.search(p)
      or _PROSE.search(g)):
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
  pred = read_number_words(pred)
  if pred is None or unreadable(pred):
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


VERIFY_WINDOW = 1500  # characters of a completion's end that Math-Verify's extraction reads
MAX_VERIFY_CHARS = 5000  # ... or back to its first box or "final answer", this far at most
_UNCLOSED = 16  # more unclosed \[ or \( than this: a hostile text, read by its end only
_ANCHOR = re.compile(r"\\boxed|\\fbox|(?i:final answer)")
_MATH_DELIMITERS = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_NUMBERISH = re.compile(r"[-+]?[\d.,\s]*\d[\d.,\s]*%?")
_FINAL_PHRASE = re.compile(r"(?i)final answer|answer\s*(?:is|:)")
_warned: set = set()


def _window(text: str) -> str:
  """What Math-Verify's extraction reads of a completion: from its first box
  or "final answer" (at most MAX_VERIFY_CHARS back), else its last
  VERIFY_WINDOW characters, starting on a line.

  Its regexes are quadratic on some inputs (runs of unclosed `\\[` or `\\(`),
  so a window holding many of those shrinks to the last VERIFY_WINDOW
  characters. Starting on a line keeps an inline `$...$` from being cut in
  half and its dollars mispaired.
  """
  if len(text) <= VERIFY_WINDOW:
    return text
  cut = len(text) - VERIFY_WINDOW
  anchor = _ANCHOR.search(text, max(0, len(text) - MAX_VERIFY_CHARS))
  if anchor is not None and anchor.start() < cut:
    cut = max(0, anchor.start() - 200)
    w = text[cut:]
    if (w.count("\\[") - w.count("\\]") > _UNCLOSED or
        w.count("\\(") - w.count("\\)") > _UNCLOSED):
      cut = len(text) - VERIFY_WINDOW
  newline = text.find("\n", cut)
  return text[newline + 1:] if 0 <= newline < cut + 300 else text[cut:]


def _gold_text(reference) -> str | None:
  """The gold as Math-Verify should read it: a reference with math delimiters
  as it is (its extraction finds the boxed or final answer), a GSM8K `#### n`
  or bare answer as that answer, LaTeX wrapped in `$...$`."""
  if reference is None:
    return None
  ref = str(reference).strip()
  if not ref:
    return None
  if _MATH_DELIMITERS.search(ref) and "####" not in ref:
    return _window(ref)
  gold = gold_answer(ref)
  if gold is None or len(gold) > 4 * MAX_ANSWER_CHARS:
    return None
  return gold if _NUMBERISH.fullmatch(gold) else f"${gold}$"


def _marked_answer(window: str) -> str:
  """Without a box, an answer marked as GSM8K's `#### 42` or by R1's
  `<answer>...</answer>` is what is graded (Math-Verify knows neither mark:
  `####42` and `<answer>42</answer>` hold no number it would take)."""
  if _BOXED.search(window):
    return window
  if m := _GSM8K.findall(window):
    return m[-1].strip()
  close = window.rfind("</answer>")
  if close >= 0 and (open_ := window.rfind("<answer>", 0, close)) >= 0:
    return window[open_ + len("<answer>"):close].strip()
  return window


def _boxes(text: str) -> list[tuple[str | None, int]]:
  """(content, end) of each `\\boxed{...}` / `\\fbox{...}` in `text`; content
  None for one without a closed brace group (unclosed, or `\\boxed 5`)."""
  close, out = None, []
  for m in _BOXED.finditer(text):
    start = m.end()
    if start < len(text) and text[start] == "{":
      close = _closing_braces(text) if close is None else close
      if start in close:
        out.append((text[start + 1:close[start]], close[start]))
        continue
    out.append((None, start))
  return out


def _tidy(text: str) -> str:
  """What Math-Verify misreads: a sentence's full stop after a number (`10/3.`
  becomes the float 10/3.0, and no longer equals 10/3), an escaped dollar
  sign (`\\$5.00` holds no number it takes)."""
  text = text.replace("\\$", " ")
  return re.sub(r"(?<=\d)\.(?=\s|$|[)\]}$])", "", text)


def _answer_region(window: str) -> str:
  """(anchored, text) of where the final answer sits: the boxes' contents
  (one a line), else the text after the last answer phrase, else (not
  anchored) the last sentence with a digit."""
  boxes = [content for content, _ in _boxes(window) if content is not None]
  if boxes:
    return True, "\n".join(boxes)
  phrases = list(_FINAL_PHRASE.finditer(window))
  if phrases:
    rest = window[phrases[-1].end():]
    return True, re.split(r"\.\s|\n", rest, maxsplit=1)[0][:200]
  sentences = [x for x in re.split(r"(?<=[.!?])\s+|\n", window) if re.search(r"\d", x)]
  return False, sentences[-1] if sentences else ""


_NAME = re.compile(r"\$?\s*(?:\\?[A-Za-z]+(?:_\{?\w+\}?)?|\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])*\s*\)|"
                   r"[A-Za-z]\s*\(\s*[A-Za-z]\s*\))\s*")


def _equation_not_value(region: str, gold: str) -> bool:
  """Is a boxed or stated answer an equation (`0 = 42`, `x+1 = 42`) where
  the gold is a value? Its right-hand side is not its answer; a name's
  (`x = 42`, `(p,q) = (3,2)`, `f(x) = 1`) is."""
  if _EQUALS.search(gold):
    return False
  return any(len(sides := _EQUALS.split(answer)) > 1 and not _NAME.fullmatch(sides[0])
             for answer in region.split("\n"))


def _plain_numbers(window: str, gold: str, float_rounding: int) -> bool | None:
  """The verdict when both answers are plain numbers in unambiguous places
  (every box of the completion holds the same number, nothing after the last
  box claims to be the final answer); None to ask Math-Verify. Its rule: equal
  exactly, or after rounding both to `float_rounding` decimals when either is
  written with decimals."""
  g_text = gold.strip("$ ")
  g = as_number(g_text)
  if g is None:
    return None
  if not _BOXED.search(window) and (p := as_number(normalise(window))) is not None:
    return _plain_equal(p, g, is_decimal(normalise(window)) or is_decimal(g_text),
                        float_rounding)  # a bare number: `#### 72`, <answer>72</answer>
  boxes = _boxes(window)
  if not boxes or any(content is None for content, _ in boxes):
    return None
  values = {(as_number(t), is_decimal(t)) for t in (normalise(c) for c, _ in boxes)}
  if len(values) != 1 or _FINAL_PHRASE.search(window, boxes[-1][1]):
    return None
  (p, p_decimal), = values
  if p is None:
    return None
  return _plain_equal(p, g, p_decimal or is_decimal(g_text), float_rounding)


def _plain_equal(p: Fraction, g: Fraction, decimal: bool, float_rounding: int) -> bool:
  """Math-Verify's rule for numbers: equal, or equal rounded to `float_rounding`
  decimals when either is written with decimals (so possibly rounded)."""
  return p == g or (decimal and round(p, float_rounding) == round(g, float_rounding))


def _verdict_or_request(completion: str, reference, float_rounding: int, strict: bool,
                        allow_set_relation_comp: bool) -> bool | None | dict:
  """`grade`'s verdict when it needs no Math-Verify, else the worker's request."""
  gold = _gold_text(reference)
  if gold is None:
    return None
  if not isinstance(completion, str):
    return False
  window = _marked_answer(_window(completion[-MAX_SCAN_CHARS:]))
  if too_large(window) or too_large(gold):
    warn_hostile("an answer that would build an astronomically large number scores 0")
    return False
  window, gold = read_number_words(window), read_number_words(gold)
  if window is None or gold is None:
    warn_hostile("a number with an exponent past 1e100 in words scores 0")
    return False
  anchored, region = _answer_region(window)
  if unreadable(region) or (anchored and (_equation_not_value(region, gold)
                                          or re.match(r"[\s$(]*not\b", region))):
    return False  # `The answer is not 5.` is no answer
  if as_number(gold.strip("$ ")) is not None and _TWO_VALUES.search(region):
    return False  # `5 and 6` is two answers, not the one the gold is
  if anchored and (spelled := spelled_number(region)) is not None:
    window = str(spelled)  # `The answer is ten.`: Math-Verify reads no words
  fast = _plain_numbers(window, gold, float_rounding)
  if fast is not None:
    return fast
  window, gold = _tidy(window), _tidy(gold)
  return {"c": window, "g": gold, "r": float_rounding, "s": strict,
          "a": allow_set_relation_comp}


def grade_many(completions: Sequence[str], references: Sequence, *, float_rounding: int = 6,
               strict: bool = True, allow_set_relation_comp: bool = False,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> list[bool | None]:
  """`grade` over a batch `[N]`, Math-Verify's share spread over its processes."""
  out = [_verdict_or_request(c, r, float_rounding, strict, allow_set_relation_comp)
         for c, r in zip(completions, references)]
  asks = [i for i, v in enumerate(out) if isinstance(v, dict)]
  for i, verdict in zip(asks, _SYMBOLIC.ask_many([out[i] for i in asks], timeout_s)):
    out[i] = verdict
  return out


def grade(completion: str, reference, *, float_rounding: int = 6, strict: bool = True,
          allow_set_relation_comp: bool = False,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> bool | None:
  """Is the completion's final answer the reference's? None: no reference.

  Math-Verify's own extraction and `verify` decide (TRL's accuracy reward
  and verl grade with them), in a child process bounded by `timeout_s`:
  every `\\boxed{}` (several boxes are one answer, a set: `\\boxed{2}` and
  `\\boxed{3}` is {2, 3}), else "final answer is" phrases, unboxed `$...$`,
  `\\(...\\)` and `\\[...\\]` spans, answer phrases, and the last number
  only as the last resort; relations as relations, sets, intervals, tuples
  and matrices as such. Around it, what a careful grader adds: number words
  are read (`10 million`, `5 squared`, `2 1/2`, `2.5e6`), an answer whose
  words leave it uncertain (`5 or more`, `4 2`) scores False, a boxed
  equation is not its right-hand side (`0 = 42`), astronomically large
  numbers are refused before anything evaluates them, and plain numbers in
  boxes are compared here, exactly, without the child process.
  float_rounding, strict, allow_set_relation_comp: Math-Verify's `verify`.
  """
  return grade_many([completion], [reference], float_rounding=float_rounding, strict=strict,
                    allow_set_relation_comp=allow_set_relation_comp, timeout_s=timeout_s)[0]


def warn_hostile(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    logging.getLogger("grpojax.rewards").warning("math reward: %s (shown once)", message)


@dataclasses.dataclass(frozen=True)
class MathAccuracy:
  """TRL-style reward: 1.0 when the completion's final answer equals the gold.

  Gold comes from the first present column of `gold_columns` (row None:
  reward None). A completion without an answer scores 0.0. See `grade` for
  how answers are read and compared; `float_rounding`, `strict` and
  `allow_set_relation_comp` are Math-Verify's `verify` options, and
  `timeout_s` bounds one answer's verdict, all its work counted.
  """

  gold_columns: tuple[str, ...] = ("answer", "solution")
  timeout_s: float = DEFAULT_TIMEOUT_S
  name: str = "math_accuracy"
  float_rounding: int = 6
  strict: bool = True
  allow_set_relation_comp: bool = False

  @property
  def __name__(self) -> str:
    return self.name

  def __call__(self, prompts=None, completions=(), **columns) -> list[float | None]:
    col = next((columns[c] for c in self.gold_columns if c in columns), None)
    if col is None:
      raise KeyError(f"{self.name} needs one of the dataset columns {self.gold_columns}")
    verdicts = grade_many([completion_text(c) for c in completions], list(col),
                          float_rounding=self.float_rounding, strict=self.strict,
                          allow_set_relation_comp=self.allow_set_relation_comp,
                          timeout_s=self.timeout_s)
    return [None if v is None else float(v) for v in verdicts]


math_accuracy_reward = MathAccuracy()
