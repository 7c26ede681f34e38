"""What differs between decoder families, in one place: subclass `Architecture` to add one.

The decoder (transformer.py) calls these hooks on every path: the training
forward, the shared-prompt forward, prefill and the decode step, so a variant
registered here (`config.register_architecture`) decodes through the
unchanged sampler. Its Hugging Face identity lives here too: `hf_class` and
`model_type` name it in a config.json, and `flags_from_hf` / `flags_to_hf`
translate the ModelConfig flags (biases, q/k norm, sliding window) that the
family's config.json holds, so models/hf.py reads and writes any registered
family, a user's included. The family also owns its parameter layout:
`param_specs` (names, shapes, logical axes), the Hugging Face tensor names
(`hf_global_names`, `hf_layer_names`), the LoRA targets and their PEFT module
names, and any sharding rules its logical axes need; transformer.py, hf.py,
lora.py and sharding.py read them through `cfg.architecture`, so a new family
is one file (models/gemma.py). Llama, Qwen2/2.5, Qwen3 and Mistral share the
base class's layout and hooks; they differ in those flags (and tied
embeddings, RoPE scaling, which every family's config.json holds alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis; the statistics in float32 whatever x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


# Our parameter name -> the Hugging Face tensor name: outside the layers, and per layer
# (under "model.layers.{i}."). Llama's, which Qwen2/3 and Mistral share.
LLAMA_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                      "lm_head": "lm_head.weight", "score": "score.weight"}
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "b_gate": "mlp.gate_proj.bias", "b_up": "mlp.up_proj.bias", "b_down": "mlp.down_proj.bias",
}
# LoRA: short names (TRL/PEFT users write q_proj, ...: both are accepted) -> our weights,
# and each target's PEFT module name.
LLAMA_LORA_TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate",
                      "up": "w_up", "down": "w_down"}
LLAMA_LORA_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
                      "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
                      "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}

Specs = dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]


def fused_heads(shape: tuple[int, ...], axes: tuple) -> tuple[tuple[int, ...], tuple]:
  """(shape, axes) with each (heads or kv_heads, head_dim) pair merged into one dim named
  by the heads axis: our [N, H, D] <-> HF's [N*H, D], the same bytes."""
  shape, axes = list(shape), list(axes)
  for i in range(len(axes) - 1, 0, -1):
    if axes[i] == "head_dim" and axes[i - 1] in ("heads", "kv_heads"):
      shape[i - 1:i + 1] = [shape[i - 1] * shape[i]]
      axes[i - 1:i + 1] = [axes[i - 1]]
  return tuple(shape), tuple(axes)


class Architecture:
  """The family-specific pieces of the decoder, as pure functions of (cfg, params, ...).

  hf_class: the transformers class a config.json's "architectures" names (None: the
  family has no HF format, and export says so); model_type: its "model_type".
  `hf_class_for(head)` names the class with another output head.
  The layout: `param_specs`, hf_global_names / hf_layer_names, lora_targets /
  lora_modules, sharding_rules (logical axis -> mesh axes, added to
  sharding.DEFAULT_RULES), norm_init (the value norms start at).
  """

  hf_class: str | None = None
  model_type: str | None = None
  hf_global_names: dict[str, str] = LLAMA_GLOBAL_NAMES
  hf_layer_names: dict[str, str] = LLAMA_LAYER_NAMES
  lora_targets: dict[str, str] = LLAMA_LORA_TARGETS
  lora_modules: dict[str, str] = LLAMA_LORA_MODULES
  sharding_rules: dict = {}
  norm_init: float = 1.0
  # The MLP activation as config.json names it, and the key it is under.
  hf_activation, hf_activation_key = "silu", "hidden_act"

  def param_specs(self, cfg) -> Specs:
    """{name: (shape, logical axes)} of every parameter: Llama's layout, with the
    biases, q/k norms and heads cfg asks for. Weights keep Hugging Face's [out, in]
    order with heads split out (wq [L, N, H, D]); layer parameters lead with "layers"."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = {
        "embed": ((V, D), ("vocab", "embed")),
        "final_norm": ((D,), ("embed",)),
        "attn_norm": ((L, D), ("layers", "embed")),
        "wq": ((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
        "wk": ((L, K, H, D), ("layers", "kv_heads", "head_dim", "embed")),
        "wv": ((L, K, H, D), ("layers", "kv_heads", "head_dim", "embed")),
        "wo": ((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
        "mlp_norm": ((L, D), ("layers", "embed")),
        "w_gate": ((L, F, D), ("layers", "mlp", "embed")),
        "w_up": ((L, F, D), ("layers", "mlp", "embed")),
        "w_down": ((L, D, F), ("layers", "embed", "mlp")),
    }
    if cfg.head == "score":  # HF's score.weight: no bias, and no lm_head beside it
      specs["score"] = ((cfg.num_labels, D), ("labels", "embed"))
    elif not cfg.tie_embeddings:
      specs["lm_head"] = ((V, D), ("vocab", "embed"))
    if cfg.qkv_bias:
      specs["bq"] = ((L, N, H), ("layers", "heads", "head_dim"))
      specs["bk"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
      specs["bv"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
    if cfg.o_bias:
      specs["bo"] = ((L, D), ("layers", "embed"))
    if cfg.mlp_bias:
      specs["b_gate"] = ((L, F), ("layers", "mlp"))
      specs["b_up"] = ((L, F), ("layers", "mlp"))
      specs["b_down"] = ((L, D), ("layers", "embed"))
    if cfg.qk_norm:
      specs["q_norm"] = ((L, H), ("layers", "head_dim"))
      specs["k_norm"] = ((L, H), ("layers", "head_dim"))
    return specs

  def hf_class_for(self, head: str) -> str | None:
    """The transformers class of this family with `head` (ModelConfig.head): hf_class for
    "lm", its *ForSequenceClassification twin for "score" (reward models, critics)."""
    if not self.hf_class or head == "lm":
      return self.hf_class
    return self.hf_class.removesuffix("ForCausalLM") + "ForSequenceClassification"

  def embed(self, cfg, params, tokens: jax.Array) -> jax.Array:
    """Input embeddings [B, T, D] in the compute dtype for tokens [B, T]."""
    return jnp.take(params["embed"], tokens, axis=0).astype(cfg.dtype)

  def norm(self, cfg, x: jax.Array, scale: jax.Array) -> jax.Array:
    """Every normalisation of the block (attention, MLP, final, and q/k when cfg.qk_norm)."""
    return rms_norm(x, scale, cfg.rms_norm_eps)

  def activation(self, cfg, gate: jax.Array) -> jax.Array:
    """The gated MLP's activation: out = w_down(activation(w_gate x) * w_up x)."""
    return jax.nn.silu(gate)

  def attention_out(self, cfg, p, out: jax.Array) -> jax.Array:
    """The attention branch's output [B, T, D] (after o_proj and its bias) as the residual
    adds it; Llama adds it as it is."""
    return out

  def mlp_out(self, cfg, p, out: jax.Array) -> jax.Array:
    """The MLP branch's output [B, T, D] as the residual adds it."""
    return out

  def unembedding(self, cfg, params) -> jax.Array:
    """The output matrix [V, D] as stored: logits = hidden @ unembedding(...).T."""
    return params["embed"] if cfg.tie_embeddings else params["lm_head"]

  def flags_from_hf(self, d: dict) -> dict:
    """The ModelConfig flags a config.json dict `d` of this family sets: Llama's keys
    (attention_bias for the q/k/v and output projections, mlp_bias), no q/k norm,
    no sliding window."""
    bias = bool(d.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=False, sliding_window=None)

  def flags_to_hf(self, cfg) -> dict:
    """The config.json keys that hold cfg's flags; ValueError naming any flag the
    family's config cannot express (what flags_from_hf would not read back)."""
    refuse(cfg, (cfg.qkv_bias != cfg.o_bias, "qkv_bias != o_bias"), (cfg.qk_norm, "qk_norm"),
            (cfg.sliding_window is not None, "sliding_window"))
    return dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"


def refuse(cfg, *checks: tuple[bool, str]) -> None:
  """ValueError naming each (violated, what) check that is violated: what a family's
  config.json cannot express (its flags_to_hf's refusals)."""
  bad = [what for violated, what in checks if violated]
  if bad:
    raise ValueError(f"arch={cfg.arch!r} cannot express {', '.join(bad)} in a HF config; "
                     "pick the arch whose flags match")


class Llama(Architecture):
  hf_class, model_type = "LlamaForCausalLM", "llama"


class Qwen2(Architecture):
  """Biased q/k/v projections, no other bias; an optional sliding window."""

  hf_class, model_type = "Qwen2ForCausalLM", "qwen2"

  def flags_from_hf(self, d: dict) -> dict:
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False, **_window(d))

  def flags_to_hf(self, cfg) -> dict:
    refuse(cfg, (not cfg.qkv_bias, "qkv_bias=False"), (cfg.o_bias, "o_bias"),
            (cfg.mlp_bias, "mlp_bias"), (cfg.qk_norm, "qk_norm"))
    return dict(use_sliding_window=cfg.sliding_window is not None,
                sliding_window=cfg.sliding_window, **_layer_types_to_hf(cfg))


class Qwen3(Architecture):
  """RMS-normed queries and keys; Llama's attention_bias; an optional sliding window."""

  hf_class, model_type = "Qwen3ForCausalLM", "qwen3"

  def flags_from_hf(self, d: dict) -> dict:
    bias = bool(d.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True, **_window(d))

  def flags_to_hf(self, cfg) -> dict:
    refuse(cfg, (not cfg.qk_norm, "qk_norm=False"),
            (cfg.qkv_bias != cfg.o_bias, "qkv_bias != o_bias"), (cfg.mlp_bias, "mlp_bias"))
    return dict(attention_bias=cfg.qkv_bias, use_sliding_window=cfg.sliding_window is not None,
                sliding_window=cfg.sliding_window, **_layer_types_to_hf(cfg))


class Mistral(Architecture):
  """No biases; a sliding window when its config.json sets one."""

  hf_class, model_type = "MistralForCausalLM", "mistral"

  def flags_from_hf(self, d: dict) -> dict:
    return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                sliding_window=d.get("sliding_window"))

  def flags_to_hf(self, cfg) -> dict:
    refuse(cfg, (cfg.qkv_bias, "qkv_bias"), (cfg.o_bias, "o_bias"), (cfg.mlp_bias, "mlp_bias"),
            (cfg.qk_norm, "qk_norm"), (cfg.layer_types is not None, "layer_types"))
    return dict(sliding_window=cfg.sliding_window)


def _window(d: dict) -> dict:
  """Qwen's sliding window (only where the config turns it on) and the layers it
  applies to: layer_types, or (transformers 4.x) the layers from max_window_layers on."""
  on = d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or [])
  if not on or d.get("sliding_window") is None:
    return dict(sliding_window=None, layer_types=None)
  types = d.get("layer_types")
  if types is None:
    first = d.get("max_window_layers", 28)
    types = ["sliding_attention" if i >= first else "full_attention"
             for i in range(d["num_hidden_layers"])]
  return dict(sliding_window=d["sliding_window"], layer_types=tuple(types))


def _layer_types_to_hf(cfg) -> dict:
  """layer_types for a config.json: ours, or every layer sliding when a window is set
  without them (the layers our forward windows)."""
  if cfg.sliding_window is None:
    return {}
  types = cfg.layer_types or ("sliding_attention",) * cfg.num_layers
  return dict(layer_types=list(types), max_window_layers=types.index("sliding_attention")
              if "sliding_attention" in types else cfg.num_layers)


# The families Hugging Face configs name, by ModelConfig.arch.
FAMILIES = {"llama": Llama(), "qwen2": Qwen2(), "qwen3": Qwen3(), "mistral": Mistral()}
