"""Shared helpers for the reward tests (and the multi-host worker script)."""


def decode_chars(rows: list[list[int]]) -> list[str]:
  """A trivial decoder (token id = Unicode code point), in place of a tokenizer."""
  return ["".join(map(chr, row)) for row in rows]


async def trl_everything(prompts, completions, completion_ids, solution, trainer_state,
                         log_metric, log_extra, **kwargs):
  """A reward taking every argument TRL gives one, async: it pays for completions of
  distinct tokens (which vary, so the groups have advantages) and logs what it saw."""
  import asyncio  # pylint: disable=import-outside-toplevel

  await asyncio.sleep(0)
  assert len(prompts) == len(completions) == len(completion_ids) == len(solution)
  assert isinstance(completions[0], list) and completions[0][0]["role"] == "assistant"
  log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
  log_extra("ids", [len(ids) for ids in completion_ids])
  return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]
