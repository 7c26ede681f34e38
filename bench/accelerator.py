"""grpojax on an accelerator at real model shapes, with nothing downloaded.

`checkpoint DIR` writes what the experiments need to run without the Hub: a
random Qwen2.5-0.5B-shaped HF checkpoint (24 layers, vocab 151,936, tied
embeddings, q/k/v bias; N(0, 0.02) weights and a zero pad row, as HF initialises them), a
word-level tokenizer with a Qwen-style chat template (its own vocabulary is
small: the model's other ids decode to nothing), and `gsm8k.jsonl`, 400
GSM8K-format rows whose prompts are ~30 tokens, so that the experiment's
`max_prompt_length=256` left-pads them heavily, as real chat prompts are.

  python bench/accelerator.py checkpoint /tmp/qwen05 [--layers 24]
  python -m grpojax.main --config experiments/gsm8k_qwen2_5_0_5b.py \
      --config.model.path=/tmp/qwen05 --config.task.dataset=/tmp/qwen05/gsm8k.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

# Qwen2.5-0.5B's published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct).
QWEN2_5_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                    num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                    tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
SPECIALS = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
# Words joined by spaces so that the whitespace pre-tokenizer keeps the markers whole.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  names = ["Ann", "Tom", "Mia", "Raj", "Zoe", "Li"]
  items = ["apples", "pens", "books", "coins", "stamps", "shells"]
  rows = []
  for i in range(n):
    a, b = (int(x) for x in rng.integers(2, 90, 2))
    who, what = names[i % len(names)], items[(i // len(names)) % len(items)]
    rows.append({"question": f"{who} has {a} {what} and gets {b} more from a friend . "
                             f"How many {what} does {who} have now ?",
                 "answer": f"{who} has {a} + {b} = {a + b} {what} .\n#### {a + b}"})
  return rows


def write_tokenizer(path: str, texts: list[str]) -> None:
  import tokenizers as tk
  import transformers

  words = sorted({w for t in texts for w in t.split()} - set(SPECIALS))
  vocab = {w: i for i, w in enumerate((*SPECIALS, *words))}
  core = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="<unk>"))
  core.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
  core.decoder = tk.decoders.WordPiece(prefix="##")  # joins words with spaces
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                             unk_token="<unk>", eos_token="<|im_end|>")
  tok.chat_template = CHAT_TEMPLATE
  tok.save_pretrained(path)


def write_checkpoint(path: str, layers: int, seed: int = 0) -> None:
  """The random model, its tokenizer and the GSM8K-format rows, all in `path`."""
  from grpojax import models
  from grpojax.models.config import ModelConfig

  rows = gsm8k_rows(400, seed)
  texts = [r["question"] + " " + r["answer"] for r in rows]
  texts.append("Reason step by step, then put the final answer in \\boxed{}. user assistant")
  os.makedirs(path, exist_ok=True)
  write_tokenizer(path, texts)
  cfg = ModelConfig(arch="qwen2", **{**QWEN2_5_0_5B, "num_layers": layers}, pad_token_id=0,
                    eos_token_id=SPECIALS.index("<|im_end|>"))
  model = models.build_model(cfg, seed=seed)
  # As transformers initialises nn.Embedding(padding_idx=pad): the pad row is zero,
  # so padded positions carry exact zeros through every layer.
  model.embed[...] = model.embed[...].at[cfg.pad_token_id].set(0.0)
  models.save_pretrained(model, path)
  with open(os.path.join(path, "gsm8k.jsonl"), "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="mode", required=True)
  ck = sub.add_parser("checkpoint", help="write the random checkpoint, tokenizer and rows")
  ck.add_argument("path")
  ck.add_argument("--layers", type=int, default=QWEN2_5_0_5B["num_layers"])
  a = parser.parse_args()
  if a.mode == "checkpoint":
    write_checkpoint(a.path, a.layers)
    print(f"wrote {a.path}")


if __name__ == "__main__":
  main()
