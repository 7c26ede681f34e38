"""What differs between decoder families, in one place: subclass `Architecture` to add one.

The decoder (transformer.py) calls these hooks on every path: the training
forward, the shared-prompt forward, prefill and the decode step, so a variant
registered here (`config.register_architecture`) decodes through the
unchanged sampler. Its Hugging Face identity lives here too: `hf_class` and
`model_type` name it in a config.json, and `flags_from_hf` / `flags_to_hf`
translate the ModelConfig flags (biases, q/k norm, sliding window) that the
family's config.json holds, so models/hf.py reads and writes any registered
family, a user's included. Llama, Qwen2/2.5, Qwen3 and Mistral share the
base class's hooks; they differ in those flags (and tied embeddings, RoPE
scaling, which every family's config.json holds alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis; the statistics in float32 whatever x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


class Architecture:
  """The family-specific pieces of the decoder, as pure functions of (cfg, params, ...).

  hf_class: the transformers class a config.json's "architectures" names (None: the
  family has no HF format, and export says so); model_type: its "model_type".
  `hf_class_for(head)` names the class with another output head.
  """

  hf_class: str | None = None
  model_type: str | None = None

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
    _refuse(cfg, (cfg.qkv_bias != cfg.o_bias, "qkv_bias != o_bias"), (cfg.qk_norm, "qk_norm"),
            (cfg.sliding_window is not None, "sliding_window"))
    return dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"


def _refuse(cfg, *checks: tuple[bool, str]) -> None:
  """ValueError naming each (violated, what) check that is violated."""
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
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                sliding_window=_window(d))

  def flags_to_hf(self, cfg) -> dict:
    _refuse(cfg, (not cfg.qkv_bias, "qkv_bias=False"), (cfg.o_bias, "o_bias"),
            (cfg.mlp_bias, "mlp_bias"), (cfg.qk_norm, "qk_norm"))
    return dict(use_sliding_window=cfg.sliding_window is not None,
                sliding_window=cfg.sliding_window)


class Qwen3(Architecture):
  """RMS-normed queries and keys; Llama's attention_bias; an optional sliding window."""

  hf_class, model_type = "Qwen3ForCausalLM", "qwen3"

  def flags_from_hf(self, d: dict) -> dict:
    bias = bool(d.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                sliding_window=_window(d))

  def flags_to_hf(self, cfg) -> dict:
    _refuse(cfg, (not cfg.qk_norm, "qk_norm=False"),
            (cfg.qkv_bias != cfg.o_bias, "qkv_bias != o_bias"), (cfg.mlp_bias, "mlp_bias"))
    return dict(attention_bias=cfg.qkv_bias, use_sliding_window=cfg.sliding_window is not None,
                sliding_window=cfg.sliding_window)


class Mistral(Architecture):
  """No biases; a sliding window when its config.json sets one."""

  hf_class, model_type = "MistralForCausalLM", "mistral"

  def flags_from_hf(self, d: dict) -> dict:
    return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                sliding_window=d.get("sliding_window"))

  def flags_to_hf(self, cfg) -> dict:
    _refuse(cfg, (cfg.qkv_bias, "qkv_bias"), (cfg.o_bias, "o_bias"), (cfg.mlp_bias, "mlp_bias"),
            (cfg.qk_norm, "qk_norm"))
    return dict(sliding_window=cfg.sliding_window)


def _window(d: dict) -> int | None:
  """Qwen's sliding window: only where the config turns it on."""
  on = d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or [])
  return d.get("sliding_window") if on else None


# The families Hugging Face configs name, by ModelConfig.arch.
FAMILIES = {"llama": Llama(), "qwen2": Qwen2(), "qwen3": Qwen3(), "mistral": Mistral()}
