"""Format and length rewards: R1-style tags, DAPO's soft overlong penalty.

Lengths are in tokens, read from `completion_ids` (the host bridge always
passes them), as TRL's overlong punishment does.
"""

from __future__ import annotations

import dataclasses
import re

from grpojax.rewards.base import completion_text


@dataclasses.dataclass(frozen=True)
class TagFormat:
  """1.0 when a completion is exactly `<think>…</think><answer>…</answer>`.

  Whitespace may surround the blocks; each tag appears once; nothing else
  is outside them. With `think_prefilled`, the prompt already opened the
  think block (as some chat templates do), so the completion starts inside it.
  """

  think_tag: str = "think"
  answer_tag: str = "answer"
  think_prefilled: bool = False
  name: str = "format"

  @property
  def __name__(self) -> str:
    return self.name

  def score(self, text: str) -> float:
    t, a = re.escape(self.think_tag), re.escape(self.answer_tag)
    opening = "" if self.think_prefilled else rf"<{t}>"
    pattern = rf"\s*{opening}(.*?)</{t}>\s*<{a}>(.*?)</{a}>\s*"
    m = re.fullmatch(pattern, text, re.DOTALL)
    if not m:
      return 0.0
    tags = (f"<{self.think_tag}>", f"</{self.think_tag}>", f"<{self.answer_tag}>",
            f"</{self.answer_tag}>")
    inner = m.group(1) + m.group(2)
    return 0.0 if any(tag in inner for tag in tags) else 1.0

  def __call__(self, prompts=None, completions=(), **columns) -> list[float]:
    return [self.score(completion_text(c)) for c in completions]


format_reward = TagFormat()


def soft_overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
  """DAPO's soft overlong punishment of one completion of `length` tokens.

  0 up to `max_length - cache_length`, then linear down to -1 at
  `max_length`, and -1 beyond.
  """
  if not 0 < cache_length <= max_length:
    raise ValueError(f"need 0 < cache_length ({cache_length}) <= max_length ({max_length})")
  start = max_length - cache_length
  if length <= start:
    return 0.0
  if length <= max_length:
    return (start - length) / cache_length
  return -1.0


def _lengths(name: str, completion_ids) -> list[int]:
  if completion_ids is None:
    raise KeyError(f"{name} measures lengths in tokens: it needs `completion_ids`")
  return [len(ids) for ids in completion_ids]


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
  """TRL-style reward wrapping `soft_overlong_penalty` (lengths from completion_ids)."""

  max_length: int
  cache_length: int
  name: str = "soft_overlong_penalty"

  @property
  def __name__(self) -> str:
    return self.name

  def __call__(self, prompts=None, completions=(), completion_ids=None, **columns):
    return [soft_overlong_penalty(n, self.max_length, self.cache_length)
            for n in _lengths(self.name, completion_ids)]
