"""Gemma 2 and Gemma 3 (text): the whole family description, layout and hooks, in one file.

What differs from Llama, all of it here or in the shared blocks' config fields:
RMSNorm scales by (1 + w) (norms start at 0), also on Gemma 3's q/k norms;
embeddings are multiplied by sqrt(hidden_size) in the compute dtype; the MLP is
GeGLU (tanh-approximated GELU); each block has four norms: input_layernorm,
post_attention_layernorm on the attention's output before the residual add,
pre_feedforward_layernorm, post_feedforward_layernorm on the MLP's output; the
attention scale is query_pre_attn_scalar**-0.5; embeddings are tied; layers
alternate between sliding-window and global attention (layer_types), Gemma 3's
sliding layers with their own RoPE base (rope_local_base_freq). Gemma 2 also
soft-caps attention scores and final logits (ModelConfig.attn_logit_softcap,
final_logit_softcap); Gemma 3 keeps the final cap's key but its attention ignores
attn_logit_softcapping, as transformers' does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.models import arch as arch_lib

_LAYER_NAMES = {**arch_lib.LLAMA_LAYER_NAMES,
                "mlp_norm": "pre_feedforward_layernorm.weight",
                "attn_out_norm": "post_attention_layernorm.weight",
                "mlp_out_norm": "post_feedforward_layernorm.weight"}


def gemma_rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis scaled by (1 + scale), all in float32, then x's dtype
  (Gemma casts after the scale, Llama before it)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class Gemma2(arch_lib.Architecture):
  """Gemma 2: the layout and hooks above, soft-capped scores and logits, one RoPE base."""

  hf_class, model_type = "Gemma2ForCausalLM", "gemma2"
  hf_layer_names = _LAYER_NAMES
  hf_activation, hf_activation_key = "gelu_pytorch_tanh", "hidden_activation"
  norm_init = 0.0  # (1 + w): a fresh norm is the identity
  # transformers' default layer pattern when a config.json has no layer_types: the
  # (pattern)th, (2 pattern)th, ... layers are global.
  default_pattern = 2
  qk_norm = False

  def param_specs(self, cfg) -> arch_lib.Specs:
    specs = super().param_specs(cfg)
    L, D = cfg.num_layers, cfg.hidden_size
    specs["attn_out_norm"] = ((L, D), ("layers", "embed"))
    specs["mlp_out_norm"] = ((L, D), ("layers", "embed"))
    return specs

  def embed(self, cfg, params, tokens: jax.Array) -> jax.Array:
    # The normalizer in the compute dtype, as transformers rounds it (sqrt(3072) is 55.5
    # in bfloat16).
    x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.dtype)
    return x * jnp.asarray(np.sqrt(cfg.hidden_size), cfg.dtype)

  def norm(self, cfg, x: jax.Array, scale: jax.Array) -> jax.Array:
    return gemma_rms_norm(x, scale, cfg.rms_norm_eps)

  def activation(self, cfg, gate: jax.Array) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True)

  def attention_out(self, cfg, p, out: jax.Array) -> jax.Array:
    return self.norm(cfg, out, p["attn_out_norm"])

  def mlp_out(self, cfg, p, out: jax.Array) -> jax.Array:
    return self.norm(cfg, out, p["mlp_out_norm"])

  def _layer_types(self, d: dict) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:
      n = d.get("sliding_window_pattern", self.default_pattern)
      types = ["sliding_attention" if (i + 1) % n else "full_attention"
               for i in range(d["num_hidden_layers"])]
    return tuple(types)

  def flags_from_hf(self, d: dict) -> dict:
    if d.get("use_bidirectional_attention"):
      raise ValueError("use_bidirectional_attention=True (an encoder) is not supported")
    bias = bool(d.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=self.qk_norm,
                sliding_window=d.get("sliding_window"), layer_types=self._layer_types(d),
                query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
                attn_logit_softcap=d.get("attn_logit_softcapping"),
                final_logit_softcap=d.get("final_logit_softcapping"))

  def flags_to_hf(self, cfg) -> dict:
    arch_lib.refuse(cfg, (cfg.qkv_bias != cfg.o_bias, "qkv_bias != o_bias"),
                     (cfg.mlp_bias, "mlp_bias"), (cfg.qk_norm != self.qk_norm, "qk_norm"),
                     (cfg.rope_local_theta is not None, "rope_local_theta"))
    return dict(attention_bias=cfg.qkv_bias, sliding_window=cfg.sliding_window,
                layer_types=list(cfg.layer_types or ("full_attention",) * cfg.num_layers),
                query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
                attn_logit_softcapping=cfg.attn_logit_softcap,
                final_logit_softcapping=cfg.final_logit_softcap)


class Gemma3(Gemma2):
  """Gemma 3 (text): Gemma 2 with q/k norms, a RoPE base per layer type, no score cap."""

  hf_class, model_type = "Gemma3ForCausalLM", "gemma3_text"
  default_pattern = 6
  qk_norm = True

  def hf_class_for(self, head: str) -> str | None:
    return self.hf_class if head == "lm" else "Gemma3TextForSequenceClassification"

  def flags_from_hf(self, d: dict) -> dict:
    flags = super().flags_from_hf(d)
    flags["attn_logit_softcap"] = None  # transformers' Gemma 3 attention never applies it
    local = (d.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict):
      if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding layers' rope_type={local['rope_type']!r}: only "
                         "'default' is supported")
      flags["rope_local_theta"] = float(local["rope_theta"])
    else:  # transformers 4.x
      flags["rope_local_theta"] = float(d.get("rope_local_base_freq", 10000.0))
    return flags

  def flags_to_hf(self, cfg) -> dict:
    arch_lib.refuse(cfg, (cfg.attn_logit_softcap is not None, "attn_logit_softcap"),
                     (cfg.rope_type not in ("default", "linear"), f"rope_type={cfg.rope_type}"))
    local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    out = super().flags_to_hf(cfg.replace(rope_local_theta=None))
    full = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "linear":
      full["factor"] = cfg.rope_factor
    return dict(out, attn_logit_softcapping=None, rope_local_base_freq=local,
                rope_parameters={"full_attention": full,
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": local}})


FAMILIES = {"gemma2": Gemma2(), "gemma3": Gemma3()}
