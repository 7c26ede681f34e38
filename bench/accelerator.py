"""grpojax on an accelerator at real model shapes, with nothing downloaded.

`checkpoint DIR` writes what the experiments need to run without the Hub: a
random Qwen2.5-0.5B-shaped HF checkpoint (24 layers, vocab 151,936, tied
embeddings, q/k/v bias; N(0, 0.02) weights and a zero pad row, as HF initialises them), a
word-level tokenizer with a Qwen-style chat template in DIR/tokenizer (its own
vocabulary is small: the model's other ids decode to nothing), and `gsm8k.jsonl`, 400
GSM8K-format rows whose prompts are ~30 tokens, so that the experiment's
`max_prompt_length=256` left-pads them heavily, as real chat prompts are.

  python bench/accelerator.py checkpoint /tmp/qwen05 [--layers 24]
  python -m grpojax.main --config experiments/gsm8k_qwen2_5_0_5b.py \
      --config.model.path=/tmp/qwen05 --config.model.tokenizer=/tmp/qwen05/tokenizer \
      --config.task.dataset=/tmp/qwen05/gsm8k.jsonl ...

`roofline` measures what issue 20 asks of the hardware, on random weights of
those shapes built in memory (bf16 compute, float32 master weights):
  - the ceilings, measured in the same run: bf16 matmul FLOP/s (8192^3) and
    device copy bandwidth (a 1 GiB copy: bytes read + written per second);
  - `generate` at each --rows (= prompts x G), forced to full length: tokens/s
    and % of the HBM roofline, the bytes a decode step must move (the bf16
    weights, plus each group's prompt cache once and each row's completion
    cache, at the mean completion length) over the measured copy bandwidth;
  - the update (`train.step.update`, dapo, beta 0.04, one minibatch) on a
    synthetic rollout of --prompts x G rows: seconds and MFU counted as
    6 x params x trained positions (B*P prompt + N*T completion positions: the
    shared-prompt forward runs each prompt once) over the measured bf16 peak;
    recompute under --remat is not counted as useful work.
  python bench/accelerator.py roofline --rows 128,512 --remat
  python bench/accelerator.py roofline --dry-run   # tiny model, CPU: the script's own test
"""

from __future__ import annotations

import argparse
import json
import os
import time

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
  # Its own directory: transformers 5 loads any tokenizer in a qwen2 model's
  # directory as Qwen2Tokenizer (BPE), whatever tokenizer_config.json says.
  write_tokenizer(os.path.join(path, "tokenizer"), texts)
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


def _best_seconds(fn, reps: int) -> float:
  """Best wall time of `reps` calls of fn() (each returns something to block on)."""
  import jax

  jax.block_until_ready(fn())  # compile and warm up
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


def ceilings(dry_run: bool) -> tuple[float, float]:
  """(bf16 matmul FLOP/s, device copy bytes/s), each the best of a few runs."""
  import jax
  import jax.numpy as jnp

  n, size = (256, 1 << 22) if dry_run else (8192, 1 << 30)
  a = jnp.ones((n, n), jnp.bfloat16)
  matmul = jax.jit(lambda x: x @ x)
  flops = 2 * n**3 / _best_seconds(lambda: matmul(a), 5)
  x = jnp.ones((size // 4,), jnp.float32)
  copy = jax.jit(lambda x: x + 1)  # reads and writes every byte once
  bandwidth = 2 * size / _best_seconds(lambda: copy(x), 5)
  return flops, bandwidth


def roofline(a) -> None:
  import jax
  import jax.numpy as jnp
  import optax

  from grpojax import models
  from grpojax.core import losses
  from grpojax.models.config import ModelConfig
  from grpojax.sampling import sampler
  from grpojax.train import state as state_lib
  from grpojax.train import step as step_lib

  shape = dict(QWEN2_5_0_5B)
  if a.dry_run:
    shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16)
  cfg = ModelConfig(arch="qwen2", **shape, dtype="float32" if a.dry_run else "bfloat16",
                    remat=a.remat)
  model = models.build_model(cfg, seed=0)
  n_params = sum(int(np.prod(v.shape)) for v in model.param_dict().values())
  flops_peak, bandwidth = ceilings(a.dry_run)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {n_params / 1e6:.0f}M "
        f"params; bf16 matmul {flops_peak / 1e12:.1f} TFLOP/s; copy {bandwidth / 1e9:.0f} GB/s",
        flush=True)
  rng = np.random.default_rng(0)
  P, T, G = a.prompt_len, a.new_tokens, a.groups
  weight_bytes = n_params * (4 if a.dry_run else 2)
  # Keys + values of one position in one layer, in the compute dtype.
  kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (4 if a.dry_run else 2)
  rows_table = []
  for rows in [int(r) for r in a.rows.split(",")]:
    B = max(rows // G, 1)
    prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, P)), jnp.int32)
    kw = dict(num_samples=G, max_new_tokens=T, temperature=1.0, eos_ids=cfg.vocab_size, pad_id=0)
    seconds = _best_seconds(lambda: sampler.generate(
        model, prompts, jnp.ones_like(prompts), rng=jax.random.key(1), **kw).tokens, a.reps)
    step_s = seconds / T
    # Per step: every weight once; each group's prompt cache once (shared by its G
    # rows); each row's completion cache at the mean length T / 2.
    floor = weight_bytes + kv_bytes * (B * P + B * G * T / 2)
    rows_table.append((B * G, B * G * T / seconds, step_s, floor / bandwidth / step_s))
    print(f"generate {B}x{G} rows, P={P}, T={T}: {B * G * T / seconds:,.0f} tok/s, "
          f"{step_s * 1e3:.2f} ms/step, {floor / bandwidth / step_s:.0%} of the HBM roofline "
          f"({floor / 1e9:.2f} GB/step)", flush=True)

  B = a.prompts
  N = B * G
  prompt_tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, P)), jnp.int32)
  state = state_lib.create_train_state(cfg, model.param_dict(), optax.adamw(1e-6),
                                       with_reference=False)
  rollout = step_lib.Rollout(
      prompt_tokens=jnp.repeat(prompt_tokens, G, axis=0),
      prompt_mask=jnp.ones((N, P), jnp.int32),
      tokens=jnp.asarray(rng.integers(1, cfg.vocab_size, (N, T)), jnp.int32),
      mask=jnp.ones((N, T), jnp.int32), advantages=jnp.asarray(rng.normal(size=N), jnp.float32),
      ref_logps=jnp.zeros((N, T), jnp.float32))
  update = jax.jit(lambda st: step_lib.update(
      st, rollout, jax.random.key(0), loss_config=losses.LossConfig(loss_type="dapo", beta=0.04),
      group_size=G)[0].params["final_norm"])
  seconds = _best_seconds(lambda: update(state), a.reps)
  useful = 6 * n_params * (B * P + N * T)
  print(f"update {B}x{G} rows, P={P}, T={T}, remat {a.remat}: {seconds:.3f} s, "
        f"MFU {useful / seconds / flops_peak:.0%} (6 x params x {B * P + N * T:,} positions)",
        flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="mode", required=True)
  ck = sub.add_parser("checkpoint", help="write the random checkpoint, tokenizer and rows")
  ck.add_argument("path")
  ck.add_argument("--layers", type=int, default=QWEN2_5_0_5B["num_layers"])
  rf = sub.add_parser("roofline", help="ceilings, generate vs the HBM roofline, update MFU")
  rf.add_argument("--rows", default="128,512", help="generate rows (prompts x G), comma-separated")
  rf.add_argument("--groups", type=int, default=8)
  rf.add_argument("--prompts", type=int, default=16, help="the update's prompts")
  rf.add_argument("--prompt-len", type=int, default=128)
  rf.add_argument("--new-tokens", type=int, default=256)
  rf.add_argument("--remat", action="store_true", help="per-layer remat in the update")
  rf.add_argument("--reps", type=int, default=3)
  rf.add_argument("--dry-run", action="store_true", help="a tiny float32 model (CPU)")
  a = parser.parse_args()
  if a.mode == "checkpoint":
    write_checkpoint(a.path, a.layers)
    print(f"wrote {a.path}")
  elif a.mode == "roofline":
    if a.dry_run:
      a.rows, a.prompts, a.prompt_len, a.new_tokens, a.reps = "16", 2, 16, 8, 1
    roofline(a)


if __name__ == "__main__":
  main()
