"""Shared helpers for the model tests: tiny random HF models built with transformers + torch."""

import numpy as np
import pytest

try:  # torch is a test extra; tests that need it skip without it, the rest still run
  import torch
  import transformers
except ImportError:
  torch = transformers = None

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)


def hf_config(kind: str, **overrides):
  """Tiny configs derived from the real families, each exercising its distinguishing feature."""
  cfg = _hf_config(kind)
  for key, value in overrides.items():
    setattr(cfg, key, value)
  return cfg


def _hf_config(kind: str):
  if kind == "llama":  # llama3 RoPE scaling, head_dim != hidden/heads, all biases
    return transformers.LlamaConfig(
        **COMMON, head_dim=24, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0)
  if kind == "qwen2":  # qkv bias, tied embeddings
    return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1e6)
  if kind == "qwen3":  # per-head q/k RMSNorm, head_dim != hidden/heads
    return transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
  if kind == "mistral":
    return transformers.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False)
  # Gemma: windows of 4 tokens that sequences of 12 outrun, both layer kinds, a query
  # scale off head_dim; Gemma 2 capped hard enough that the caps bind, Gemma 3 with its
  # local RoPE base and linear scaling on the global layers.
  gemma = dict(COMMON, num_hidden_layers=5, head_dim=16, query_pre_attn_scalar=24,
               sliding_window=4, tie_word_embeddings=True, pad_token_id=0)
  if kind == "gemma2":
    return transformers.Gemma2Config(**gemma, attn_logit_softcapping=4.0,
                                     final_logit_softcapping=6.0)
  if kind == "gemma3":
    return transformers.Gemma3TextConfig(
        **gemma, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                              "sliding_attention", "full_attention"],
        final_logit_softcapping=8.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
  raise ValueError(kind)


def hf_model(kind: str, seed: int = 0, *, auto: str = "AutoModelForCausalLM", **config_overrides):
  """A random HF model whose norms and biases are random too (defaults would hide bugs);
  `auto`: the transformers Auto class that builds it (AutoModelForSequenceClassification:
  the family's score-head twin)."""
  if torch is None:
    pytest.skip("needs torch and transformers (pip install -e .[test])")
  torch.manual_seed(seed)
  cfg = hf_config(kind, **config_overrides)
  model = getattr(transformers, auto).from_config(cfg, attn_implementation="eager")
  model = model.float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.3 * torch.randn_like(p))
      elif p.ndim == 2:
        # Unit-scale activations so logits are O(1..10) and a 1e-4 tolerance means something.
        p.copy_(torch.randn_like(p) / np.sqrt(p.shape[1] if "embed" not in name else 1.0))
  return model


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
  """HF logits [B, T, V] float32; with a left-padding mask, positions count real tokens only."""
  tokens_t = torch.tensor(np.asarray(tokens), dtype=torch.long)
  kwargs = {}
  if mask is not None:
    mask_t = torch.tensor(np.asarray(mask), dtype=torch.long)
    kwargs = dict(attention_mask=mask_t, position_ids=(mask_t.cumsum(-1) - 1).clamp(min=0))
  with torch.no_grad():
    return model(tokens_t, **kwargs).logits.float().numpy()


def left_padded(rng: np.random.Generator, lengths, width: int, vocab: int, pad_id: int = 0):
  """Random tokens [B, width] left-padded to `width`, and the mask [B, width]."""
  tokens = np.full((len(lengths), width), pad_id, np.int32)
  mask = np.zeros((len(lengths), width), bool)
  for b, n in enumerate(lengths):
    tokens[b, width - n:] = rng.integers(1, vocab, n)
    mask[b, width - n:] = True
  return tokens, mask
