"""Held-out greedy accuracy of a finished arithmetic run, by problem size.

Loads the run's exported policy (WORKDIR/hf) and the held-out rows the run
evaluated on (its config.json: task.dataset, eval split, seed, eval.num_prompts),
decodes greedily as the run's eval does, and prints accuracy per size, where a
problem's size is its operands' digit counts (e.g. "2+1" for 37+5=).

  python bench/arithmetic_by_size.py --workdir workdir [--all]   # --all: the whole test split
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re

import jax
import numpy as np

from grpojax import models
from grpojax.data import get_task, load_rows
from grpojax.models.tokenizers import left_pad, load_tokenizer
from grpojax.sampling import sampler


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="workdir")
  ap.add_argument("--all", action="store_true", help="the whole held-out split, not eval.num_prompts")
  args = ap.parse_args()
  with open(os.path.join(args.workdir, "config.json")) as f:
    cfg = json.load(f)
  task = get_task(cfg["task"]["name"])
  split = cfg["task"].get("eval_split") or task.splits[1]
  rows = load_rows(task, cfg["task"]["dataset"], split, seed=cfg["train"]["seed"])
  if not args.all:
    rows = rows[:cfg["eval"]["num_prompts"]]
  hf = os.path.join(args.workdir, "hf")
  model = models.from_pretrained(hf, dtype="float32")
  tok = load_tokenizer(hf)
  encoded = [tok.encode(task.prompt(r)) for r in rows]
  tokens, mask = left_pad(encoded, tok.pad_id, max_length=max(map(len, encoded)))
  out = sampler.generate(model, tokens, mask.astype(np.int32), rng=jax.random.key(0),
                         num_samples=1, max_new_tokens=cfg["rollout"]["max_completion_length"],
                         temperature=0.0, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
  texts = tok.batch_decode(np.asarray(out.tokens), np.asarray(out.mask) > 0)
  by = collections.defaultdict(list)
  for row, text in zip(rows, texts):
    size = "+".join(str(len(x)) for x in re.findall(r"\d+", row["question"]))
    by[size].append(task.is_correct(text, row))
  print(f"{args.workdir}: {len(rows)} held-out problems ({split}), greedy")
  print(f"{'size':>6}  {'n':>4}  accuracy")
  for size in sorted(by, key=lambda s: (len(s), s)):
    print(f"{size:>6}  {len(by[size]):>4}  {np.mean(by[size]):.3f}")
  total = [c for v in by.values() for c in v]
  print(f"{'all':>6}  {len(total):>4}  {np.mean(total):.3f}")


if __name__ == "__main__":
  main()
