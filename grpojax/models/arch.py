"""What differs between decoder families, in one place: subclass `Architecture` to add one.

The decoder (transformer.py) calls these hooks on every path: the training
forward, the shared-prompt forward, prefill and the decode step, so a variant
registered here (`config.register_architecture`) decodes through the
unchanged sampler. Llama, Qwen2/2.5, Qwen3 and Mistral use this base class
as is; their other differences are ModelConfig flags (biases, q/k norm, tied
embeddings, RoPE scaling).
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
  """The family-specific pieces of the decoder, as pure functions of (cfg, params, ...)."""

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

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"


DEFAULT = Architecture()
