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

`generate` and `step` measure grpojax against its peers in the same run, on a
checkpoint as `checkpoint` writes it (in a temporary directory), which both
frameworks load: on CUDA in bf16 when jax and torch both see a GPU, else on the
CPU in float32. jax allocates GPU memory as it needs it (not 75% up front), so
that torch has room beside it.
  - `generate`: grpojax `sampler.generate` vs transformers' `generate` at each
    --rows (= prompts x G), forced to full length (no EOS), temperature 1,
    alternating runs, the best of --reps each (bench/sampler.py's runners): tokens/s
    of each, the ratio, and each one's % of the HBM roofline as `roofline`
    computes it (the same floor for both: what the task must move);
  - `step`: one GRPO step (rollout + update) of grpojax vs TRL's GRPOTrainer
    (transformers' generate), bench/step.py's runners with alternating steps:
    --prompts x G rows, dapo, beta 0.04, AdamW lr 1e-6; TRL with `bf16` (autocast
    over float32 weights) on CUDA, grpojax in bf16 over float32 master weights
    with a bf16 reference (its default); --remat (on by default) is our per-layer
    remat and TRL's gradient checkpointing. Median step time of each after one
    warm-up step, the ratio, and our update's MFU counted as in `roofline`.
Their defaults are the issue's shapes: G=8, P=128, T=256; 16x8 and 64x8 rows
for `generate`, 16 prompts for `step`.
  python bench/accelerator.py generate --rows 128,512
  python bench/accelerator.py step --steps 4
  python bench/accelerator.py generate --dry-run   # tiny model, CPU: tests
  python bench/accelerator.py step --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

# Qwen2.5-0.5B's published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct).
QWEN2_5_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                    num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                    tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
# The dry runs' model: the same architecture, small enough for CPU tests.
TINY = dict(QWEN2_5_0_5B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16)
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


def write_checkpoint(path: str, layers: int, seed: int = 0, *, shape: dict = QWEN2_5_0_5B) -> None:
  """The random model (`shape` with `layers` layers), its tokenizer and the GSM8K-format
  rows, all in `path`."""
  from grpojax import models
  from grpojax.models.config import ModelConfig

  rows = gsm8k_rows(400, seed)
  texts = [r["question"] + " " + r["answer"] for r in rows]
  texts.append("Reason step by step, then put the final answer in \\boxed{}. user assistant")
  os.makedirs(path, exist_ok=True)
  # Its own directory: transformers 5 loads any tokenizer in a qwen2 model's
  # directory as Qwen2Tokenizer (BPE), whatever tokenizer_config.json says.
  write_tokenizer(os.path.join(path, "tokenizer"), texts)
  cfg = ModelConfig(arch="qwen2", **{**shape, "num_layers": layers}, pad_token_id=0,
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


def ceilings(dry_run: bool, dtype: str = "bfloat16") -> tuple[float, float]:
  """(`dtype` matmul FLOP/s, device copy bytes/s), each the best of a few runs."""
  import jax
  import jax.numpy as jnp

  n, size = (256, 1 << 22) if dry_run else (8192, 1 << 30)
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x: x @ x)
  flops = 2 * n**3 / _best_seconds(lambda: matmul(a), 5)
  x = jnp.ones((size // 4,), jnp.float32)
  copy = jax.jit(lambda x: x + 1)  # reads and writes every byte once
  bandwidth = 2 * size / _best_seconds(lambda: copy(x), 5)
  return flops, bandwidth


def decode_step_bytes(n_params: int, cfg, B: int, G: int, P: int, T: int, itemsize: int) -> float:
  """The bytes one decode step of `generate` must move at least, B prompts x G rows.

  Every weight once; each group's prompt cache once (shared by its G rows); each
  row's completion cache at the mean length T / 2; weights and cache `itemsize` bytes.
  """
  # Keys + values of one position in every layer.
  kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
  return n_params * itemsize + kv_bytes * (B * P + B * G * T / 2)


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

  shape = TINY if a.dry_run else QWEN2_5_0_5B
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
  itemsize = 4 if a.dry_run else 2
  for rows in [int(r) for r in a.rows.split(",")]:
    B = max(rows // G, 1)
    prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, P)), jnp.int32)
    kw = dict(num_samples=G, max_new_tokens=T, temperature=1.0, eos_ids=cfg.vocab_size, pad_id=0)
    seconds = _best_seconds(lambda: sampler.generate(
        model, prompts, jnp.ones_like(prompts), rng=jax.random.key(1), **kw).tokens, a.reps)
    step_s = seconds / T
    floor = decode_step_bytes(n_params, cfg, B, G, P, T, itemsize)
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


def _peer_device() -> tuple[str, str]:
  """(torch device, compute dtype): "cuda" and bf16 when jax and torch both see a GPU,
  else "cpu" and float32."""
  import jax
  import torch

  platform, cuda = jax.devices()[0].platform, torch.cuda.is_available()
  if (platform == "gpu") != cuda:
    raise SystemExit(f"jax runs on {platform} but torch {'sees' if cuda else 'does not see'} a "
                     "CUDA device: the peers must share one device. Install jax[cuda12] and a "
                     "CUDA build of torch, or run both on the CPU (JAX_PLATFORMS=cpu "
                     "CUDA_VISIBLE_DEVICES=).")
  return ("cuda", "bfloat16") if cuda else ("cpu", "float32")


def _peer_header(device: str, dtype: str, n_params: int, flops_peak: float, bandwidth: float,
                 extra: str) -> str:
  """A peer mode's first line: the devices, versions (and `extra`), model and ceilings."""
  import jax
  import torch

  return (f"device {jax.devices()[0].device_kind} (jax {jax.__version__}), torch {device} "
          f"(torch {torch.__version__}{extra}); {n_params / 1e6:.1f}M params in {dtype}; "
          f"{dtype} matmul {flops_peak / 1e12:.1f} TFLOP/s; copy {bandwidth / 1e9:.0f} GB/s")


def generate_vs_transformers(a) -> None:
  """grpojax `generate` vs transformers' `generate` on the same checkpoint, alternating."""
  import jax.numpy as jnp

  import sampler as bench_sampler  # bench/sampler.py: both frameworks' timed generate
  from grpojax import models

  device, dtype = _peer_device()
  shape = TINY if a.dry_run else QWEN2_5_0_5B
  P, T, G = a.prompt_len, a.new_tokens, a.groups
  with tempfile.TemporaryDirectory() as path:
    write_checkpoint(path, shape["num_layers"], shape=shape)
    model = models.from_pretrained(path, dtype=dtype)
    n_params = bench_sampler.param_count(model)
    flops_peak, bandwidth = ceilings(a.dry_run, dtype)
    print(_peer_header(device, dtype, n_params, flops_peak, bandwidth, ""), flush=True)
    rng = np.random.default_rng(0)
    for rows in [int(r) for r in a.rows.split(",")]:
      B = max(rows // G, 1)
      # Ids from 1: transformers infers its attention mask from the pad id, 0.
      prompts = jnp.asarray(rng.integers(1, shape["vocab_size"], (B, P)), jnp.int32)
      run_ours = bench_sampler.ours_fn(model, prompts, jnp.ones_like(prompts), G, T)
      run_hf = bench_sampler.hf_fn(path, prompts, G, T, a.threads, device=device, dtype=dtype)
      # Alternating, so that a slow phase of a shared machine falls on both alike.
      times = [(run_ours(), run_hf()) for _ in range(a.reps)]
      ours, theirs = min(t[0] for t in times), min(t[1] for t in times)
      del run_hf  # its model, before the next one loads
      # The same floor for both: what the task must move, however a framework does it
      # (transformers repeats each prompt's cache G times; grpojax does not).
      floor = decode_step_bytes(n_params, model.config, B, G, P, T, jnp.dtype(dtype).itemsize)
      floor_s = floor / bandwidth  # one decode step at the roofline
      tok = B * G * T
      print(f"generate {B}x{G} rows, P={P}, T={T}: grpojax {tok / ours:,.0f} tok/s "
            f"({floor_s * T / ours:.1%} of the HBM roofline), transformers {tok / theirs:,.0f} "
            f"tok/s ({floor_s * T / theirs:.1%}); ratio (grpojax/transformers): "
            f"{theirs / ours:.2f}x", flush=True)


def step_vs_trl(a) -> None:
  """One GRPO step, grpojax vs TRL's GRPOTrainer, alternating (bench/step.py's runners)."""
  import trl

  import step as bench_step  # bench/step.py: both frameworks' timed GRPO steps
  from grpojax.models import tokenizers

  device, dtype = _peer_device()
  shape = TINY if a.dry_run else QWEN2_5_0_5B
  B, G, P, T = a.prompts, a.groups, a.prompt_len, a.new_tokens
  with tempfile.TemporaryDirectory() as path:
    write_checkpoint(path, shape["num_layers"], shape=shape)
    tokenizer = os.path.join(path, "tokenizer")
    # Each prompt exactly P tokens: P words of the word-level tokenizer's vocabulary.
    words = sorted(set(tokenizers.load_tokenizer(tokenizer).hf.get_vocab()) - set(SPECIALS))
    prompts = bench_step.make_prompts(B * (a.steps + 1), P, words)
    # The reference in the compute dtype, as grpojax's default config keeps it.
    ours = bench_step.Ours(path, prompts, a, tokenizer=tokenizer, dtype=dtype, ref_dtype=dtype,
                           remat=a.remat)
    flops_peak, bandwidth = ceilings(a.dry_run, dtype)
    print(_peer_header(device, dtype, ours.params, flops_peak, bandwidth,
                       f", trl {trl.__version__}"), flush=True)
    theirs = bench_step.run_trl(path, prompts, a, ours.step, tokenizer=tokenizer,
                                cuda=device == "cuda", gradient_checkpointing=a.remat)
    ours = ours.finish()
  # As `roofline` counts it: recompute under remat is not useful work.
  useful = 6 * ours["params"] * (B * P + B * G * T)
  secs = lambda xs: [round(x, 3) for x in xs]  # noqa: E731
  print(f"grpojax: step {ours['step']:.3f} s (rollout {ours['rollout']:.3f} s, update "
        f"{ours['update']:.3f} s, update MFU {useful / ours['update'] / flops_peak:.0%}); "
        f"steps {secs(ours['steps'])}")
  print(f"TRL {theirs['version']}: step {theirs['step']:.3f} s (rollout "
        f"{theirs['rollout']:.3f} s, update {theirs['update']:.3f} s); "
        f"steps {secs(theirs['steps'])}")
  print(f"step time ratio (grpojax/TRL): {ours['step'] / theirs['step']:.2f}x; rollout "
        f"{ours['rollout'] / theirs['rollout']:.2f}x, update "
        f"{ours['update'] / theirs['update']:.2f}x", flush=True)


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
  gen = sub.add_parser("generate", help="grpojax generate vs transformers' generate")
  gen.add_argument("--rows", default="128,512", help="rows (prompts x G), comma-separated")
  gen.add_argument("--reps", type=int, default=3, help="alternating timed runs; the best counts")
  st = sub.add_parser("step", help="one GRPO step: grpojax vs TRL's GRPOTrainer")
  st.add_argument("--prompts", type=int, default=16)
  st.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
  st.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                  help="per-layer remat in our update and gradient checkpointing in TRL's")
  for peer in (gen, st):
    peer.add_argument("--groups", type=int, default=8)
    peer.add_argument("--prompt-len", type=int, default=128)
    peer.add_argument("--new-tokens", type=int, default=256)
    peer.add_argument("--threads", type=int, default=os.cpu_count(),
                      help="torch's CPU threads (default: every core, as XLA uses)")
    peer.add_argument("--dry-run", action="store_true",
                      help="a tiny model and shapes (written to a temporary directory)")
  a = parser.parse_args()
  if a.mode == "checkpoint":
    write_checkpoint(a.path, a.layers)
    print(f"wrote {a.path}")
  elif a.mode == "roofline":
    if a.dry_run:
      a.rows, a.prompts, a.prompt_len, a.new_tokens, a.reps = "16", 2, 16, 8, 1
    roofline(a)
  else:
    # Both frameworks share the device: jax takes memory as it needs it instead of
    # 75% of it up front. Read when jax starts its GPU client, after this.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.mode == "generate":
      if a.dry_run:
        a.rows, a.prompt_len, a.new_tokens, a.reps = "16", 16, 8, 2
      generate_vs_transformers(a)
    else:
      if a.dry_run:
        a.prompts, a.prompt_len, a.new_tokens, a.steps = 2, 16, 8, 2
      step_vs_trl(a)


if __name__ == "__main__":
  main()
