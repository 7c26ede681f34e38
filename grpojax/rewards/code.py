"""The code reward: 1.0 if a completion's Python passes its tests, else 0.0.

`extract_code` reads the Python out of a completion's Markdown code fences;
`CodeReward` runs it against the row's tests in the code sandbox
(grpojax/sandbox: `run_tests`, the process layout, the isolation layers and
why a hostile program cannot pass).
"""

from __future__ import annotations

import dataclasses
import re

from grpojax import sandbox
from grpojax.rewards.base import completion_text
from grpojax.sandbox import STATUSES, ExecResult, SandboxUnavailable, judging, sandbox_isolation

# DESIGN's contract: grpojax.rewards.code.run_tests(program, tests, *, timeout_s, memory_mb)
# -> ExecResult, for callers that grade code themselves. The sandbox moved to
# grpojax/sandbox; this path, and the function it names, did not change.
run_tests = sandbox.run_tests

__all__ = ["BLOCKS", "STATUSES", "CodeReward", "ExecResult", "SandboxUnavailable", "code_reward",
           "extract_code", "run_tests", "sandbox_isolation"]
BLOCKS = ("last", "first", "all")
_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})
# CommonMark's fences: 4 spaces of indent would make an indented code block
# instead, and the info string of a backtick fence may hold no backtick (else
# ```x``` is an inline code span).
_OPEN = re.compile(r"( {0,3})(`{3,}|~{3,})(.*)")
_CLOSE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t]*")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
  """(info string, content) of each fenced code block, as CommonMark reads them."""
  lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
  if lines[-1] == "":
    lines.pop()  # a final newline ends the last line; it does not start another
  blocks, i = [], 0
  while i < len(lines):
    opening = _OPEN.fullmatch(lines[i])
    i += 1
    if not opening or (opening[2][0] == "`" and "`" in opening[3]):
      continue
    indent, fence, body = len(opening[1]), opening[2], []
    # An unclosed fence runs to the end of the text (a completion cut off at
    # max length).
    while i < len(lines):
      line = lines[i]
      i += 1
      closing = _CLOSE.fullmatch(line)
      if closing and closing[1][0] == fence[0] and len(closing[1]) >= len(fence):
        break
      body.append(line[min(indent, len(line) - len(line.lstrip(" "))):] + "\n")
    blocks.append((opening[3].strip(), "".join(body)))
  return blocks


def _check_block(block: str) -> None:
  if block not in BLOCKS:
    raise ValueError(f"block={block!r} is unknown; known: {', '.join(map(repr, BLOCKS))} "
                     "(which Python code block of a completion is graded)")


def extract_code(text: str, block: str = "last") -> str:
  """The Python code of a completion, from its fenced blocks as Markdown reads them.

  Blocks whose info string starts with python, python3, py or py3 (any case)
  count; without any, untagged blocks do; blocks of other languages (bash,
  text, output, ...) never do. `block` picks "last" (the default), "first",
  or "all" (joined in order, for a solution split over several blocks). The
  last is graded by default, as in open-r1 and verl: models show usage or a
  draft first and end with their answer. Text without any fence is graded
  whole (bare code); text whose fences hold no Python gives "" (fails every
  test) rather than running its prose.
  """
  _check_block(block)
  blocks = _fenced_blocks(text)
  if not blocks:
    return text
  tagged = [code for info, code in blocks
            if re.match(r"[\w+-]*", info)[0].lower() in _PYTHON_TAGS]
  code = tagged or [code for info, code in blocks if not info]
  if not code:
    return ""
  return "".join(code) if block == "all" else code[-1 if block == "last" else 0]


@dataclasses.dataclass(frozen=True)
class CodeReward:
  """TRL-style reward: 1.0 if the completion's code passes its tests, else 0.0.

  Reads the tests from the dataset column `tests_column` (a value per row
  in any form `run_tests` accepts); None where a row has no tests.
  The task's entry point (the name the tests must call on the program, also
  where it is a builtin's: HumanEval's and LeetCode's `entry_point`) comes from
  `entry_point_column` where the row has it, else from the functions and
  classes the row's reference solution defines (`reference_column`, MBPP's
  `code`) that the tests use; `setup_column` names the task's own helper code
  (MBPP's `test_setup_code`, LeetCode's ListNode). See `run_tests`.
  `namespaces=False` is `run_tests`' opt-out for containers that cannot
  create namespaces (weaker: the host's files and network stay visible).
  `block` is `extract_code`'s: which Python block is graded.
  """

  timeout_s: float = 5.0
  memory_mb: int = 512
  tests_column: str = "tests"
  name: str = "code_reward"
  namespaces: bool = True
  block: str = "last"
  entry_point_column: str | None = "entry_point"
  setup_column: str | None = None
  reference_column: str | None = None

  def __post_init__(self) -> None:
    _check_block(self.block)

  def startup_check(self) -> None:
    """Raises SandboxUnavailable now, before a run compiles, if the sandbox cannot run here."""
    sandbox_isolation(self.namespaces)

  @property
  def __name__(self) -> str:  # reward functions are named by __name__ (TRL)
    return self.name

  def __call__(self, prompts=None, completions=(), **columns) -> list[float | None]:
    tests = columns.get(self.tests_column)
    if tests is None:
      raise KeyError(f"{self.name} needs a {self.tests_column!r} dataset column")
    n = len(completions)

    def column(name):
      values = columns.get(name) if name else None
      return [None] * n if values is None else values

    out = []
    for completion, t, entry, setup, reference in zip(
        completions, tests, column(self.entry_point_column), column(self.setup_column),
        column(self.reference_column)):
      if t is None:
        out.append(None)
        continue
      if not entry and reference:
        entry = judging.reference_entry_points(reference, t) or None
      program = extract_code(completion_text(completion), self.block)
      res = run_tests(program, t, entry_point=entry or None, setup=setup or None,
                      timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                      namespaces=self.namespaces)
      out.append(1.0 if res.passed else 0.0)
    return out


code_reward = CodeReward()
