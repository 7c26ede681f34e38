"""Shared helpers for the reward tests (and the multi-host worker script)."""


def decode_chars(rows: list[list[int]]) -> list[str]:
  """A trivial decoder (token id = Unicode code point), in place of a tokenizer."""
  return ["".join(map(chr, row)) for row in rows]
