"""Held-out greedy accuracy of a finished arithmetic run, by problem size.

Loads the run's exported policy (WORKDIR/hf) and the held-out rows the run evaluated
on (its config.json: task.dataset, eval split, seed, eval.num_prompts), decodes
greedily as the run's eval does, and prints accuracy per size, a problem's size being
its operands' digit counts (e.g. "2+1" for 37+5=).

  python -m grpojax.main --workdir W && python bench/run.py arithmetic_by_size --workdir W

--all: the whole held-out split. --device changes nothing. --quick: a workdir of a
random 'tiny' model and the default experiment's config, written by the run.
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile

import jax
import numpy as np

from grpojax import default_experiment, models
from grpojax.data import get_task, load_rows
from grpojax.models.tokenizers import CharTokenizer, left_pad, load_tokenizer
from grpojax.sampling import sampler


def add_arguments(parser) -> None:
  parser.add_argument("--workdir", default="workdir", help="a finished run's")
  parser.add_argument("--all", action="store_true",
                      help="the whole held-out split, not eval.num_prompts")


def random_workdir(path: str) -> str:
  """A workdir as a run of the default experiment leaves it (config.json, hf/), holding
  a random 'tiny' model with the char tokenizer and 16 held-out prompts."""
  cfg = default_experiment.get_config()
  cfg.eval.num_prompts = 16
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(cfg.to_dict(), f)
  tok = CharTokenizer()
  model = models.build_model(models.get_preset(cfg.model.arch, vocab_size=tok.vocab_size))
  models.save_pretrained(model, os.path.join(path, "hf"), tokenizer=tok)
  return path


def accuracy_by_size(workdir: str, whole_split: bool) -> dict:
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    cfg = json.load(f)
  task = get_task(cfg["task"]["name"])
  split = cfg["task"].get("eval_split") or task.splits[1]
  rows = load_rows(task, cfg["task"]["dataset"], split, seed=cfg["train"]["seed"])
  if not whole_split:
    rows = rows[:cfg["eval"]["num_prompts"]]
  hf = os.path.join(workdir, "hf")
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
    by[size].append(float(task.is_correct(text, row)))
  print(f"{workdir}: {len(rows)} held-out problems ({split}), greedy")
  print(f"{'size':>6}  {'n':>4}  accuracy")
  sizes = {}
  for size in sorted(by, key=lambda s: (len(s), s)):
    sizes[size] = dict(n=len(by[size]), accuracy=float(np.mean(by[size])))
    print(f"{size:>6}  {len(by[size]):>4}  {sizes[size]['accuracy']:.3f}")
  total = [c for v in by.values() for c in v]
  print(f"{'all':>6}  {len(total):>4}  {np.mean(total):.3f}")
  return dict(problems=len(total), accuracy=float(np.mean(total)), by_size=sizes)


def run(args) -> dict:
  if not args.quick:
    return accuracy_by_size(args.workdir, args.all)
  with tempfile.TemporaryDirectory() as path:
    return accuracy_by_size(random_workdir(path), args.all)
