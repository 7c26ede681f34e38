"""The price of giving every reward call its own copy of the batch (issue 28).

    python bench/reward_copies.py [--rows 256] [--tokens 4096] [--reps 20]

A reward call gets fresh copies of the batch's mutable parts (base.fresh_kwargs),
so that one function's in-place edit cannot reach the next. This times that
copy at a long-completion batch: `rows` completions of `tokens` tokens (~4
chars each: 16k-char strings), as text and as TRL's conversational message
lists, their token ids (`rows` lists of `tokens` ints), a gold `answer`
column and a `tests` column (a list of 10 assert strings per row); and, on
the same batch in this process, one call of `math_accuracy_reward` (a real
verifier: extraction plus exact comparison; its answers here are plain
numbers, so math-verify's child process is never asked) and of a trivial
length reward (the worst case: a function that does next to nothing).
Prints milliseconds (median of --reps) and copy / call.
"""

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpojax.rewards import math_accuracy_reward  # noqa: E402
from grpojax.rewards.base import ROWS, BatchCopies, completion_text, fresh_kwargs  # noqa: E402


def batch(rows: int, tokens: int, conversational: bool) -> dict:
  rng = random.Random(0)
  words = ["so", "the", "sum", "is", "then", "we", "get", "x", "=", "12", "+", "7"]
  completions, answers = [], []
  for r in range(rows):
    body = " ".join(rng.choice(words) for _ in range(tokens * 4 // 3))[:tokens * 4 - 20]
    answer = str(r % 50)
    completions.append(f"{body} \\boxed{{{answer if r % 2 else r % 50 + 1}}}")
    answers.append(answer)
  kwargs = {
      "prompts": [f"Question {r}: what is {r} + {r}? " * 8 for r in range(rows)],
      "completions": completions,
      "completion_ids": [[rng.randrange(150_000) for _ in range(tokens)] for _ in range(rows)],
      "answer": answers,
      "tests": [[f"assert f({i}) == {i * r}" for i in range(10)] for r in range(rows)],
  }
  if conversational:
    kwargs["prompts"] = [[{"role": "user", "content": p}] for p in kwargs["prompts"]]
    kwargs["completions"] = [[{"role": "assistant", "content": c}] for c in completions]
  return kwargs


def length_reward(completions, **kwargs):
  return [float(len(completion_text(c))) for c in completions]


def median_ms(fn, reps: int) -> float:
  fn()  # warm
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=256)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--reps", type=int, default=20)
  args = parser.parse_args()
  print(f"{args.rows} rows x {args.tokens} tokens, median of {args.reps} (ms)")
  print(f"{'completions':<12} {'columns':<15} {'1st copy':>9} {'next copy':>10} "
        f"{'math_accuracy':>14} {'1st/math':>9} {'next/math':>10} {'length':>7} "
        f"{'1st/length':>11}")
  for conversational in (False, True):
    kwargs = batch(args.rows, args.tokens, conversational)
    math_ms = median_ms(lambda: math_accuracy_reward(**kwargs), args.reps)
    length_ms = median_ms(lambda: length_reward(**kwargs), args.reps)
    kind = "messages" if conversational else "strings"
    # Both functions take **kwargs, so each call copies every column. The first
    # call on a batch reads its layout (BatchCopies); the batch's other functions
    # only copy. Then each column alone, to see where the time goes.
    for label, keys in [("all", list(kwargs))] + [(k, [k]) for k in kwargs]:
      sub = {k: kwargs[k] for k in keys}
      first_ms = median_ms(lambda: BatchCopies(sub, rows=ROWS)(keys), args.reps)
      copies = BatchCopies(sub, rows=ROWS)
      next_ms = median_ms(lambda: copies(keys), args.reps)
      print(f"{kind:<12} {label:<15} {first_ms:9.2f} {next_ms:10.2f} {math_ms:14.1f} "
            f"{first_ms / math_ms:9.3f} {next_ms / math_ms:10.3f} {length_ms:7.3f} "
            f"{first_ms / length_ms:11.0f}")
  row = {k: v[:1] for k, v in batch(1, args.tokens, True).items()}
  print(f"a row-by-row retry copies one row afresh: {median_ms(lambda: fresh_kwargs(row), args.reps):.3f}")


if __name__ == "__main__":
  main()
