"""Rows kept exactly: JSON lines that Python's json module writes and reads back.

`datasets.load_dataset` reads JSON through Arrow, which gives each column one
type: an integer past int64 comes back a float (12345678901234567890 becomes
1.2345678901234567e19, and a correct answer to it scores 0), and the ints of a
column that also holds a float come back floats. Rows handed to the Python API
(grpojax.api) are values the user already has in Python: `write` stores them
with a MARKER file beside them, and `load_rows` reads a directory holding the
marker with json, value for value (an HF slice such as "train[:10]" applied as
`datasets` would). Only what JSON cannot say is refused (`check`): a tuple would
come back a list, a dict key that is not a string a string.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping, Sequence

MARKER = "ROWS_ARE_EXACT"  # in a directory: its .jsonl files are read with json, not Arrow
_MARKER_TEXT = ("The .jsonl files in this directory were written by grpojax.api from Python "
                "values and are read back with Python's json module, exactly (not through "
                "Arrow, which turns integers past int64 into floats).\n")


def check(value, where: str) -> None:
  """Raises ValueError naming `where` if `value` would not come back from JSON as it is:
  None, bool, int, float, str, and lists and string-keyed dicts of them, at any depth."""
  if value is None or isinstance(value, (str, int, float)):  # bool is an int
    return
  if isinstance(value, list):
    for i, v in enumerate(value):
      check(v, f"{where}[{i}]")
  elif isinstance(value, Mapping):
    for k, v in value.items():
      if not isinstance(k, str):
        raise ValueError(f"{where} has the key {k!r} ({type(k).__name__}), which JSON would "
                         "make a string; give string keys")
      check(v, f"{where}[{k!r}]")
  elif isinstance(value, tuple):
    raise ValueError(f"{where} is a tuple, which JSON would make a list; give a list")
  else:
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r:.60}); rows hold JSON "
                     "values: text, numbers, booleans, None, and lists and dicts of them")


def dumps(rows: Sequence[Mapping], what: str) -> str:
  """rows as JSON lines, after `check` (ValueError naming `what`, the row and the column)."""
  for i, row in enumerate(rows):
    for key, value in row.items():
      if not isinstance(key, str):
        raise ValueError(f"{what} row {i} has the column name {key!r}: names are strings")
      check(value, f"{what} row {i} column {key!r}")
  return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def _write_once(path: str, text: str) -> None:
  """Writes path whole, or leaves the complete file another process wrote: each writer
  has its own temporary name (several hosts may write one shared directory at once),
  and os.replace puts a finished file in place atomically."""
  if os.path.isfile(path):
    return
  tmp = f"{path}.{uuid.uuid4().hex}.tmp"
  try:
    with open(tmp, "x", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write(directory: str, files: Mapping[str, str]) -> None:
  """Writes {file name: text} (JSON lines from `dumps`) into `directory`, marked exact.
  The same files may be written by several processes at once; none sees a partial one."""
  os.makedirs(directory, exist_ok=True)
  _write_once(os.path.join(directory, MARKER), _MARKER_TEXT)
  for name, text in files.items():
    _write_once(os.path.join(directory, name), text)


def is_exact(path: str) -> bool:
  """Whether `path` (a .jsonl file or a directory) is one `write` made."""
  if os.path.isdir(path):
    return os.path.isfile(os.path.join(path, MARKER))
  return path.endswith(".jsonl") and os.path.isfile(os.path.join(os.path.dirname(path), MARKER))


def load_rows(path: str, split: str) -> list[dict]:
  """The rows of one exact .jsonl file, the split's slice applied (the file is the split).

  Every row gets every column, None where it had none: what Arrow does, so that a task
  sees the same columns either way."""
  with open(path, encoding="utf-8") as f:
    try:
      rows = [json.loads(line) for line in f if line.strip()]
    except json.JSONDecodeError as e:
      raise ValueError(f"dataset file {path!r} is not JSON lines: {e}") from None
  columns = dict.fromkeys(k for row in rows for k in row)
  rows = [row if len(row) == len(columns) else {k: row.get(k) for k in columns} for row in rows]
  if "[" not in split:
    return rows
  import datasets  # heavy; only a slice needs it, and only for its arithmetic

  base = split.split("[")[0]
  spans = datasets.ReadInstruction.from_spec(split).to_absolute({base: len(rows)})
  return [row for span in spans for row in rows[span.from_:span.to]]
