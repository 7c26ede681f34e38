"""What the workloads share: the random checkpoints both frameworks load, the machine's
ceilings (matmul peak, copy bandwidth), timing, and the decode step's byte floor.

Axes: B prompts, G group, N = B·G rows, P prompt length, T completion length.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# HF config.json shapes of the timed models, random weights (nothing downloaded).
# 'small': a 27.8M-parameter Llama, what a 2-core CPU times in seconds.
SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=4096, max_position_embeddings=2048)
# Qwen2.5-0.5B's published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct).
QWEN_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 max_position_embeddings=4096, tie_word_embeddings=True)
# --quick's: the same Llama, small enough that every workload runs in seconds.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=512)

# The word-level tokenizer's own ids; every other id decodes to a word "w<id>".
SPECIALS = ("<pad>", "<s>", "<|im_start|>", "<|im_end|>")
PAD, BOS, EOS = 0, 1, 3
ROLES = ("system", "user", "assistant")  # the chat template's words
# Words joined by spaces, so that the whitespace pre-tokenizer keeps the markers whole.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                 "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                 "{% endif %}")


def shape_for(args) -> tuple[str, dict]:
  """(name, HF shape) of the model a peer workload times: tiny with --quick,
  Qwen2.5-0.5B's shapes on an accelerator, 'small' on a CPU."""
  if args.quick:
    return "tiny", TINY
  return ("qwen2.5-0.5b", QWEN_0_5B) if args.device in ("gpu", "tpu") else ("small", SMALL)


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a `python -m grpojax.main` a workload starts: the caller's flags
  (a test session's cheap compile flags: its runs compile several times faster) without
  their fake-device count, the run's own mesh, and `devices` host devices where given."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(flags)


def run_main(workdir: str, flags: list[str], *, quick: bool, timeout: int = 3600) -> dict:
  """`python -m grpojax.main --workdir W *flags` (the default experiment, its `:smoke`
  variant with quick) to the end on one host device: {"wall_s", "rows": its metrics
  rows}. Raises with the run's stderr tail if it fails."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  from grpojax.train import metrics as metrics_lib  # pylint: disable=import-outside-toplevel

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  argv = [sys.executable, "-m", "grpojax.main", "--workdir", workdir, *flags]
  if quick:
    argv[3:3] = ["--config", os.path.join(root, "grpojax", "default_experiment.py") + ":smoke"]
  env = dict(os.environ, XLA_FLAGS=xla_flags())  # one device, the caller's flags
  env.update(JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
             PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
  start = time.perf_counter()
  done = subprocess.run(argv, cwd=root, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True, timeout=timeout, check=False)
  if done.returncode:
    raise RuntimeError(f"grpojax.main exited {done.returncode}:\n{done.stderr[-3000:]}")
  return {"wall_s": time.perf_counter() - start, "rows": metrics_lib.read_metrics(workdir)}


def write_tokenizer(path: str, vocab_size: int, words=()) -> None:
  """A word-level tokenizer with a chat template: SPECIALS, ROLES, `words`, then "w<id>"
  up to min(vocab_size, 4096) ids; each word is one token, so a prompt of k words is k
  tokens. Its own directory: transformers loads any tokenizer in a qwen2 model's
  directory as Qwen2Tokenizer (BPE), whatever tokenizer_config.json says."""
  import tokenizers as tk
  import transformers

  names = list(dict.fromkeys([*SPECIALS, *ROLES, *words]))
  names += [f"w{i}" for i in range(len(names), min(vocab_size, 4096))]
  if len(names) > vocab_size:
    raise ValueError(f"{len(names)} words do not fit a vocabulary of {vocab_size}")
  core = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<pad>"))
  core.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
  core.decoder = tk.decoders.WordPiece(prefix="##")  # joins words with spaces
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                             bos_token="<s>", eos_token="<|im_end|>")
  tok.chat_template = CHAT_TEMPLATE
  tok.save_pretrained(path)


def write_checkpoint(path: str, shape: dict, *, words=(), seed: int = 0,
                     tokenizer: str | None = None) -> str:
  """A random HF checkpoint of `shape` (Qwen2 where it ties its embeddings, else Llama),
  initialised as transformers does, in `path`; its tokenizer (`write_tokenizer`) in
  `tokenizer`, by default path/tokenizer. Returns the tokenizer's directory."""
  import torch
  import transformers

  torch.manual_seed(seed)
  config = (transformers.Qwen2Config if shape.get("tie_word_embeddings")
            else transformers.LlamaConfig)(**shape, pad_token_id=PAD, bos_token_id=BOS,
                                           eos_token_id=EOS)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
  tokenizer = tokenizer or os.path.join(path, "tokenizer")
  write_tokenizer(tokenizer, shape["vocab_size"], words)
  return tokenizer


def with_stop_logit(cfg, weights: dict, logit: float = -40.0) -> dict:
  """The weights with token V - 1's logit held near `logit` whatever the context, the
  others within a few units of 0: every input embedding gets +100 in dimension 0,
  which dominates the residual stream through the norms (the final hidden state is
  about sqrt(D) there), and V - 1's output row reads logit/sqrt(D) of it. At -40 no
  row samples V - 1, a stop id only a `stop_at` hook emits; higher, rows end on it
  at a steady rate (ragged lengths without a hook). Costs and shapes are unchanged."""
  V, D = cfg.vocab_size, cfg.hidden_size
  out = dict(weights, embed=weights["embed"].at[:, 0].add(100.0))
  name = "embed" if cfg.tie_embeddings else "lm_head"
  row = jnp.zeros((D,), out[name].dtype).at[0].set(logit / math.sqrt(D))
  out[name] = out[name].at[V - 1].set(row)
  return out


def model_config(name: str, dtype: str | None = None):
  """The ModelConfig of `name`: the 'small' Llama or a grpojax.models preset (its
  published shapes), in `dtype` (weights and compute) if given."""
  from grpojax import models
  from grpojax.models import hf

  cfg = (hf.config_from_hf(dict(SMALL, architectures=["LlamaForCausalLM"])) if name == "small"
         else models.get_preset(name))
  return cfg.replace(dtype=dtype, param_dtype=dtype) if dtype else cfg


def random_model(name: str, seed: int = 0, dtype: str | None = None, kernels: str | None = None,
                 stop_logit: float = -40.0):
  """(ModelConfig resolved for this machine, weights) of `model_config(name, dtype)`,
  randomly initialised as HF does, on `kernels` if given, with V - 1's logit held at
  `stop_logit` (`with_stop_logit`)."""
  from grpojax import models, ops

  model = models.build_model(model_config(name, dtype), seed=seed)
  cfg = ops.resolve(model.config.replace(kernels=kernels) if kernels else model.config)
  return cfg, with_stop_logit(cfg, model.param_dict(), stop_logit)


def param_count(params: dict) -> int:
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


def best_seconds(fn, reps: int) -> float:
  """Best wall time of `reps` calls of fn() (each returns what to block on), after one
  call that compiles and warms up."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


def median_seconds(fn, reps: int) -> float:
  """Median wall time of `reps` calls of fn(), none of them the first."""
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def matmul_peak(dtype, n: int = 2048, reps: int = 5) -> float:
  """FLOP/s of a large jitted square matmul in `dtype`: the machine's practical peak."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  return 2 * n**3 / best_seconds(lambda: f(a), reps)


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
  """Bytes a second the device moves through its memory: a jitted copy of a float32
  array of `nbytes`, counted as its read and its write."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(lambda x: x + 1)
  return 2 * x.nbytes / best_seconds(lambda: copy(x), reps)


def ceilings(quick: bool, dtype) -> tuple[float, float]:
  """(`dtype` matmul FLOP/s, copy bytes/s): small problems with --quick, an 8192^3
  matmul and a 1 GiB copy on an accelerator, 2048^3 and 64 MiB on a CPU."""
  if quick:
    return matmul_peak(dtype, 256), copy_bandwidth(1 << 22)
  if jax.default_backend() == "cpu":
    return matmul_peak(dtype, 2048), copy_bandwidth(1 << 26)
  return matmul_peak(dtype, 8192), copy_bandwidth(1 << 30)


def decode_floor_bytes(n_params: int, cfg, B: int, G: int, P: int, T: int, itemsize: int) -> float:
  """The bytes an average decode step of a full-length run must move, B prompts x G rows:
  every weight once, each group's prompt cache once (shared by its G rows) and each
  row's completion cache at the mean length T / 2; all `itemsize` bytes an element."""
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize  # one position, K + V
  return n_params * itemsize + kv * (B * P + B * G * T / 2)


def layer_names(cfg, params: dict) -> list[str]:
  """The parameters stacked over layers: the model's (param_specs' "layers" axis)
  and LoRA adapters where params has them."""
  from grpojax import models
  from grpojax.models import lora

  stacked = [n for n, (_, axes) in models.param_specs(cfg).items() if axes[0] == "layers"]
  return stacked + lora.adapter_names(params)


def unmerged_decode_weights(cfg, params: dict) -> dict:
  """The weights `decode_step` takes with LoRA's adapters applied at every matmul,
  against `decode_params`, which merges them into the weights once per generate:
  one dict of each layer's slices, the unembedding apart."""
  from grpojax.models import transformer

  names = layer_names(cfg, params)
  layers = tuple({n: jax.tree.map(lambda x, i=i: x[i], params[n]) for n in names}
                 for i in range(cfg.num_layers))
  rest = {k: v for k, v in params.items() if k not in names}
  return dict(rest, layers=layers, unembedding=transformer.unembedding(cfg, params).T)


def peer_device(platform: str) -> tuple[str | None, str]:
  """(torch device, compute dtype) of a torch peer beside JAX on `platform`: "cuda" in
  bf16 on a GPU (torch must see it too), None in bf16 on a TPU (no peer there), "cpu"
  in float32 on a CPU."""
  if platform == "tpu":
    return None, "bfloat16"
  if platform != "gpu":
    return "cpu", "float32"
  import torch

  if not torch.cuda.is_available():
    raise SystemExit("jax runs on a GPU but torch sees none: the peers must share one "
                     "device. Install a CUDA build of torch, or run both on the CPU "
                     "(JAX_PLATFORMS=cpu, --device cpu).")
  return "cuda", "bfloat16"


def share_gpu_with_torch() -> None:
  """JAX takes memory as it needs it instead of 75% up front, so that a torch peer
  in the same process has room; read when JAX starts its GPU client."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
