"""The task registry: a task is a dataset loader, a prompt template, reward
functions with weights, a correctness check for eval, and an SFT target.

Research code adds a task with `register_task(Task(...))` and selects it with
`--config.task.name=...`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable

from grpojax.data import rows as rows_lib
from grpojax.data import synthetic
from grpojax.rewards import code as code_rewards
from grpojax.rewards import countdown as countdown_rewards
from grpojax.rewards import format as format_rewards
from grpojax.rewards import math as math_rewards
from grpojax.registry import Registry
from grpojax.rewards.base import call_reward_fn, completion_text

Row = dict
Prompt = str | list[dict]  # plain text, or chat messages for the tokenizer's template

BOXED = "Reason step by step, then put the final answer in \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Task:
  """Everything task-specific; the rest of the framework is task-agnostic.

  name: registry key.
  default_dataset: HF hub name or local path used when task.dataset is "".
  columns: dataset columns the task needs (checked at startup).
  prompt: row -> text or chat messages.
  reward_fns, reward_weights: TRL-style reward functions and their weights.
    The first is the task's verifier (later ones shape: format, length).
  is_correct: (completion text, row) -> bool, for eval/accuracy and pass@k.
    None (the default) derives it from the verifier, so that eval and the
    training reward cannot disagree: correct iff `reward_fns[0]` gives the
    completion a full score, >= 1.0 (rewards are TRL's 0..1 scale); None or
    a raising reward is wrong. Give it for a verifier on another scale.
  sft_target: row -> reference completion for the SFT warm start (None: no SFT data).
  load: optional (dataset, split, seed) -> list of rows, for generated tasks.
  trl_shapes: reward functions get TRL's shapes: for a row whose prompt is chat
    messages, `prompts` holds the messages and each completion is
    `[{"role": "assistant", "content": text}]` (plain strings otherwise).
  answer_key: optional (completion text, row) -> the completion's final answer in
    a canonical form, or None (no answer), for majority voting (eval/maj@k):
    completions with equal keys give the same answer. None: no maj@k (tasks
    whose answers have no canonical form: programs, equations).
  """

  name: str
  default_dataset: str
  columns: tuple[str, ...]
  prompt: Callable[[Row], Prompt]
  reward_fns: tuple[Callable, ...]
  is_correct: Callable[[str, Row], bool] | None = None
  reward_weights: tuple[float, ...] | None = None
  sft_target: Callable[[Row], str] | None = None
  load: Callable[[str, str, int], list[Row]] | None = None
  splits: tuple[str, str] = ("train", "test")  # (train, held-out eval)
  trl_shapes: bool = False
  answer_key: Callable[[str, Row], str | None] | None = None

  def __post_init__(self):
    if self.is_correct is None and self.reward_fns:
      object.__setattr__(self, "is_correct", _FullScore(
          self.reward_fns[0], self.prompt if self.trl_shapes else None))

  def reward_prompt(self, row: Row, text: str):
    """The `prompts` value reward functions get for a row whose rendered prompt is `text`."""
    if self.trl_shapes:
      raw = self.prompt(row)
      if not isinstance(raw, str):
        return list(raw)
    return text

  @property
  def correct_means_full_score(self) -> bool:
    """is_correct is derived (reward_fns[0] >= 1.0), so a reward pool can score it."""
    return isinstance(self.is_correct, _FullScore) and self.is_correct.reward_fn is self.reward_fns[0]


@dataclasses.dataclass(frozen=True)
class _FullScore:
  """is_correct derived from a verifier: its reward for the completion is >= 1.0."""

  reward_fn: Callable
  trl_prompt: Callable | None = None  # Task.prompt of a trl_shapes task

  def __call__(self, completion: str, row: Row) -> bool:
    # prompts=[None]: a verifier judges the completion against the row's columns.
    prompt = None
    if self.trl_prompt is not None and not isinstance(self.trl_prompt(row), str):
      prompt, completion = list(self.trl_prompt(row)), [{"role": "assistant", "content": completion}]
    kwargs = {"prompts": [prompt], "completions": [completion],
              **{k: [v] for k, v in row.items() if k != "prompt"}}
    values, *_ = call_reward_fn(self.reward_fn, kwargs, 1)
    return bool(values[0] >= 1.0)  # NaN (None, raised) is False


TASKS: Registry[Task] = Registry("task.name")


class DataError(ValueError):
  """A dataset that cannot train: the message names the file (or hub name) and column."""


class MissingSplit(DataError):
  """A local dataset folder holds split files, but not the one asked for."""


def register_task(task: Task, *, override: bool = False) -> Task:
  """Makes `task` selectable as task.name; another task of its name raises unless override."""
  return TASKS.register(task.name, task, override=override)


def get_task(name: str) -> Task:
  return TASKS.get(name)


def load_rows(task: Task, dataset: str, split: str, *, seed: int = 0) -> list[Row]:
  """The split's rows as dicts, checked for the task's columns.

  `dataset` is "" (the task's default), an HF hub name with an optional
  ":<config>" (e.g. "openai/gsm8k:main"), a local .json/.jsonl/.parquet file,
  or a directory holding `<split>.jsonl` / `<split>.json` / `<split>.parquet`.
  `split` may carry an HF slice, e.g. "train[:1000]" or "train[1000:1100]" (a
  directory's file is named by the split without it); a local file serves as
  whichever split is asked for.

  An empty split, a required column null in every row, or an unreadable file
  (not UTF-8, not JSON) raises DataError naming the file and column.
  """
  dataset = dataset or task.default_dataset
  if task.load is not None:
    source, rows = dataset, task.load(dataset, split, seed)
  else:
    source, rows = _load_dataset(dataset, split)
  if not rows:
    raise DataError(f"dataset {source!r} split {split!r} has no rows")
  missing = [c for c in task.columns if c not in rows[0]]
  if missing:
    raise DataError(f"task {task.name!r}: dataset {source!r} split {split!r} lacks "
                    f"column(s) {missing}; it has {sorted(rows[0])}")
  for c in task.columns:
    nulls = sum(row.get(c) is None for row in rows)
    # All null is a broken file, not sparse data: every reward would be None and
    # the run would train on nothing while looking healthy.
    if nulls == len(rows):
      raise DataError(f"dataset {source!r} split {split!r}: column {c!r} is null in all "
                      f"{nulls} rows")
    if nulls:
      logging.warning("dataset %r split %r: column %r is null in %d of %d rows (their rewards "
                      "are None)", source, split, c, nulls, len(rows))
  return rows


def _load_dataset(dataset: str, split: str) -> tuple[str, list[Row]]:
  """(the file or hub name it came from, its rows)."""
  kinds = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
  # The file is registered under the split's name without its slice, which
  # load_dataset then applies: "train[:100]" reads the first 100 rows of train.
  base = split.split("[")[0]
  if os.path.isfile(dataset):
    kind = kinds.get(os.path.splitext(dataset)[1])
    if kind is None:
      raise DataError(f"dataset file {dataset!r}: expected one of {sorted(kinds)}")
    return dataset, _load_file(kind, dataset, base, split)
  if os.path.isdir(dataset):
    for ext, kind in kinds.items():
      path = os.path.join(dataset, f"{base}{ext}")
      if os.path.isfile(path):
        return path, _load_file(kind, path, base, split)
    others = sorted(f for f in os.listdir(dataset) if os.path.splitext(f)[1] in kinds)
    if others:  # a folder of split files without this one (not an HF dataset's layout)
      raise MissingSplit(f"dataset directory {dataset!r} has no split {base!r} (no {base}.jsonl, "
                      f".json or .parquet; it has {', '.join(others)})")
  import datasets  # heavy; only real datasets need it

  name, _, subset = dataset.partition(":")
  return dataset, list(datasets.load_dataset(name, subset or None, split=split))


def _blank(path: str) -> bool:
  """Is the file empty or only whitespace (read until its first other byte)?"""
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 16), b""):
      if chunk.strip():
        return False
  return True


def _utf8_error(path: str) -> str:
  """Where the file first stops being UTF-8: its line and the byte's offset in the
  file (datasets' own error counts from the block it was reading)."""
  offset = 0
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):  # b"\n" is never inside a UTF-8 sequence
      try:
        raw.decode("utf-8")
      except UnicodeDecodeError as e:
        return f"line {number}, byte {offset + e.start} of the file: {e.reason}"
      offset += len(raw)
  return "its bytes decode; datasets' reader did not"


def _load_file(kind: str, path: str, base: str, split: str) -> list[Row]:
  if kind == "json" and _blank(path):
    return []  # datasets ends an empty file with a bare StopIteration, a blank one worse
  if kind == "json" and rows_lib.is_exact(path):  # the Python API's rows: value for value
    try:
      return rows_lib.load_rows(path, split)
    except ValueError as e:
      raise DataError(str(e)) from None
  import datasets  # heavy; only real datasets need it

  try:
    return list(datasets.load_dataset(kind, data_files={base: path}, split=split))
  except StopIteration:
    return []
  except Exception as e:  # noqa: BLE001 - datasets wraps the cause; name the file
    cause = e
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
      cause = cause.__cause__ or cause.__context__
    if cause is not None:
      raise DataError(f"dataset file {path!r} is not UTF-8 text ({_utf8_error(path)}); "
                      "re-encode it, e.g. iconv -t utf-8") from e
    if isinstance(e, ValueError):
      raise  # datasets' own messages (an empty slice, a bad split) already say enough
    root = e
    while root.__cause__ is not None:  # datasets' wrapper says only "an error occurred"
      root = root.__cause__
    detail = (str(root).splitlines() or [""])[0]
    raise DataError(f"dataset file {path!r} could not be read as {kind}: "
                    f"{type(root).__name__}: {detail}") from e


# ---------------------------------------------------------------- built-in tasks


def _arithmetic_load(dataset: str, split: str, seed: int) -> list[Row]:
  # dataset: "arithmetic[:digits[:ops[:terms]]]", e.g. "arithmetic:2:+-*:3".
  parts = (dataset or "arithmetic").split(":")[1:]
  digits = int(parts[0]) if parts else 2
  ops = parts[1] if len(parts) > 1 else "+-"
  terms = int(parts[2]) if len(parts) > 2 else 2
  if split not in ("train", "test"):
    raise ValueError(f"the arithmetic task generates splits 'train' and 'test' only, got "
                     f"{split!r} (no slices: the rows are generated, not loaded)")
  n, offset = (20000, 0) if split == "train" else (500, 1_000_003)
  return synthetic.arithmetic_rows(n, seed=seed + offset, digits=digits, ops=ops, terms=terms)


def _exact_reward(prompts=None, completions=(), answer=(), **unused) -> list[float]:
  return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


_exact_reward.__name__ = "exact_answer"


def _integer_key(completion: str, row: Row) -> str | None:
  # The text exact_answer compares, when it is a number: equal keys score alike.
  text = completion.strip()
  return text if re.fullmatch(r"-?\d+", text) else None


def _math_key(completion: str, row: Row) -> str | None:
  return math_rewards.answer_key(completion)


def _user(text: str) -> list[dict]:
  return [{"role": "user", "content": text}]


register_task(Task(
    name="arithmetic", default_dataset="arithmetic", columns=("question", "answer"),
    prompt=lambda row: row["question"], reward_fns=(_exact_reward,),
    sft_target=lambda row: row["answer"], load=_arithmetic_load, answer_key=_integer_key))

# TRL's dataset formats: a "prompt" column (text, or chat messages rendered with the
# tokenizer's chat template); every other column goes to the reward functions, which
# come from rewards.functions (e.g. "trl.rewards:think_format_reward").
register_task(Task(
    name="prompt", default_dataset="", columns=("prompt",),
    prompt=lambda row: row["prompt"] if isinstance(row["prompt"], str) else list(row["prompt"]),
    reward_fns=(), trl_shapes=True))

register_task(Task(
    name="gsm8k", default_dataset="openai/gsm8k:main", columns=("question", "answer"),
    prompt=lambda row: _user(f"{row['question']}\n{BOXED}"),
    reward_fns=(math_rewards.MathAccuracy(gold_columns=("answer",)),),
    sft_target=lambda row: row["answer"], answer_key=_math_key))

register_task(Task(
    name="math", default_dataset="HuggingFaceH4/MATH-500", columns=("problem", "answer"),
    prompt=lambda row: _user(f"{row['problem']}\n{BOXED}"),
    reward_fns=(math_rewards.MathAccuracy(gold_columns=("answer",)),),
    sft_target=lambda row: row.get("solution") or f"\\boxed{{{row['answer']}}}",
    splits=("test", "test"), answer_key=_math_key))


def _countdown_prompt(row: Row) -> list[dict]:
  return _user(f"Using the numbers {list(row['nums'])}, each exactly once, and + - * /, "
               f"write an equation that equals {row['target']}. Think in <think> </think>, "
               "then give the equation in <answer> </answer>.")


register_task(Task(
    name="countdown", default_dataset="Jiayi-Pan/Countdown-Tasks-3to4",
    columns=("nums", "target"), prompt=_countdown_prompt,
    reward_fns=(countdown_rewards.CountdownReward(), format_rewards.TagFormat()),
    reward_weights=(1.0, 0.1),
    # No answer_key (no maj@k): right equations differ in form (2*3+1, 1+3*2), unlike answers.
    # The hub dataset has only a train split: hold out TinyZero's 1,024 rows after 327,680.
    splits=("train[:327680]", "train[327680:328704]")))


def _code_prompt(row: Row) -> list[dict]:
  tests = "\n".join(row["test_list"])
  return _user(f"{row['text']}\nYour code should pass these tests:\n{tests}\n"
               "Write the Python function in a ```python code block.")


register_task(Task(
    name="code", default_dataset="google-research-datasets/mbpp",
    columns=("text", "test_list", "code"), prompt=_code_prompt,
    reward_fns=(code_rewards.CodeReward(tests_column="test_list", reference_column="code"),),
    # No answer_key (no maj@k): programs that pass the same tests differ as text.
    sft_target=lambda row: f"```python\n{row['code']}\n```"))
