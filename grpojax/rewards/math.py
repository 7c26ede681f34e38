"""Math answers: the reward's verdict, extraction, and equivalence of answers.

`MathAccuracy` (through `grade_many`) grades a completion's final answer
against the gold. The last answer wins: the final answer is the last one the
completion commits to, in a box (`\\boxed{}`, `\\fbox{}`; adjacent boxes with
Math-Verify's separators are one answer, a set), an answer phrase (`the
answer is X`, `Answer: X`, `final answer ... is X`), a correction (`Wait,
actually it's X`), GSM8K's `#### X` or R1's `<answer>X</answer>`; where a
statement's value ends, an explanation (`because 9 * 2 = 18`, `(since
2+3=5)`) is left out. Math-Verify and TRL's accuracy reward instead take any
box over any phrase, so `\\boxed{5}. Wait, 3+3=6, so the answer is 6.`
grades 5 there and 6 here, as a reader of the text would. The answer is found
by linear scans of the whole completion, then only it (or, without any
statement, the completion's last VERIFY_WINDOW characters) is parsed: no
window decides which answer is seen.

Math-Verify's own extraction and `verify` (relations, sets, intervals,
tuples, matrices, symbolic equality) then read that answer, in child
processes with a CPU-time budget per answer (a loaded machine slows a
verdict, never changes it; a verdict out of budget is TIMED_OUT, not 0).
Around it, what a careful human grader adds and Math-Verify lacks: number
words are read (`10 million`, `5 squared`, `2 1/2`, `2.5e6`, `five`), an
answer left uncertain by its words (`5 or more`, `4 2`) scores 0, a boxed
equation is not its right-hand side, units that differ (`5 km`, `5 m`) are
different answers, a relation is the set it describes (`x > 4` is
`(4, \\infty)`), numbers too large to build are refused before anything
evaluates them, and plain numbers are compared here, exactly, without a
child process.

`extract_answer` and `is_equivalent` are the same pieces for one answer
already extracted: plain numbers exactly (fractions, decimals, thousands
separators, percent, currency, units, `x = 5`; a tolerance only where the
gold is itself inexact), everything else through Math-Verify. `answer_key`
builds on them for majority voting.
"""

from __future__ import annotations

import atexit
import bisect
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

from grpojax.rewards.base import TIMED_OUT, completion_text

# CPU seconds for one answer's verdict, all its work counted. Not wall time, which
# a busy host spends elsewhere. 2 s: a fresh worker's first long expression takes
# 0.7 s here (ANTLR builds its prediction tables), so 0.8 left no margin.
DEFAULT_TIMEOUT_S = 2.0
WALL_FACTOR = 30  # a worker silent for this many budgets of wall time (and 10 s) is stuck
MAX_ANSWER_CHARS = 1000
MAX_SCAN_CHARS = 1_000_000  # far past any generation length: the answer is found in all of it
MAX_DIGITS = 100_000  # a number with more digits is refused, never built
_STARTUP_S = 120.0  # a math-verify worker's import of sympy, on a loaded machine
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")


class GradingTimeout(TimeoutError):
  """A verdict ran out of its CPU budget: no verdict, not a wrong answer."""


# ----------------------------------------------------------- the final answer

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_BRACE_TOKENS = re.compile(r"\\[{}\\]|[{}]")  # `\{`, `\}` and `\\` are no grouping
_GSM8K = re.compile(r"####\s*([^\n]+)")
_BARE = re.compile(r"[^\s$]+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
# `The answer is`, `Answer:`, `answer =`, `The final answer to the question is`.
_STATED = re.compile(r"(?i)(?=[fa])\b(?:final\s+answer\b[^\n.]{0,60}?\s(?:is|are)|answers?\s*(?:is|are|:|="
                     r"|would\s+be|should\s+be|will\s+be))(?![A-Za-z])[\s:*]*")
# A self-correction that commits to a new value: `Hmm, actually I think it's 15`,
# `Wait, it should be 6`. A cue, a few words, then a claim about "it" or "that".
_CUE = r"(?:actually|wait|oops|hmm+|correction|on\s+second\s+thought|i\s+mean|sorry|no(?=\s*,))"
_CORRECTION = re.compile(
    r"(?i)(?=[acwohsin])\b" + _CUE + r"\b[\s,:;!.\-]*(?:[a-z]+[ \t,]+){0,4}?"
    r"(?:it[’']?s|it\s+(?:is|was|should\s+be|must\s+be|would\s+be)|that[’']?s"
    r"|that\s+(?:is|gives|makes)|(?:should|must)\s+be)(?![A-Za-z])[\s:*]*")
# Substrings without which a text holds no match of _STATED or of _CORRECTION: a
# scan for them is much cheaper than the patterns' (at every word of a long text).
_HINTS = {"stated": ("answer",), "correction": ("actually", "wait", "oops", "hmm", "correction",
                                                 "thought", "mean", "sorry", "no,", "no ,")}
_CUE_OR_PHRASE = re.compile(r"(?i)\b" + _CUE + r"\b|\banswer")
# Where a stated value ends and its explanation begins: `18 because 9 * 2 = 18`.
_EXPLANATION = re.compile(
    r"(?i)(?:\(\s*)?(?:because|since|as|given|due\s+to|which|where|from|using|so|thus|hence|"
    r"therefore|i\.e\.|e\.g\.|(?:this|that)\s+is)\b|[;—]|--")
_SEPARATOR = re.compile(r"\b(?:and|or)\b|,|;")  # Math-Verify's, between boxes of one answer
_PHRASES_TRIED = 16  # answer phrases tried from the last one back for one with a value
MAX_BOX_CHARS = 4 * MAX_ANSWER_CHARS  # a box holding more is no answer
MAX_BOX_NESTING = 8  # ... nor one inside more boxes than this: junk, not a way to write one


def _closing_braces(text: str) -> dict[int, int]:
  """Position of each "{" -> its matching "}", in one pass over `text`.

  One scan for all groups keeps extraction linear: matching each \\boxed{
  on its own rescans the rest of the text for every unclosed box.
  """
  close, stack = {}, []
  for m in _BRACE_TOKENS.finditer(text):  # \{ and \} are literal braces (sets), not grouping
    i = m.start()
    if m.end() - i == 1:
      if text[i] == "{":
        stack.append(i)
      elif stack:
        close[stack.pop()] = i
  return close  # an unbalanced "{" (a completion cut off at max length) has no entry


@dataclasses.dataclass(frozen=True)
class _Box:
  start: int
  end: int  # just past its closing brace (or its bare token)
  content: str | None  # None: longer than MAX_BOX_CHARS or nested deeper than MAX_BOX_NESTING
  nested: bool  # a box that held only a box (`\boxed{\boxed{5}}`), read as the inner one


def _top_boxes(text: str) -> list[_Box]:
  """The boxes not inside another box, in order: `\\boxed{...}`, `\\fbox{...}`,
  `\\boxed 5`; unclosed and empty ones are skipped. A box holding only a box
  is the inner one, unwrapped in place (700 nested `\\fbox{` are read in one
  pass, not as 700 overlapping ones, and hold no answer)."""
  close, out, inside, n = None, [], 0, len(text)
  for m in _BOXED.finditer(text):
    if m.start() < inside:
      continue
    end = m.end()
    if end < n and text[end] == "{":
      close = _closing_braces(text) if close is None else close
      if end not in close:
        continue  # cut off: no answer (later boxes may still be one)
      lo, hi, depth = end + 1, close[end], 0
      inside = hi + 1
      while depth <= MAX_BOX_NESTING:  # lo only grows and hi only shrinks: linear in the box
        while lo < hi and text[lo].isspace():
          lo += 1
        while hi > lo and text[hi - 1].isspace():
          hi -= 1
        inner = _BOXED.match(text, lo, hi)
        if inner and inner.end() < hi and text[inner.end()] == "{" and \
            close.get(inner.end()) == hi - 1:
          lo, hi, depth = inner.end() + 1, hi - 1, depth + 1
        else:
          break
      if hi > lo:
        readable = hi - lo <= MAX_BOX_CHARS and depth <= MAX_BOX_NESTING
        out.append(_Box(m.start(), inside, text[lo:hi] if readable else None, depth > 0))
    elif m.group(0).endswith((" ", "\t")) and (bare := _BARE.match(text, end)):
      out.append(_Box(m.start(), bare.end(), bare.group(0), False))
  return out


def _last_box_group(text: str, boxes: list[_Box]) -> list[_Box]:
  """The last answer the boxes give: the last box, with the boxes before it
  that Math-Verify reads as one answer with it (a gap under 10 characters, or
  under 70 with `and`, `or`, `,` or `;` and a different content), unless a
  correction or an answer phrase stands between them."""
  group = boxes[-1:]
  for box in reversed(boxes[:-1]):
    gap = text[box.end:group[0].start]
    if _CUE_OR_PHRASE.search(gap):
      break
    if len(gap) < 10 or (len(gap) < 70 and box.content != group[0].content
                         and _SEPARATOR.search(gap)):
      group.insert(0, box)
    else:
      break
  return group


def _stated_value(text: str, i: int, close: dict[int, int] | None) -> str | None:
  """The value stated from `text[i]` on (after an answer phrase): to the end of
  its sentence or the start of its explanation (`because ...`, `(since ...)`),
  math spans (`$...$`, `\\(...\\)`, `\\[...\\]`, `{...}`) read whole, delimiters
  kept; None when it holds no value (`The answer is as follows:`). Reads at
  most MAX_ANSWER_CHARS characters."""
  n = len(text)
  limit = min(n, i + MAX_ANSWER_CHARS)
  while i < limit and text[i] in " \t\n*:":
    i += 1
  if _EXPLANATION.match(text, i):
    return None  # `The answer is as follows: ...` states no value
  start = j = i
  while j < limit:
    c = text[j]
    if c == "\\" and text.startswith(("\\(", "\\["), j):
      k = text.find("\\)" if text[j + 1] == "(" else "\\]", j + 2, limit)
      j = k + 2 if k >= 0 else j + 2
    elif c == "\\":
      j += 2
    elif c == "$":  # a math span, or a currency sign (`$18.`) when nothing closes it
      double = text.startswith("$$", j)
      k = text.find("$$" if double else "$", j + (2 if double else 1), limit)
      j = k + (2 if double else 1) if k >= 0 else j + 1
    elif c == "{" and close is not None and close.get(j, limit) < limit:
      j = close[j] + 1
    elif c in "\n!?" or (c == "." and (j + 1 >= n or text[j + 1].isspace())) or \
        text.startswith("</", j):  # a sentence's end, or `</answer>`
      break
    elif (j > start and text[j - 1] in " \t(,") or c in ";—-":
      if _EXPLANATION.match(text, j) and text[start:j].strip(" \t,("):
        break
      j += 1
    else:
      j += 1
  value = text[start:min(j, limit)].rstrip(" \t,;:(—-*")
  clean = _clean_tail(value)
  if not clean or not (re.search(r"[\d$\\]", clean) or _spelled_value(clean) != clean):
    return None
  return value.rstrip(".").rstrip()


@dataclasses.dataclass(frozen=True)
class _Final:
  """The last answer a text commits to."""

  kind: str  # "box", "stated" (an answer phrase or a correction), "mark" (#### or <answer>)
  start: int
  answers: tuple[str | None, ...]  # one per box; or the stated or marked value (None: too long)
  source: str  # what Math-Verify's extraction reads for it


def _final_answer(text: str, phrases: bool = True) -> _Final | None:
  """The last answer `text` commits to (see the module's docstring), or None.

  Each kind of statement is found by one linear scan; the one that starts
  last wins. `phrases=False` reads boxes and marks only.
  """
  candidates = []
  boxes = _top_boxes(text) if "\\boxed" in text or "\\fbox" in text else []
  if boxes:
    group = _last_box_group(text, boxes)
    if any(b.nested for b in group) or any(b.content is None for b in group):
      source = ", ".join(f"\\boxed{{{b.content}}}" for b in group)
    else:
      source = text[group[0].start:group[-1].end]
      if pct := re.match(r"\s*\$?\s*\\?%", text[group[-1].end:group[-1].end + 8]):
        source += pct.group(0)  # `\boxed{50}\%` is 0.5, as Math-Verify reads it
    candidates.append(_Final("box", group[0].start, tuple(b.content for b in group), source))
  if phrases and (stated := _last_stated(text, boxes)) is not None:
    candidates.append(stated)
  if (marks := _last_matches(_GSM8K, text)) and (value := _clean_tail(marks[-1].group(1))):
    candidates.append(_Final("mark", marks[-1].start(), (value,), value))
  # The last <answer>...</answer> by search from the end: a regex scan from
  # every unclosed "<answer>" would be quadratic.
  close_tag = text.rfind("</answer>")
  if close_tag >= 0 and (open_ := text.rfind("<answer>", 0, close_tag)) >= 0:
    if value := text[open_ + len("<answer>"):close_tag].strip():
      candidates.append(_Final("mark", open_, (value,), value))
  return max(candidates, key=lambda c: c.start, default=None)


def _last_stated(text: str, boxes: list[_Box]) -> _Final | None:
  """The last answer phrase or correction with a value, outside `boxes`."""
  starts, lower = [b.start for b in boxes], text.lower()
  found = [m for pattern, hints in ((_STATED, _HINTS["stated"]), (_CORRECTION, _HINTS["correction"]))
           if any(h in lower for h in hints) for m in _last_matches(pattern, text)]
  close = _closing_braces(text) if found and "{" in text else None
  for m in sorted(found, key=lambda m: m.start(), reverse=True):
    k = bisect.bisect_right(starts, m.start()) - 1
    if k >= 0 and m.start() < boxes[k].end:
      continue  # `\boxed{\text{the answer is 5}}`: inside a box, which is the answer
    if (value := _stated_value(text, m.end(), close)) is not None:
      # Bare LaTeX (`x \\geq 5`) in `$...$`: Math-Verify reads LaTeX only there.
      source = f"${value}$" if "\\" in value and not _MATH_DELIMITERS.search(value) else value
      return _Final("stated", m.start(), (_clean_tail(value),), f"The answer is {source}")
  return None


def _last_matches(pattern: re.Pattern, text: str) -> list[re.Match]:
  """The last _PHRASES_TRIED matches of `pattern`, in one scan (its regex is
  linear; keeping every match of a hostile text would not be)."""
  last = []
  for m in pattern.finditer(text):
    last.append(m)
    if len(last) > 2 * _PHRASES_TRIED:
      del last[:_PHRASES_TRIED]
  return last[-_PHRASES_TRIED:]


def _clean_tail(s: str) -> str:
  return s.strip().rstrip(".").strip().strip("$").strip()


def last_boxed(text: str) -> str | None:
  """Content of the last box group (see `_final_answer`): one box's content, or
  several boxes' joined by ", "."""
  boxes = _top_boxes(text) if isinstance(text, str) else []
  if not boxes:
    return None
  contents = [b.content for b in _last_box_group(text, boxes)]
  return None if None in contents else ", ".join(c.strip() for c in contents)


def last_number(text: str) -> str | None:
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else None


def answer_phrase(text: str) -> str | None:
  """The value of the last answer phrase or correction (`The answer is X`,
  `Answer: X`, `Wait, it's X`), else None."""
  boxes = _top_boxes(text) if "\\boxed" in text or "\\fbox" in text else []
  stated = _last_stated(text, boxes)
  return stated.answers[0] if stated else None


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

  The last answer `text` commits to (see `_final_answer`): a box group (its
  boxes' contents joined by ", "), GSM8K's `#### X`, an <answer>...</answer>,
  and, with fallback "auto" or "answer_phrase", an answer phrase or a
  correction (`The answer is X`, `Wait, it's X`). Without any: `fallback`, a
  name in FALLBACKS ("auto": the last number) or a callable.
  """
  if not isinstance(text, str):
    return None
  fn = FALLBACKS.get(fallback) if isinstance(fallback, str) else fallback
  if fn is None:
    raise ValueError(f"fallback={fallback!r} is unknown; known: {sorted(FALLBACKS)}")
  text = text[-MAX_SCAN_CHARS:]
  found = _final_answer(text, phrases=fallback in ("auto", "answer_phrase"))
  if found is None:
    return last_number(text) if fallback == "auto" else fn(text)
  if None in found.answers:
    return None  # a box too long to be an answer
  return ", ".join(a.strip() for a in found.answers) or None


# -------------------------------------------------------------- normalisation

_UNICODE = {"−": "-", "–": "-", "π": "\\pi ", "∞": "\\infty ", "×": "\\times ",
            "÷": "\\div ", "√": "\\sqrt ", "·": "\\cdot ", "°": "", "，": ","}
_SPACING = re.compile(r"\\left|\\right|\\[!,;: ]|~|\\displaystyle")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm|operatorname)\s*\{([^{}]*)\}")
# A unit after the value: 18\text{ cm}, 5\mathrm{m}^2 (letters only, at the very end).
_TRAILING_UNIT = re.compile(
    r"(?<=\S)\s*\\(?:text|textbf|mbox|mathrm)\s*\{\s*([A-Za-z][A-Za-z .]*)\}(\^\{?[23]\}?)?$")
_PROSE = re.compile(r"\\(?:text|textbf|mbox|mathrm|operatorname)\s*\{")
_UNIT_WORDS = re.compile(r"^(-?[\d.,/]+)\s+([A-Za-z]{2,}(?:\s+[A-Za-z]{2,})?)$")
# `x =`, `x_1 =`, `(p, q) =`, `f(x) =` before a single value: the name, not the answer.
_ASSIGN = re.compile(r"^(?:[A-Za-z](?:_\{?\w+\}?)?|\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])*\s*\)|"
                     r"[A-Za-z]\s*\(\s*[A-Za-z]\s*\))\s*=\s*(?=[^=<>]+$)")
_EQUALS = re.compile(r"(?<![<>!\\])=(?!=)")


def normalise(ans: str) -> str:
  """Strip what never changes an answer's value: delimiters, spacing
  macros, units and currency, degree signs, `x =`, a final period."""
  return _normalise(ans)[0]


def _normalise(ans: str) -> tuple[str, str | None]:
  """`normalise`'s answer, and the unit it stripped (`cm` of `18\\text{ cm}`
  or of `18 cm`), else None."""
  s, unit = ans.strip(), None
  for a, b in _UNICODE.items():
    s = s.replace(a, b)
  s = s.strip().strip("$")
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
    s = s.strip()
    if m := _TRAILING_UNIT.search(s):
      s, unit = s[:m.start()], m.group(1) + (m.group(2) or "")
    # Words anywhere else are prose around the answer (`4\text{ or }2`,
    # `\operatorname{foo}(42)`): they stay, so that such an answer matches
    # only a gold written the same way. Wrapped digits (\mathrm{42}) unwrap.
    s = _TEXT.sub(lambda m: m.group(0) if re.search(r"[A-Za-z]", m.group(1))
                  else m.group(1), s)
  s = re.sub(r"\\?\$|\\?%|\\euro|€|£|¥", "", s)
  s = s.strip().rstrip(".").strip()
  s = _ASSIGN.sub("", s)
  if m := _UNIT_WORDS.match(s):
    s, unit = m.group(1), unit or m.group(2)
  return s.strip(), unit


# Long names of units -> the symbol, so that `5 meters` is `5\\text{ m}`.
_UNIT_NAMES = {
    "meter": "m", "metre": "m", "centimeter": "cm", "centimetre": "cm", "millimeter": "mm",
    "millimetre": "mm", "kilometer": "km", "kilometre": "km", "inch": "in", "foot": "ft",
    "feet": "ft", "yard": "yd", "mile": "mi", "gram": "g", "kilogram": "kg", "milligram": "mg",
    "pound": "lb", "lbs": "lb", "ounce": "oz", "second": "s", "sec": "s", "minute": "min",
    "hour": "h", "hr": "h", "liter": "l", "litre": "l", "milliliter": "ml", "millilitre": "ml",
    "degree": "deg", "unit": "unit"}


def _canonical_unit(unit: str | None) -> str | None:
  """One spelling per unit (`centimeters`, `cm` -> `cm`; `square feet`,
  `ft^2` -> `ft^2`); None for none, or for bare `units` (any unit)."""
  if unit is None:
    return None
  u, power = unit.lower().replace(".", " "), ""
  if m := re.search(r"\^\{?([23])\}?$", u):
    u, power = u[:m.start()], "^" + m.group(1)
  words = u.split()
  if words and words[0] in ("square", "sq", "cubic", "cu"):
    power, words = ("^2" if words[0] in ("square", "sq") else "^3"), words[1:]
  names = []
  for w in words:
    name = (_UNIT_NAMES.get(w) or (w.endswith("s") and _UNIT_NAMES.get(w[:-1]))
            or (w.endswith("es") and _UNIT_NAMES.get(w[:-2])))
    names.append(name or (w[:-1] if len(w) > 3 and w.endswith("s") else w))
  return None if names in ([], ["unit"]) else " ".join(names) + power


def _units_differ(a: str, b: str) -> bool:
  """Do two answers name different units (`5\\text{ km}`, `5\\text{ m}`)? A
  unit on one side only is no difference: `5` is `5 cm`."""
  ua, ub = _canonical_unit(_normalise(a)[1]), _canonical_unit(_normalise(b)[1])
  return ua is not None and ub is not None and ua != ub


# Math-Verify's number formats: thousands in groups of three after a 1-3
# digit lead, split by "," or a space (decimals may follow); otherwise a
# decimal point or a decimal comma (`0,111`, `1,22`, `1000,99`: these cannot
# be thousands). So `1,234` is 1234 and `4 2` is no number at all.
_PLAIN = re.compile(r"([-+]?)([1-9]\d{0,2}([ ,])\d{3}(?:\3\d{3})*(?:\.\d+)?|\d+(?:[.,]\d+)?|\.\d+)"
                    r"(?:/(\d+))?")
# Spaces around a fraction's slash; starting only where a run of spaces starts, since
# trying from every space of a long run makes a scan quadratic.
_SLASH = re.compile(r"(?<!\s)\s*/\s*")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?)\\frac(\d)(\d)")


def as_number(s: str) -> Fraction | None:
  """Exact value of a plain number (int, 1,234, 1 000, -0.5, 0,111, 3/4, \\frac{3}{4}), else None."""
  t = _SLASH.sub("/", s.strip())
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
  m = _PLAIN.fullmatch(_SLASH.sub("/", s.strip()))
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


_FACTORIAL = re.compile(r"(?<!\d)\d{5,}+\s*+!")
MAX_EXPONENT = 100_000  # 2^100000 already has 30,103 digits


_NON_NUMERIC = re.compile(r"[^\d\s^{}()]")
_DIGIT_RUN = re.compile(r"\d+")


def _numeric_exponents(s: str):
  """The text of each numeric exponent (digits, `^`, brackets: `^{10^8}`,
  `^(99)`, `^123`) not inside another numeric one, whose bound covers it.

  Linear: brackets are matched in one pass and a group is numeric when no
  other character falls inside it (a bisection), so `^{` nested a thousand
  deep is not read a thousand times.
  """
  close, stacks = {}, {"{": [], "(": []}
  for m in re.finditer(r"[{}()]", s):
    c = m.group()
    if c in stacks:
      stacks[c].append(m.start())
    elif stacks[opener := "{" if c == "}" else "("]:
      close[stacks[opener].pop()] = m.start()
  other = [m.start() for m in _NON_NUMERIC.finditer(s)]
  covered = 0
  for m in re.finditer(r"\^\s*", s):
    i = m.end()
    if i < covered:
      continue
    if i < len(s) and s[i] in "{(":
      j = close.get(i)
      if j is not None and bisect.bisect_left(other, i) == bisect.bisect_left(other, j):
        covered = j
        yield s[i + 1:j]
    elif tok := _DIGIT_RUN.match(s, i):
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
  if any(_log10_bound(exp) > math.log10(MAX_EXPONENT) for exp in _numeric_exponents(t)):
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
_MULTIPLIER = re.compile(_NUM + r"[ \t]*+(?:\\,|~)?[ \t]*+(?:\\text\{\s*+)?("
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
_TWO_VALUES = re.compile(r"\d[ \t]*+\$?[ \t]*+,?[ \t]*+\band\b[ \t]*+\$?[ \t]*+-?\d")
_SPACED_DIGITS = re.compile(r"(?<![\d.,])\d+(?:[ \t]+\d+)+(?![\d.,])")
_GROUPED = re.compile(r"[1-9]\d{0,2}(?:[ \t]\d{3})+")
# Not `\\times`, `\\over`: LaTeX's operators are no words.
_AFTER_WORD = re.compile(
    r"(?i)(?<!\\)\b(?:times|plus|minus|over|divided[ \t]+by|to[ \t]+the[ \t]+power)\b")
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


def _spelled_value(text: str) -> str:
  """`text` with a number spelled out in words read, units after it kept
  (`five apples` -> `5 apples`, `twenty-five` -> `25`); else `text` itself."""
  words = text.split()
  if not words or len(words) > 14 or not re.search(r"[A-Za-z]", text):
    return text
  for k in range(min(2, len(words) - 1) + 1):
    value = spelled_number(" ".join(words[:len(words) - k]))
    if value is not None:
      return " ".join([str(value), *words[len(words) - k:]])
  return text


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

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MIN_WALL_S = 10.0


def _cpu_seconds(pid: int) -> float | None:
  """CPU time (user and system) process `pid` has used, from /proc; None where
  it cannot be read."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
  except OSError:
    return None
  fields = stat[stat.rfind(b")") + 2:].split()  # after "(name)", which may hold spaces
  return (int(fields[11]) + int(fields[12])) / _TICKS


def wall_bound(timeout_s: float) -> float:
  """Wall-clock seconds after which a worker that has not answered is stuck
  (stopped, swapping): far past what a loaded machine takes for `timeout_s`
  of CPU time."""
  return max(_MIN_WALL_S, WALL_FACTOR * timeout_s)


@dataclasses.dataclass
class _Job:
  index: int  # of the request in its batch
  cpu_s: float | None  # the worker's CPU time when it got the request
  sent: float  # time.monotonic() then
  used: float = 0.0  # CPU seconds it had used on it when last looked at ...
  seen: float = 0.0  # ... at this time.monotonic()

  def __post_init__(self):
    self.seen = self.sent


class _Worker:
  """One Math-Verify child process (see _math_worker.py)."""

  def __init__(self):
    self.proc = subprocess.Popen(
        [sys.executable, "-I", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
    self.ready = False
    self.started = time.monotonic()
    self.job: _Job | None = None  # while it works on one

  def cpu_seconds(self) -> float | None:
    return _cpu_seconds(self.proc.pid)

  def kill(self):
    self.proc.kill()
    self.proc.wait()


class _Symbolic:
  """Math-Verify in child processes: `processes` at work and one spare.

  A batch's requests are spread over the working processes (sympy holds the
  GIL, so parallel work needs processes). Each request may use `timeout_s`
  of its worker's CPU time: the worker stops itself there (SIGPROF) and
  answers "t"; where sympy spins in C and no signal handler runs, this
  process reads the worker's CPU time from /proc and kills it a little past
  the budget; a worker silent for `wall_bound` seconds is killed too. Each
  of these makes the request TIMED_OUT, and the worker is replaced by the
  spare, which has been importing sympy meanwhile, while a new spare starts:
  a timeout costs its own budget, never a wait for a new worker, and one
  slow answer does not stall the rest of the batch.
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

  def ask_many(self, requests: list[dict], timeout_s: float) -> list:
    """The workers' verdicts on `requests` (see _math_worker.py): True, False,
    or TIMED_OUT for one that ran out of `timeout_s` CPU seconds."""
    results: list = [False] * len(requests)
    if not requests:
      return results
    # A little CPU past the budget before this process kills: the worker's own
    # SIGPROF stops Python code on time; this catches sympy stuck in C.
    cpu_limit = timeout_s + max(0.2, 0.5 * timeout_s)
    wall_limit = wall_bound(timeout_s)
    with self._lock:
      self._ensure()
      pending = list(range(len(requests)))[::-1]
      while pending or any(w.job for w in self._workers):
        working = self._workers[:self.processes]
        for w in working:
          if w.ready and w.job is None and pending:
            i = pending.pop()
            try:
              w.proc.stdin.write(json.dumps({**requests[i], "t": timeout_s}) + "\n")
              w.proc.stdin.flush()
            except (OSError, ValueError):
              pass  # a dead worker: its job times out below
            w.job = _Job(i, w.cpu_seconds(), time.monotonic())
        waiting = [w for w in working if w.job or not w.ready]
        now = time.monotonic()
        # CPU time runs no faster than the wall clock (one thread): no job can
        # overrun before the CPU it has left has passed on the wall clock.
        waits = [min(w.job.seen + cpu_limit - w.job.used, w.job.sent + wall_limit) - now
                 for w in waiting if w.job]
        waits += [w.started + _STARTUP_S - now for w in waiting if not w.ready]
        readable = select.select([w.proc.stdout for w in waiting], [], [],
                                 max(0.005, min(waits)))[0]
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
              results[w.job.index] = TIMED_OUT if line == "t" else line == "1"
              late = line == "t"
              w.job = None
              if late:
                self._retire(w)  # interrupted anywhere in sympy: start afresh
          elif w.job and self._overran(w, cpu_limit, wall_limit):
            results[w.job.index] = TIMED_OUT
            self._retire(w)  # its next answer would be stale
          elif not w.ready and time.monotonic() >= w.started + _STARTUP_S:
            self._retire(w)
            raise RuntimeError("the math-verify worker did not start within "
                               f"{_STARTUP_S:.0f}s")
    return results

  @staticmethod
  def _overran(worker: _Worker, cpu_limit: float, wall_limit: float) -> str | None:
    """Why the worker's job has overrun: "cpu" (it used more than `cpu_limit`
    CPU seconds: stuck in C, where its own SIGPROF cannot stop it) or "wall"
    (no answer for `wall_limit` seconds: stopped, swapping); else None."""
    job, now = worker.job, time.monotonic()
    if now - job.sent >= wall_limit:
      return "wall"
    if job.used + (now - job.seen) < cpu_limit:
      return None  # not yet possible
    cpu = worker.cpu_seconds()
    if cpu is None or job.cpu_s is None:
      return None  # no /proc: its own SIGPROF and the wall bound only
    job.used, job.seen = cpu - job.cpu_s, now
    return "cpu" if job.used >= cpu_limit else None

  def _retire(self, worker: _Worker):
    worker.kill()
    self._workers.remove(worker)
    self._ensure()  # the spare moves up; a new spare starts importing now

  def equivalent(self, pred: str, gold: str, timeout_s: float):
    return self.ask_many([{"p": pred, "g": gold}], timeout_s)[0]


_SYMBOLIC = _Symbolic()
atexit.register(_SYMBOLIC.close)


def is_equivalent(prediction: str | None, gold: str | None, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
  """Is the predicted answer mathematically the gold one?

  Both are answers already extracted (see `extract_answer`). Plain numbers
  are compared here, exactly; other forms go to math-verify (symbolic,
  sets/tuples/intervals, relations as the sets they describe) in a child
  process with `timeout_s` CPU seconds. Number words are read (`five
  apples` is 5 apples) and units that differ (`5 km`, `5 m`) are different
  answers; a unit on one side only is fine. Answers that would build
  astronomically large numbers are refused (False) without evaluation, and
  nothing is ever eval'd. Raises GradingTimeout when math-verify runs out of
  its budget: that is no verdict, not a False one.
  """
  if not isinstance(prediction, str) or not isinstance(gold, str):
    return False
  if max(len(prediction), len(gold)) > 4 * MAX_ANSWER_CHARS:
    return False  # before normalising: its regexes should not see a whole essay
  prediction, gold = read_number_words(prediction), read_number_words(gold)
  if prediction is None or gold is None or unreadable(prediction):
    return False
  prediction, gold = _spelled_value(prediction), _spelled_value(gold)
  if _units_differ(prediction, gold):
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
  verdict = _SYMBOLIC.equivalent(p, g, timeout_s)
  if verdict is TIMED_OUT:
    raise GradingTimeout(f"math-verify took over {timeout_s} CPU seconds on {p[:40]!r}")
  return verdict


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
  key = normalise(_spelled_value(pred)).replace(" ", "")
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


VERIFY_WINDOW = 1500  # a text without any stated answer: Math-Verify reads this much of its end
MAX_VERIFY_CHARS = 5000  # a stated answer longer than this is no answer
_MATH_DELIMITERS = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_warned: set = set()


def _tail(text: str) -> str:
  """The last VERIFY_WINDOW characters of a text that states no answer, where
  Math-Verify looks for its last number or LaTeX span, starting on a line so
  that an inline `$...$` is not cut in half and its dollars mispaired."""
  if len(text) <= VERIFY_WINDOW:
    return text
  cut = len(text) - VERIFY_WINDOW
  newline = text.find("\n", cut)
  return text[newline + 1:] if 0 <= newline < cut + 300 else text[cut:]


def _last_sentence(text: str) -> str:
  """The last sentence with a digit: where an answer nobody marked sits."""
  sentences = [x for x in re.split(r"(?<=[.!?])\s+|\n", text) if re.search(r"\d", x)]
  return sentences[-1] if sentences else ""


def _gold_text(reference) -> str | None:
  """The gold as Math-Verify should read it: from a reference with math
  delimiters, its final answer as a completion's is found (a solution's last
  box); a GSM8K `#### n` or bare answer as that answer, LaTeX wrapped in
  `$...$`."""
  if reference is None:
    return None
  ref = str(reference).strip()
  if not ref:
    return None
  if _MATH_DELIMITERS.search(ref) and "####" not in ref:
    found = _final_answer(ref[-MAX_SCAN_CHARS:])
    if found is None or found.kind == "mark":
      return _tail(ref)
    return found.source
  gold = gold_answer(ref)
  if gold is None or len(gold) > 4 * MAX_ANSWER_CHARS:
    return None
  # A plain number as Math-Verify reads numbers; anything else (`1, 2`, a
  # list) as LaTeX, where `1, 2` is the set {1, 2}.
  return gold if as_number(gold.rstrip("%").strip()) is not None else f"${gold}$"


def _tidy(text: str) -> str:
  """What Math-Verify misreads: a sentence's full stop after a number (`10/3.`
  becomes the float 10/3.0, and no longer equals 10/3), an escaped dollar
  sign (`\\$5.00` holds no number it takes)."""
  text = text.replace("\\$", " ")
  return re.sub(r"(?<=\d)\.(?=\s|$|[)\]}$])", "", text)


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


def _plain_numbers(answers: Sequence[str] | None, source: str, gold: str,
                   float_rounding: int) -> bool | None:
  """The verdict when both answers are plain numbers (every box of the final
  group, or the stated value, the same number; or a text that is nothing but
  a number: `#### 72`, <answer>72</answer>); None to ask Math-Verify. Its
  rule: equal exactly, or after rounding both to `float_rounding` decimals
  when either is written with decimals."""
  g_text = gold.strip("$ ")
  g = as_number(g_text)
  if g is None:
    return None
  if answers is None:
    if _BOXED.search(source) or (p := as_number(normalise(source))) is None:
      return None
    return _plain_equal(p, g, is_decimal(normalise(source)) or is_decimal(g_text),
                        float_rounding)
  values = {(as_number(t), is_decimal(t)) for t in (normalise(a) for a in answers)}
  if len(values) != 1:
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
  """`grade`'s verdict when it needs no Math-Verify, else the worker's request.

  Everything here is linear in the completion (the scans that find its final
  answer) or bounded by the answer's size; Math-Verify's parsing, which is
  not, runs in the worker under its CPU budget.
  """
  gold = _gold_text(reference)
  if gold is None:
    return None
  if not isinstance(completion, str):
    return False
  found = _final_answer(completion[-MAX_SCAN_CHARS:])
  answers = None  # the stated answers, where the completion states one
  if found is None or found.kind == "mark":
    # Nothing stated, or GSM8K's `#### 42` and R1's <answer>...</answer>, which
    # Math-Verify knows no more than any text: their text, read as a whole.
    source = _tail(completion if found is None else found.answers[0])
    region = _last_sentence(source)
  elif None in found.answers or len(found.source) > MAX_VERIFY_CHARS:
    warn_hostile(f"a final answer over {MAX_BOX_CHARS} characters or nested "
                 f"{MAX_BOX_NESTING} boxes deep scores 0")
    return False
  else:
    source, answers = found.source, list(found.answers)
    region = "\n".join(answers)
  if too_large(source) or too_large(gold):
    warn_hostile("an answer that would build an astronomically large number scores 0")
    return False
  source, gold, region = (read_number_words(t) for t in (source, gold, region))
  if source is None or gold is None or region is None:
    warn_hostile("a number with an exponent past 1e100 in words scores 0")
    return False
  if answers is not None:
    answers = region.split("\n")
  if unreadable(region) or (answers and (_equation_not_value(region, gold)
                                         or re.match(r"[\s$(]*not\b", region))):
    return False  # `The answer is not 5.` is no answer
  if as_number(gold.strip("$ ")) is not None and _TWO_VALUES.search(region):
    return False  # `5 and 6` is two answers, not the one the gold is
  if answers and len(answers) == 1:
    if (spelled := _spelled_value(answers[0])) != answers[0]:
      answers, source = [spelled], spelled  # `The answer is ten.`: Math-Verify reads no words
    if _units_differ(answers[0], _spelled_value(gold_answer(reference) or "")):
      return False  # `5\text{ km}` is not `5\text{ m}`
  fast = _plain_numbers(answers, source, gold, float_rounding)
  if fast is not None:
    return fast
  return {"c": _tidy(source), "g": _tidy(gold), "r": float_rounding, "s": strict,
          "a": allow_set_relation_comp}


def grade_many(completions: Sequence[str], references: Sequence, *, float_rounding: int = 6,
               strict: bool = True, allow_set_relation_comp: bool = True,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
  """`grade` over a batch `[N]`, Math-Verify's share spread over its processes.

  Each row's verdict is True, False, None (no reference) or TIMED_OUT
  (Math-Verify ran out of `timeout_s` CPU seconds on it: no verdict, which
  is truthy: test it with `is TIMED_OUT` before anything else).
  """
  out = [_verdict_or_request(c, r, float_rounding, strict, allow_set_relation_comp)
         for c, r in zip(completions, references)]
  asks = [i for i, v in enumerate(out) if isinstance(v, dict)]
  for i, verdict in zip(asks, _SYMBOLIC.ask_many([out[i] for i in asks], timeout_s)):
    out[i] = verdict
  return out


def grade(completion: str, reference, *, float_rounding: int = 6, strict: bool = True,
          allow_set_relation_comp: bool = True,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> bool | None:
  """Is the completion's final answer the reference's? None: no reference.

  The final answer is the last one the completion commits to (a box group,
  an answer phrase, a correction, `#### X`, <answer>X</answer>; see the
  module's docstring), found by linear scans; only it is parsed. Math-Verify
  (TRL's accuracy reward and verl grade with it) reads it, in a child
  process with `timeout_s` CPU seconds: several boxes of one group are one
  answer, a set (`\\boxed{2}` and `\\boxed{3}` is {2, 3}); relations,
  sets, intervals, tuples and matrices are compared as such. Around it, what
  a careful grader adds: number words are read (`10 million`, `5 squared`,
  `2 1/2`, `2.5e6`, `five`), an answer whose words leave it uncertain (`5 or
  more`, `4 2`) scores False, a boxed equation is not its right-hand side
  (`0 = 42`), units that differ are different answers, astronomically large
  numbers are refused before anything evaluates them, and plain numbers are
  compared here, exactly, without the child process.
  float_rounding, strict, allow_set_relation_comp: Math-Verify's `verify`;
  allow_set_relation_comp is on by default (Math-Verify's is off), so that
  `x > 4` is the interval `(4, \\infty)` either way round.
  Raises GradingTimeout when Math-Verify runs out of its budget.
  """
  verdict = grade_many([completion], [reference], float_rounding=float_rounding, strict=strict,
                       allow_set_relation_comp=allow_set_relation_comp, timeout_s=timeout_s)[0]
  if verdict is TIMED_OUT:
    raise GradingTimeout(f"math-verify took over {timeout_s} CPU seconds")
  return verdict


def warn_hostile(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    logging.getLogger("grpojax.rewards").warning("math reward: %s (shown once)", message)


@dataclasses.dataclass(frozen=True)
class MathAccuracy:
  """TRL-style reward: 1.0 when the completion's final answer equals the gold.

  Gold comes from the first present column of `gold_columns` (row None:
  reward None). A completion without an answer scores 0.0; one whose verdict
  ran out of `timeout_s` CPU seconds is TIMED_OUT (the runtime leaves it out
  of the group's statistics and counts it in rewards/<name>/timeouts). See
  `grade` for how answers are read and compared; `float_rounding`, `strict`
  and `allow_set_relation_comp` are Math-Verify's `verify` options.
  """

  gold_columns: tuple[str, ...] = ("answer", "solution")
  timeout_s: float = DEFAULT_TIMEOUT_S
  name: str = "math_accuracy"
  float_rounding: int = 6
  strict: bool = True
  allow_set_relation_comp: bool = True

  @property
  def __name__(self) -> str:
    return self.name

  def __call__(self, prompts=None, completions=(), **columns) -> list:
    col = next((columns[c] for c in self.gold_columns if c in columns), None)
    if col is None:
      raise KeyError(f"{self.name} needs one of the dataset columns {self.gold_columns}")
    verdicts = grade_many([completion_text(c) for c in completions], list(col),
                          float_rounding=self.float_rounding, strict=self.strict,
                          allow_set_relation_comp=self.allow_set_relation_comp,
                          timeout_s=self.timeout_s)
    return [v if v is None or v is TIMED_OUT else float(v) for v in verdicts]


math_accuracy_reward = MathAccuracy()
