"""bench/accelerator.py runs end to end on the CPU: its checkpoint loads as an HF
model directory with its tokenizer and chat template, and the roofline mode's
dry run prints its three lines."""

import os
import subprocess
import sys

import numpy as np

from grpojax import models
from grpojax.models.tokenizers import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "accelerator.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import accelerator  # noqa: E402


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
