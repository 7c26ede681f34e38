"""Task rows → tokenized, left-padded prompt batches: seeded, per-process, resumable.

Axes: B prompts per step (global), b = B / processes rows fed by this process,
P padded prompt length (a bucket, the same on every process).
"""

from __future__ import annotations

import logging

import numpy as np

from grpojax.data.tasks import DataError, Row, Task
from grpojax.models.tokenizers import buckets_up_to, left_pad


def prompt_text(task: Task, row: Row, tokenizer, observation: str | None = None) -> str:
  """The task's prompt for a row, through the tokenizer's chat template if it is chat.

  observation: an environment's reset() text, joined to the last message (TRL's
  environment_factory). A tokenizer with `row_tools` shows each row the tools its
  environment has (a dict environment_factory: grpojax.tools.Environments.schema).
  """
  prompt = observed(task.prompt(row), observation)
  if isinstance(prompt, str):
    return prompt
  row_tools = getattr(tokenizer, "row_tools", None)
  if row_tools is None:
    return tokenizer.apply_chat_template(prompt)
  return tokenizer.apply_chat_template(prompt, tools=row_tools(row) or None)


def observed_prompt(task: Task, row: Row, tokenizer, observation: str,
                    max_prompt_length: int) -> tuple[list[int], object]:
  """A row's prompt with an environment's reset() text joined: (its token ids, the
  reward functions' `prompts` entry: the rendered text, or the chat messages where the
  task hands rewards TRL's shapes). DataError if the text makes it too long."""
  rendered = prompt_text(task, row, tokenizer, observation=observation)
  encoded = tokenizer.encode(rendered)
  if len(encoded) > max_prompt_length:
    raise DataError(f"an environment's reset() text makes a prompt {len(encoded)} tokens, "
                    f"past rollout.max_prompt_length={max_prompt_length}: raise it")
  shown = observed(task.prompt(row), observation)
  return encoded, rendered if isinstance(shown, str) or not task.trl_shapes else shown


def observed(prompt, observation: str | None):
  """A prompt (text or chat messages) with `observation` appended to its last message,
  as TRL joins an environment's reset() text (no separator)."""
  if observation is None:
    return prompt
  if isinstance(prompt, str):
    return prompt + observation
  messages = list(prompt)
  return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]


class PromptIterator:
  """Yields this process's share of each step's prompts, in a seeded order.

  Prompts longer than `max_prompt_length` tokens are dropped at start-up with a
  logged count (`on_long="filter"`) or stop the run (`on_long="error"`): a
  question is never silently truncated. The position (epoch, offset) is saved
  in checkpoints through `state_dict` / `load_state_dict`.

  environments: a grpojax.tools.Environments: each batch resets its rows'
  environments first, and a reset's text joins its prompt (rendered again for that
  batch; the reward functions see that prompt).
  """

  def __init__(self, rows: list[Row], task: Task, tokenizer, *, batch_size: int,
               max_prompt_length: int, seed: int, on_long: str = "filter",
               process_index: int = 0, process_count: int = 1, buckets=None,
               environments=None):
    if on_long not in ("filter", "error"):
      raise ValueError(f"on_long={on_long!r}; valid: 'filter', 'error'")
    if batch_size % process_count:
      raise ValueError(f"{batch_size} prompts per step do not split over {process_count} processes")
    texts = [prompt_text(task, row, tokenizer) for row in rows]
    encoded = [tokenizer.encode(t) for t in texts]
    keep = [i for i, ids in enumerate(encoded) if len(ids) <= max_prompt_length]
    dropped = len(rows) - len(keep)
    # What would keep them all: a user who switched task or model rarely knows.
    longest = max(map(len, encoded), default=0)
    fix = f"the longest is {longest} tokens (rollout.max_prompt_length={longest} keeps every one)"
    if dropped and on_long == "error":
      raise DataError(f"{dropped} prompts of task {task.name!r} exceed "
                      f"rollout.max_prompt_length={max_prompt_length} tokens; {fix}")
    if dropped:
      logging.warning("dropped %d of %d prompts longer than %d tokens; %s", dropped, len(rows),
                      max_prompt_length, fix)
    if len(keep) < batch_size:
      why = (f", {dropped} of {len(rows)} being longer than rollout.max_prompt_length="
             f"{max_prompt_length} tokens; {fix}" if dropped else "")
      raise DataError(f"task {task.name!r} has {len(keep)} usable prompts, fewer than the "
                      f"{batch_size} prompts one step needs (rollout.prompts_per_step){why}")
    # The reward functions' `prompts`: the rendered text, or (trl_shapes) the chat messages.
    self.rows = [dict(rows[i], prompt=task.reward_prompt(rows[i], texts[i])) for i in keep]
    self.encoded = [encoded[i] for i in keep]
    self.task, self.tokenizer, self.environments = task, tokenizer, environments
    self._given = [rows[i] for i in keep]  # as the dataset has them: reset()'s columns
    self._observed: dict[int, tuple[list[int], Row]] = {}  # this batch's, by example id
    self.num_dropped = dropped
    self.batch_size, self.seed = batch_size, seed
    self.pad_id = tokenizer.pad_id
    self.buckets = list(buckets or buckets_up_to(max_prompt_length))
    self.max_prompt_length = max_prompt_length
    self.process_index, self.process_count = process_index, process_count
    self.epoch, self.offset = 0, 0
    self._order = self._shuffled(0)

  def _shuffled(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

  def lookup(self, example_id: int) -> Row:
    """The row (with its formatted `prompt`) behind an example id, for the verifiers."""
    seen = self._observed.get(int(example_id))
    return self.rows[int(example_id)] if seen is None else seen[1]

  def _observe(self, ids, start: int) -> None:
    """Resets the environments of these examples' rows (`start`: the first one's place
    in this epoch's order); a reset's text joins its prompt."""
    self._observed = {}
    keys = [(self.seed, self.epoch, start + j) for j in range(len(ids))]  # each draw its own
    texts = self.environments.reset([self._given[i] for i in ids], keys=keys)
    for i, text in zip(ids.tolist(), texts):
      if text is None:
        continue
      encoded, reward_prompt = observed_prompt(self.task, self._given[i], self.tokenizer, text,
                                               self.max_prompt_length)
      self._observed[i] = (encoded, dict(self.rows[i], prompt=reward_prompt))

  def next(self) -> dict[str, np.ndarray]:
    """This process's rows of the next step: prompt_tokens [b, P], prompt_mask [b, P], example_ids [b]."""
    if self.offset + self.batch_size > len(self._order):
      self.epoch, self.offset = self.epoch + 1, 0  # drop the ragged tail: fixed shapes
      self._order = self._shuffled(self.epoch)
    ids = self._order[self.offset:self.offset + self.batch_size]
    if self.environments is not None:  # one process (wiring.tool_hook): ids are all its own
      self._observe(ids, self.offset)
    self.offset += self.batch_size
    chosen = {i: self._observed[i][0] if i in self._observed else self.encoded[i]
              for i in ids.tolist()}
    # One padded width for the whole global batch, so every process agrees on P.
    longest = max(map(len, chosen.values()))
    width = min(b for b in self.buckets if b >= longest)
    b = self.batch_size // self.process_count
    mine = ids[self.process_index * b:(self.process_index + 1) * b]
    tokens, mask = left_pad([chosen[i] for i in mine.tolist()], self.pad_id,
                            max_length=self.max_prompt_length, buckets=[width])
    return {"prompt_tokens": tokens, "prompt_mask": mask.astype(np.int32),
            "example_ids": np.asarray(mine, np.int32)}

  def state_dict(self) -> dict[str, int]:
    return {"epoch": self.epoch, "offset": self.offset}

  def load_state_dict(self, state: dict[str, int]) -> None:
    self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
    self._order = self._shuffled(self.epoch)

  def rewind(self, state: dict[str, int], used: int) -> None:
    """Moves back to `used` prompts into the batch that `next()` drew from position
    `state` (a state_dict taken just before it): the prompts after them are served
    again (DAPO's streaming returns those past the groups it needed)."""
    self.load_state_dict(state)
    if self.offset + self.batch_size > len(self._order):  # that batch began an epoch
      self.epoch, self.offset = self.epoch + 1, 0
      self._order = self._shuffled(self.epoch)
    self.offset += used
