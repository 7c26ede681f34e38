"""bench/accelerator.py runs end to end on the CPU: its checkpoint loads as an HF
model directory with its tokenizer and chat template, and the dry runs of its
roofline, generate and step modes print their lines (the last two measuring both
frameworks and their ratio)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from grpojax import models
from grpojax.models.tokenizers import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "accelerator.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import accelerator  # noqa: E402

pytestmark = pytest.mark.slow  # every test runs a bench script end to end


def test_checkpoint_is_an_hf_model_directory(tmp_path):
  path = str(tmp_path / "q")
  accelerator.write_checkpoint(path, layers=1)
  model = models.from_pretrained(path, dtype="float32")
  assert model.config.vocab_size == 151936 and model.config.tie_embeddings
  embed = np.asarray(model.embed[...])
  assert not embed[model.config.pad_token_id].any() and embed[1].any()  # HF's zero pad row
  tok = load_tokenizer(os.path.join(path, "tokenizer"))
  text = tok.apply_chat_template([{"role": "user", "content": "Ann has 3 apples ."}])
  ids = tok.encode(text)
  assert tok.hf.convert_ids_to_tokens(ids) == text.split()  # every word known, none split
  assert tok.eos_ids == (accelerator.SPECIALS.index("<|im_end|>"),)
  assert sum(1 for _ in open(os.path.join(path, "gsm8k.jsonl"))) == 400


def test_roofline_dry_run():
  out = subprocess.run([sys.executable, SCRIPT, "roofline", "--dry-run"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0].startswith("device cpu") and "TFLOP/s" in lines[0]
  assert lines[1].startswith("generate 2x8 rows") and "of the HBM roofline" in lines[1]
  assert lines[2].startswith("update 2x8 rows") and "MFU" in lines[2]


def _dry_run(mode):
  out = subprocess.run([sys.executable, SCRIPT, mode, "--dry-run"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.splitlines()


def _ratio(line):
  """The ratio a line prints as '... : 1.23x'; positive."""
  ratio = float(re.search(r": ([0-9.]+)x", line).group(1))
  assert ratio > 0, line
  return ratio


def test_generate_dry_run():
  lines = _dry_run("generate")
  assert lines[0].startswith("device cpu") and "torch cpu" in lines[0]
  line = lines[-1]
  assert len(lines) == 2 and line.startswith("generate 2x8 rows, P=16, T=8: grpojax ")
  assert re.search(r"grpojax [0-9,]+ tok/s \([0-9.]+% of the HBM roofline\), "
                   r"transformers [0-9,]+ tok/s \([0-9.]+%\); ratio \(grpojax/transformers\): ", line)
  _ratio(line)


def test_step_dry_run():
  lines = _dry_run("step")
  assert lines[0].startswith("device cpu") and re.search(r"trl \d", lines[0])
  ours, theirs, ratio = lines[-3:]
  assert re.match(r"grpojax: step [0-9.]+ s \(rollout [0-9.]+ s, update [0-9.]+ s, "
                  r"update MFU \d+%\); steps \[[0-9., ]+\]$", ours)
  assert re.match(r"TRL [0-9.]+: step [0-9.]+ s \(rollout [0-9.]+ s, update [0-9.]+ s\); "
                  r"steps \[[0-9., ]+\]$", theirs)
  assert ratio.startswith("step time ratio (grpojax/TRL): ") and "rollout" in ratio
  _ratio(ratio)
