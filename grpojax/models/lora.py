"""LoRA adapters on the decoder's projections, a quantised frozen base (QLoRA), PEFT export.

An adapter on a projection W [out, in] adds scale * B @ A to it: A [r, in], B
[out, r], scale = alpha / r. Adapters are extra entries of the parameter dict,
stacked over layers like the weights: "<weight>_lora_a" [L, r, in] and
"<weight>_lora_b" [L, out, r] (e.g. "wq_lora_a"). The forward adds each
adapter's term at its matmul (models/transformer.py `_dense`), so the same
functions run the base with adapters off: the dict without them, which is the
KL reference of a LoRA run and costs no second copy of the weights.

B starts at zero, so a fresh adapter leaves the model exactly as it was; A
starts as PEFT's (Kaiming-uniform, bound 1 / sqrt(in)).

Why not qwix: its LoRA and quantisation intercept the dot_generals of Flax
modules by module path. The decoder here is pure functions over a dict whose
matmuls go through grpojax.ops (the native CPU kernels included), so the
adapter belongs at that boundary: a dozen lines, and no dependency.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.models import arch as arch_lib
from grpojax.ops import quant

# Short names (TRL/PEFT users write q_proj, ...: both are accepted) -> our weights: the
# base Architecture's (Llama's). Each family holds its own targets and PEFT module names
# (Architecture.lora_targets, .lora_modules), read where a config is at hand; the
# projections' own names (wq ... w_down) are every family's.
TARGETS = arch_lib.LLAMA_LORA_TARGETS
_PROJECTIONS = frozenset(TARGETS.values())
QUANTIZE = ("none", *quant.KINDS)
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """The `model.lora.*` keys.

  rank: r, 0 for no adapters (full fine-tuning). alpha: the adapter's scale is
  alpha / rank. targets: which projections get one: "all" (PEFT's "all-linear"),
  a comma-separated list of q, k, v, o, gate, up, down (or q_proj, ...), or a
  regular expression matched against those short names (e.g. "q|v"). quantize:
  how the frozen base is stored, "none" (the model dtype), "int8" or "nf4" (QLoRA).
  """

  rank: int = 0
  alpha: float = 32.0
  targets: str | Sequence[str] = "all"
  quantize: str = "none"

  def __post_init__(self):
    if self.rank < 0:
      raise ValueError(f"model.lora.rank={self.rank} must be >= 0 (0: no adapters)")
    if self.alpha <= 0:
      raise ValueError(f"model.lora.alpha={self.alpha} must be > 0")
    if self.quantize not in QUANTIZE:
      raise ValueError(f"model.lora.quantize={self.quantize!r}; valid: {', '.join(QUANTIZE)}")
    if self.quantize != "none" and not self.rank:
      raise ValueError(f"model.lora.quantize={self.quantize!r} needs adapters (model.lora.rank "
                       "> 0): a quantised base cannot be trained")
    if self.rank:
      self.weights  # noqa: B018 - raises on bad targets

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def weights(self) -> tuple[str, ...]:
    """The targeted weights' parameter names, in TARGETS order."""
    return target_weights(self.targets)


def target_weights(targets: str | Sequence[str]) -> tuple[str, ...]:
  """Parameter names ("wq", ...) for a targets spec (see LoraConfig); ValueError if none match."""
  valid = f"valid: 'all', a list of {', '.join(TARGETS)} (or q_proj, ...), or a regex over them"
  short = lambda name: name.removesuffix("_proj")  # noqa: E731
  if isinstance(targets, str):
    spec = targets.strip()
    if spec in ("all", "all-linear"):
      return tuple(TARGETS.values())
    items = [s.strip() for s in spec.split(",")]
    if all(short(s) in TARGETS for s in items):
      picked = {short(s) for s in items}
    else:
      try:
        pattern = re.compile(spec)
      except re.error as e:
        raise ValueError(f"model.lora.targets={targets!r} is not a list or a regex ({e}); "
                         f"{valid}") from None
      picked = {s for s in TARGETS if pattern.fullmatch(s) or pattern.fullmatch(s + "_proj")}
  else:
    unknown = [s for s in targets if short(s) not in TARGETS]
    if unknown:
      raise ValueError(f"model.lora.targets: unknown {unknown}; {valid}")
    picked = {short(s) for s in targets}
  if not picked:
    raise ValueError(f"model.lora.targets={targets!r} matches no projection; {valid}")
  return tuple(w for s, w in TARGETS.items() if s in picked)


def _dims(cfg, name: str) -> tuple[tuple[int, str], tuple[int, str]]:
  """((out, logical axis), (in, logical axis)) of a target weight as ops.linear multiplies
  it: its per-layer [out, in] in the family's layout, heads fused as HF stores them."""
  shape, axes = cfg.architecture.param_specs(cfg)[name]
  (o, i), (o_axis, i_axis) = arch_lib.fused_heads(shape[1:], axes[1:])
  return (o, o_axis), (i, i_axis)


def adapter_specs(cfg, lora: LoraConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
  """{name: (shape, logical axes)} of the adapters (as transformer.param_specs)."""
  out = {}
  L, r = cfg.num_layers, lora.rank
  for name in lora.weights:
    (o, o_axis), (i, i_axis) = _dims(cfg, name)
    out[name + SUFFIX_A] = ((L, r, i), ("layers", None, i_axis))
    out[name + SUFFIX_B] = ((L, o, r), ("layers", o_axis, None))
  return out


def init_adapters(cfg, lora: LoraConfig, key: jax.Array) -> dict[str, jax.Array]:
  """Fresh float32 adapters: A ~ U(-1/sqrt(in), 1/sqrt(in)) as PEFT's, B = 0 (a zero delta)."""
  out = {}
  specs = adapter_specs(cfg, lora)
  keys = jax.random.split(key, len(specs))
  for k, (name, (shape, _)) in zip(keys, sorted(specs.items())):
    if name.endswith(SUFFIX_A):
      bound = 1.0 / np.sqrt(shape[-1])
      out[name] = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
    else:
      out[name] = jnp.zeros(shape, jnp.float32)
  return out


def config_of(adapters: dict, scale: float) -> LoraConfig:
  """The LoraConfig that made `adapters` (their rank and targets), given their scale."""
  weights = {n[:-len(SUFFIX_A)] for n in adapters if n.endswith(SUFFIX_A)}
  rank = adapters[next(iter(sorted(weights))) + SUFFIX_A].shape[-2]
  short = [s for s, w in TARGETS.items() if w in weights]
  return LoraConfig(rank=rank, alpha=scale * rank, targets=short)


def is_adapter(name: str) -> bool:
  return name.endswith((SUFFIX_A, SUFFIX_B))


def adapter_names(params) -> list[str]:
  """The adapter entries of a parameter dict, sorted."""
  return sorted(n for n in params if is_adapter(n))


def without_adapters(params: dict) -> dict:
  """The base model's parameters: the dict with its adapters dropped (no copy)."""
  return {k: v for k, v in params.items() if not is_adapter(k)}


def delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """scale * x A^T B^T: x [..., in], a [r, in], b [out, r] -> [..., out] in x's dtype."""
  h = jnp.einsum("...i,ri->...r", x, a.astype(x.dtype))
  return jnp.einsum("...r,or->...o", h, b.astype(x.dtype)) * jnp.asarray(scale, x.dtype)


def merge(params: dict, scale: float) -> dict:
  """The parameters with each adapter folded into its weight (W + scale * B A, summed in
  float32, stored in W's dtype) and dropped. A quantised weight is dequantised first."""
  out = {k: quant.maybe_dequantize(v, jnp.float32) for k, v in without_adapters(params).items()}
  for name in {n[:-len(SUFFIX_A)] for n in params if n.endswith(SUFFIX_A)}:
    w = out[name]
    w32 = w.astype(jnp.float32)
    d = jnp.einsum("lor,lri->loi", params[name + SUFFIX_B].astype(jnp.float32),
                   params[name + SUFFIX_A].astype(jnp.float32))
    out[name] = (w32 + scale * d.reshape(w32.shape)).astype(w.dtype)
  return out


def frozen_base(params: dict, lora: LoraConfig, dtype, *, release: bool = False) -> dict:
  """The frozen base of a LoRA run: every parameter in `dtype`, and with quantize set, the
  seven projection kinds quantised (embeddings, norms and biases stay in `dtype`).

  release: the caller hands `params` over (the loop, which then drops its model): arrays
  already in `dtype` are kept, not copied, and each quantised weight's original is freed
  as soon as its codes exist: a bf16 base takes its own size (14 GiB at 7B), not twice
  that. Otherwise every entry is a copy (the update donates the state, which must not
  delete the caller's arrays).
  """
  out = {}
  for k in sorted(params):
    v = params[k]
    if isinstance(v, quant.QuantizedWeight):  # quantised as it was loaded (hf.load_params)
      if v.kind != lora.quantize:
        raise ValueError(f"{k} is quantised to {v.kind}, model.lora.quantize is {lora.quantize}")
      out[k] = v if release else jax.tree.map(lambda x: jnp.array(x, copy=True), v)
    elif lora.quantize != "none" and quantizable(k):
      out[k] = quantize_weight(v, lora.quantize, release=release)
    elif release and v.dtype == jnp.dtype(dtype):
      out[k] = v
    else:
      out[k] = jnp.array(v, dtype=dtype, copy=True)
  return out


def quantizable(name: str) -> bool:
  """Whether QLoRA quantises the parameter `name`: the seven projection kinds do;
  embeddings, the LM head, norms and biases stay in the compute dtype."""
  return name in _PROJECTIONS


def quantize_weight(w: jax.Array, kind: str, *, release: bool = False) -> quant.QuantizedWeight:
  """w (a stacked [L, ...] projection, or one matrix) quantised where it lies (its
  sharding's codes and scales: `quantized_shardings`), one layer at a time. release: w is
  deleted once its codes exist."""
  out = _quantize_jit(w, kind)
  if release:
    jax.block_until_ready(out)
    w.delete()
  return out


def quantize_layers(w: jax.Array, kind: str) -> quant.QuantizedWeight:
  """quant.quantize over a stacked weight [L, ...] one layer at a time (lax.map): the
  float32 temporaries are one layer's, not the whole stack's (at 7B, w_gate's float32
  copy alone is 7.6 GB)."""
  if w.ndim < 3:
    return quant.quantize(w, kind)
  return jax.lax.map(lambda layer: quant.quantize(layer, kind), w)


def quantized_shardings(sharding):
  """(codes' sharding, scales' sharding) for a quantised weight placed as `sharding`: the
  codes as the weight (two to a byte along the input axis), scales with that axis whole."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding, sharding
  spec = tuple(sharding.spec)
  return sharding, jax.sharding.NamedSharding(sharding.mesh,
                                              jax.sharding.PartitionSpec(*spec[:-1], None))


def abstract_frozen(name: str, p: jax.ShapeDtypeStruct, lora: LoraConfig, dtype):
  """The frozen base's entry for parameter p (a ShapeDtypeStruct), as frozen_base makes it."""
  if lora.quantize != "none" and quantizable(name):
    return quant.abstract(p, lora.quantize, *quantized_shardings(p.sharding))
  return jax.ShapeDtypeStruct(p.shape, jnp.dtype(dtype), sharding=p.sharding)


def quantize_program(w, kind: str):
  """The jitted program `quantize_weight` runs on w (an array or a ShapeDtypeStruct):
  `quantize_layers`, its outputs placed by `quantized_shardings` (the planner lowers it)."""
  sharding = getattr(w, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return _quantize
  return _sharded_quantize(*quantized_shardings(sharding), kind)


def _quantize_jit(w, kind):
  return quantize_program(w, kind)(w, kind)


@functools.lru_cache(maxsize=32)
def _sharded_quantize(codes, scales, kind):
  return jax.jit(quantize_layers, static_argnums=1,
                 out_shardings=quant.QuantizedWeight(codes, scales, kind))


_quantize = jax.jit(quantize_layers, static_argnums=1)


# ---------------------------------------------------------------- PEFT format


def peft_tensors(cfg, lora: LoraConfig) -> list[tuple[str, str, int, tuple[int, int]]]:
  """[(PEFT tensor name, our adapter name, layer, shape)] of an adapter_model.safetensors."""
  out = []
  for name, (shape, _) in sorted(adapter_specs(cfg, lora).items()):
    weight = name[:-len(SUFFIX_A)]
    ab = "lora_A" if name.endswith(SUFFIX_A) else "lora_B"
    for i in range(cfg.num_layers):
      module = cfg.architecture.lora_modules[weight]
      out.append((f"base_model.model.model.layers.{i}.{module}.{ab}.weight", name, i,
                  tuple(shape[1:])))
  return out


def peft_config(cfg, lora: LoraConfig, base_path: str) -> dict:
  """adapter_config.json's contents for `peft` (PeftModel.from_pretrained); cfg: the
  model's config, whose architecture names the modules (Architecture.lora_modules)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
      "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
      "target_modules": sorted(cfg.architecture.lora_modules[w].split(".")[-1]
                               for w in lora.weights),
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
  }


def save_peft(cfg, lora: LoraConfig, adapters: dict, path: str, *, base_path: str = "",
              dtype: str = "float32") -> str:
  """Writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
  peft.PeftModel.from_pretrained(hf_base_model, path) loads. Every process calls it
  (multi-host: the adapters are gathered); process 0 writes."""
  from grpojax.models import safetensors_io
  from grpojax.models.sharding import to_host

  entries = peft_tensors(cfg, lora)
  host = {name: to_host(adapters[name]) for name in {e[1] for e in entries}}
  if jax.process_index() != 0:
    return path
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
    json.dump(peft_config(cfg, lora, base_path), f, indent=2)
  lookup = {e[0]: e for e in entries}
  safetensors_io.write_file(
      os.path.join(path, "adapter_model.safetensors"),
      [(e[0], e[3], np.dtype(dtype)) for e in entries],
      lambda key: host[lookup[key][1]][lookup[key][2]].astype(dtype))
  return path


def load_peft(cfg, lora: LoraConfig, path: str) -> dict[str, jax.Array]:
  """The adapters of a PEFT directory written for this model and config (float32)."""
  from grpojax.models import safetensors_io

  infos = safetensors_io.read_header(os.path.join(path, "adapter_model.safetensors"))
  out = {}
  for name, (shape, _) in adapter_specs(cfg, lora).items():
    out[name] = np.zeros(shape, np.float32)
  for key, name, i, shape in peft_tensors(cfg, lora):
    if key not in infos:
      raise ValueError(f"{path}: adapter tensor {key} missing (rank, targets or model differ?)")
    buf = np.zeros(shape, np.float32)
    safetensors_io.read_into(infos[key], buf)
    out[name][i] = buf
  return {k: jnp.asarray(v) for k, v in out.items()}
