"""Hugging Face checkpoints in and out: config.json ↔ ModelConfig, safetensors ↔ parameters.

Loading reads each tensor from disk straight into its (stacked) host buffer and
places it on devices before reading the next parameter, so host memory peaks at
the model plus one parameter. No torch, no transformers model code.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np

from grpojax.errors import ConfigError
from grpojax.models import safetensors_io as st
from grpojax.models import sharding as sharding_lib
from grpojax.models import arch as arch_lib
from grpojax.models import config as config_lib
from grpojax.models import lora as lora_lib
from grpojax.models.config import ModelConfig
from grpojax.models.transformer import Transformer, param_shardings, param_specs



def _arch_of(hf_class: str) -> tuple[str, str] | None:
  """(arch, head): the registered arch (models.register_architecture) and the output
  head whose transformers class is `hf_class`."""
  for name in config_lib.ARCHITECTURES.names():
    for head in config_lib.HEADS:
      if config_lib.ARCHITECTURES.get(name).hf_class_for(head) == hf_class:
        return name, head
  return None


def _num_labels(d: dict) -> int:
  """A sequence classifier's outputs as transformers counts them: id2label's entries,
  else num_labels, else its default of 2."""
  return len(d["id2label"]) if d.get("id2label") else int(d.get("num_labels") or 2)


# Files copied along with the weights so the saved directory is self-contained.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
DEFAULT_MAX_SHARD_BYTES = 4 << 30


# ---------------------------------------------------------------- Hub ids


def is_hub_id(path: str) -> bool:
  """Whether model.path reads as a Hugging Face Hub repository id (owner/name)."""
  return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None and ".." not in path


def local_dir(path: str, key: str = "model.path") -> str:
  """model.path (or another `key`'s model: rewards.models) as a local directory:
  itself, or a Hub id's snapshot.

  A Hub id is looked up in the local cache first (HF_HOME / HF_HUB_CACHE); when
  it is not there it is downloaded (config, weights, tokenizer files), unless
  HF_HUB_OFFLINE=1, which turns that into one line saying so.
  """
  if not path or os.path.isdir(path) or not is_hub_id(path):
    return path
  import huggingface_hub  # pylint: disable=import-outside-toplevel
  from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

  patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
  try:
    return huggingface_hub.snapshot_download(path, allow_patterns=patterns, local_files_only=True)
  except LocalEntryNotFoundError:
    pass
  try:
    return huggingface_hub.snapshot_download(path, allow_patterns=patterns)
  except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    raise ConfigError(f"config: {key}={path!r} is not a directory and, as a Hub id, "
                      f"{'is not in the local cache (HF_HUB_OFFLINE is set)' if offline else 'could not be downloaded'}: "
                      f"{' '.join(str(e).split())[:300]}") from None


# ---------------------------------------------------------------- config.json


def config_from_hf(d: dict, **overrides) -> ModelConfig:
  """ModelConfig from a config.json dict (transformers 4.x or 5.x keys)."""
  archs = d.get("architectures") or []
  found = _arch_of(archs[0]) if len(archs) == 1 else None
  if found is None:
    known = [a.hf_class_for(h) for a in map(config_lib.ARCHITECTURES.get,
                                            config_lib.ARCHITECTURES.names())
             for h in config_lib.HEADS if a.hf_class]
    raise ValueError(f"unsupported architectures {archs} in config.json; supported: "
                     f"{', '.join(known)} (MoE and other families are not implemented; "
                     "models.register_architecture adds one, with its hf_class)")
  if d.get("num_experts") or d.get("num_local_experts"):
    raise ValueError("mixture-of-experts checkpoints are not supported")
  arch, head = found
  family = config_lib.ARCHITECTURES.get(arch)
  act = d.get(family.hf_activation_key, family.hf_activation)
  if act != family.hf_activation:
    raise ValueError(f"{family.hf_activation_key}={act!r} is not supported for arch={arch!r}; "
                     f"only {family.hf_activation!r}")
  if d.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported")

  # transformers 5 keeps theta and scaling in rope_parameters; 4.x in rope_theta/rope_scaling.
  # Per layer type (Gemma 3): the full-attention layers' here, the family reads the rest.
  params = d.get("rope_parameters") or {}
  if isinstance(params.get("full_attention"), dict):
    params = params["full_attention"]
  elif params and not isinstance(next(iter(params.values())), (int, float, str, type(None))):
    raise ValueError("per-layer-type rope_parameters are only read for Gemma 3's layer types")
  scaling = params or d.get("rope_scaling") or {}
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in ("default", "linear", "llama3"):
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: default, linear, llama3")

  heads = d["num_attention_heads"]
  eos = d.get("eos_token_id")
  fields = dict(
      arch=arch,
      head=head,
      num_labels=_num_labels(d) if head == "score" else 1,
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"],
      num_layers=d["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=d.get("num_key_value_heads") or heads,
      head_dim=d.get("head_dim") or d["hidden_size"] // heads,
      rms_norm_eps=d.get("rms_norm_eps", 1e-6),
      rope_theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
      rope_type=rope_type,
      rope_factor=float(scaling.get("factor", 1.0)),
      rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
      rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
      rope_original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
      max_position_embeddings=d.get("max_position_embeddings", 4096),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      bos_token_id=d.get("bos_token_id"),
      eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
      pad_token_id=d.get("pad_token_id"),
  )
  fields.update(family.flags_from_hf(d))
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json dict for transformers (writes both the 4.x and 5.x RoPE keys)."""
  family = cfg.architecture
  if not family.hf_class:
    raise ValueError(f"arch={cfg.arch!r} has no Hugging Face format: its Architecture sets no "
                     "hf_class (and model_type) to write in config.json")
  flags = family.flags_to_hf(cfg)  # raises for flags the family's config cannot hold
  rope = {"rope_type": cfg.rope_type}
  if cfg.rope_type != "default":
    rope["factor"] = cfg.rope_factor
  if cfg.rope_type == "llama3":
    rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_position)
  d = {
      "architectures": [family.hf_class_for(cfg.head)],
      "model_type": family.model_type or cfg.arch,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      family.hf_activation_key: family.hf_activation,
      "rms_norm_eps": cfg.rms_norm_eps,
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if cfg.rope_type == "default" else rope,
      "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                      else cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id,
      "torch_dtype": cfg.param_dtype,
      "use_cache": True,
  }
  d.update(flags)
  if cfg.head == "score":  # what transformers counts num_labels from
    d["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
    d["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
  return d


def read_config(path: str, **overrides) -> ModelConfig:
  """ModelConfig from `path`/config.json."""
  return config_from_hf(_load_json(path, "config.json"), **overrides)


def _load_json(path: str, name: str) -> dict:
  if not os.path.isdir(path):
    raise FileNotFoundError(f"model path {path!r} does not exist or is not a directory")
  file = os.path.join(path, name)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no {name} in {path!r}; expected a Hugging Face model directory")
  with open(file, encoding="utf-8") as f:
    return json.load(f)


# ---------------------------------------------------------------- names and layouts


def hf_tensors(cfg: ModelConfig) -> list[tuple[str, str, int | None, tuple[int, ...]]]:
  """[(hf name, our name, layer index or None, hf shape)] for every tensor in a checkpoint."""
  family = cfg.architecture
  out = []
  for name, (shape, axes) in param_specs(cfg).items():
    if axes[0] != "layers":
      out.append((family.hf_global_names[name], name, None, shape))
      continue
    # Ours splits heads out of HF's fused dims: [N*H, D] ↔ [N, H, D], same bytes.
    per_layer = arch_lib.fused_heads(shape[1:], axes[1:])[0]
    for i in range(cfg.num_layers):
      out.append((f"model.layers.{i}.{family.hf_layer_names[name]}", name, i, per_layer))
  return out


def _index_checkpoint(path: str) -> dict[str, st.TensorInfo]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors weights in {path!r} (only safetensors is supported)")
  tensors = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise FileNotFoundError(f"{file} is listed in the index but missing")
    tensors.update(st.read_header(file))
  return tensors


# ---------------------------------------------------------------- load and save


def from_pretrained(path: str, *, dtype: str = "bfloat16", mesh: jax.sharding.Mesh | None = None,
                    rules: dict | None = None, **config_overrides) -> Transformer:
  """Load a HF-format directory into a Transformer (params and compute in `dtype`).

  With a mesh, every parameter is placed by the logical-axis `rules`
  (default sharding.DEFAULT_RULES). config_overrides set ModelConfig fields,
  e.g. remat=True or dtype for compute when it differs from param storage.
  """
  cfg, params = load_params(path, dtype=dtype, mesh=mesh, rules=rules, **config_overrides)
  model = Transformer(cfg, params=params)
  model.source_path = os.path.abspath(path)
  return model


def load_params(path: str, *, dtype: str = "bfloat16", mesh: jax.sharding.Mesh | None = None,
                rules: dict | None = None, quantize: str = "none",
                **config_overrides) -> tuple[ModelConfig, dict]:
  """`from_pretrained`'s (config, {name: array}), without the Transformer.

  quantize: "int8" or "nf4" quantises the seven projection kinds (a QLoRA run's frozen
  base, models/lora.py) as each is placed, its `dtype` copy freed at once: the base in
  `dtype` never exists whole. The peak is the quantised base, the other parameters, and
  one stacked projection in `dtype` with one layer's quantiser temporaries: Qwen2.5-7B in
  nf4 peaks at 10.6 GiB on a v5e (`python -m grpojax.plan`'s "load"), where its bf16 base
  alone is 14.2 GiB.
  """
  if quantize not in lora_lib.QUANTIZE:
    raise ValueError(f"quantize={quantize!r}; valid: {', '.join(lora_lib.QUANTIZE)}")
  overrides = {"param_dtype": dtype, "dtype": dtype, **config_overrides}
  cfg = read_config(path, **overrides)
  tensors = _index_checkpoint(path)
  specs = param_specs(cfg)
  shardings = param_shardings(cfg, mesh, rules) if mesh is not None else {}
  by_param: dict[str, list] = {}
  for hf_name, name, layer, hf_shape in hf_tensors(cfg):
    if hf_name not in tensors:
      raise ValueError(f"tensor {hf_name!r} is missing from the checkpoint in {path!r}")
    if tensors[hf_name].shape != hf_shape:
      raise ValueError(f"tensor {hf_name!r} has shape {tensors[hf_name].shape}, "
                       f"config.json implies {hf_shape}")
    by_param.setdefault(name, []).append((layer, tensors[hf_name]))

  params = {}
  for name, parts in by_param.items():
    host = np.empty(specs[name][0], np.dtype(cfg.param_dtype))
    for layer, info in parts:
      st.read_into(info, host if layer is None else host[layer])
    params[name] = sharding_lib.put(host, shardings.get(name))
    del host  # the device copy is the only one left before the next parameter
    if quantize != "none" and lora_lib.quantizable(name):
      params[name] = lora_lib.quantize_weight(params[name], quantize, release=True)
  return cfg, params


def save_pretrained(model: Transformer, path: str, *, tokenizer=None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
  """Write config.json, safetensors (sharded above max_shard_bytes) and tokenizer files.

  The directory loads with transformers.AutoModelForCausalLM.from_pretrained and
  vLLM. Tokenizer files come from `tokenizer.save_pretrained` when given, else are
  copied from the directory the model was loaded from. Multi-host: every process
  must call this (parameters are gathered); only process 0 writes.
  """
  cfg = model.config
  hf_config = config_to_hf(cfg)
  writer = jax.process_index() == 0
  source = getattr(model, "source_path", None)
  if writer:
    os.makedirs(path, exist_ok=True)
    if source and os.path.isfile(os.path.join(source, "config.json")):
      # Keep fields we do not model (e.g. generation defaults), ours win.
      hf_config = {**_load_json(source, "config.json"), **hf_config}
      hf_config.pop("dtype", None)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
      json.dump(hf_config, f, indent=2)
    # Stale shards from an earlier save would shadow or mix with the new ones.
    for name in os.listdir(path):
      if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".index.json")):
        os.remove(os.path.join(path, name))

  dtype = np.dtype(cfg.param_dtype)
  entries = hf_tensors(cfg)
  shards: list[list] = [[]]
  size = 0
  for entry in entries:
    nbytes = int(np.prod(entry[3])) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes

  lookup = {e[0]: e for e in entries}
  current: dict[str, np.ndarray] = {}  # one parameter on host at a time

  def fetch(hf_name: str) -> np.ndarray:
    _, name, layer, _ = lookup[hf_name]
    if name not in current:
      current.clear()
      current[name] = sharding_lib.to_host(getattr(model, name)[...])
    return current[name] if layer is None else current[name][layer]

  files = ["model.safetensors"] if len(shards) == 1 else [
      f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for file, shard in zip(files, shards):
    rows = [(hf_name, shape, dtype) for hf_name, _, _, shape in shard]
    if writer:
      st.write_file(os.path.join(path, file), rows, fetch)
    else:
      for hf_name, _, _ in rows:
        fetch(hf_name)  # the gathers are collective: every process runs them
    weight_map.update({hf_name: file for hf_name, _, _ in rows})
  if not writer:
    return
  if len(shards) > 1:
    total = sum(int(np.prod(e[3])) * dtype.itemsize for e in entries)
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if hf_config.get(k) is not None}
  if source and os.path.isfile(os.path.join(source, "generation_config.json")):
    generation = {**_load_json(source, "generation_config.json"), **generation}
  if generation:  # what transformers' generate() reads: stop at our EOS, pad with our pad
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
      json.dump(generation, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(path)
  elif source and os.path.abspath(source) != os.path.abspath(path):
    for name in TOKENIZER_FILES:
      if os.path.isfile(os.path.join(source, name)):
        shutil.copyfile(os.path.join(source, name), os.path.join(path, name))

