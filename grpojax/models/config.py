"""ModelConfig: the frozen description of one decoder, and named presets (tiny runs; real shapes).

One config covers Llama, Qwen2/2.5, Qwen3 and Mistral: they differ only in the
flags below (biases, q/k norm, tied embeddings, RoPE scaling). `arch` names the
registered Architecture, which also holds the Hugging Face names `save_pretrained`
writes.
"""

from __future__ import annotations

import dataclasses

from grpojax import registry
from grpojax.ops import BACKENDS
from grpojax.models import arch as arch_lib

# ModelConfig.arch -> its Architecture (models/arch.py), the one registry the decoder and
# the HF format (models/hf.py) read; research code adds variants.
ARCHITECTURES = registry.Registry[arch_lib.Architecture]("ModelConfig.arch")
for _name, _family in arch_lib.FAMILIES.items():
  ARCHITECTURES.register(_name, _family)
KERNELS = BACKENDS  # ModelConfig.kernels: the grpojax.ops backends
# ModelConfig.remat values: False and "none" keep every activation, True and "full" only
# each layer's input, "dots" also the matmul outputs (jax.checkpoint_policies).
REMAT_POLICIES = (False, True, "none", "full", "dots")


def register_architecture(name: str, architecture: arch_lib.Architecture, *,
                          override: bool = False) -> arch_lib.Architecture:
  """Adds a decoder variant: ModelConfig(arch=name) then runs `architecture`'s hooks."""
  if not isinstance(architecture, arch_lib.Architecture):
    raise TypeError(f"{architecture!r} is not a grpojax.models.arch.Architecture")
  return ARCHITECTURES.register(name, architecture, override=override)
ROPE_TYPES = ("default", "linear", "llama3")
# ModelConfig.head: "lm" the language-model head (logits over the vocabulary), or
# "score" a linear map to num_labels per position (HF's *ForSequenceClassification:
# a reward model pools it at the last token, a critic reads it at every position).
HEADS = ("lm", "score")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture plus the runtime dtype policy. Hashable: it is static under jit."""

  arch: str = "llama"
  vocab_size: int = 128
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rms_norm_eps: float = 1e-6
  # RoPE. `linear` divides all frequencies by rope_factor; `llama3` is Llama 3.1's
  # wavelength-dependent rule, which also uses the three fields after it.
  rope_theta: float = 10000.0
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  max_position_embeddings: int = 4096
  qkv_bias: bool = False  # Qwen2
  o_bias: bool = False  # Llama's attention_bias also biases o_proj
  mlp_bias: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
  tie_embeddings: bool = False
  # Sliding-window attention is not implemented; with a window set, any sequence
  # (or cache) longer than it is refused instead of silently attending too far.
  sliding_window: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # Runtime policy: parameter storage, activation compute (logits and softmax
  # statistics are always float32), and per-layer rematerialisation for training.
  param_dtype: str = "float32"
  dtype: str = "float32"
  # Per-layer rematerialisation in training: False/"none", True/"full" (keep only each
  # layer's input), or "dots" (also keep the matmul outputs: less recompute, more memory).
  remat: bool | str = False
  # jax.nn.dot_product_attention's `implementation` for the uncached forward (training
  # and log-probs): None lets JAX choose (jax 0.10 always picks "xla"); "cudnn" asks for
  # cuDNN flash attention (GPU, bf16/fp16 only). Cached decoding always uses
  # grpojax.ops.decode_attention, which reads the cache in its own layout.
  attention_impl: str | None = None
  # The uncached forward over more keys than this attends blockwise, in key blocks of
  # this size (grpojax.ops.attention): memory linear in the sequence instead of the
  # [T, S] scores, forward and backward. 0: always materialise the scores.
  attention_block: int = 1024
  # grpojax.ops backend for dense layers, decode attention and sampling draws: "auto"
  # (native kernels on a CPU, XLA elsewhere), "xla" or "cpu". ops.resolve decides "auto".
  kernels: str = "auto"
  # LoRA adapters' alpha / rank (models/lora.py): read only where the parameters hold adapters.
  lora_scale: float = 1.0
  # The output head (HEADS): "lm", or "score" with num_labels outputs per position
  # (reward models and critics; no lm_head, and nothing to sample from).
  head: str = "lm"
  num_labels: int = 1

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"ModelConfig.arch={self.arch!r} is unknown; known: "
                       f"{', '.join(ARCHITECTURES.names())}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; valid: False, True, "
                       f"{', '.join(repr(k) for k in REMAT_POLICIES if isinstance(k, str))}")
    if self.kernels not in KERNELS:
      raise ValueError(f"ModelConfig.kernels={self.kernels!r}; valid: {', '.join(KERNELS)}")
    if self.head not in HEADS:
      raise ValueError(f"ModelConfig.head={self.head!r}; valid: {', '.join(HEADS)}")
    if self.num_labels < 1:
      raise ValueError(f"ModelConfig.num_labels must be >= 1, got {self.num_labels}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(
          f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; valid: {', '.join(DTYPES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.attention_block < 0:
      raise ValueError(f"ModelConfig.attention_block must be >= 0, got {self.attention_block}")
    if self.attention_impl not in (None, "xla", "cudnn"):
      raise ValueError(f"attention_impl={self.attention_impl!r}; valid: None, 'xla', 'cudnn'")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  @property
  def architecture(self) -> arch_lib.Architecture:
    return ARCHITECTURES.get(self.arch)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """EOS ids as a tuple (HF configs hold one id or a list)."""
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)


PRESETS: dict[str, ModelConfig] = {
    # Unit tests and the embedded default (char tokenizer vocab fits in 128).
    "tiny": ModelConfig(),
    # A few-million-parameter model for from-scratch experiments on one CPU/GPU.
    "small": ModelConfig(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=32),
    # The shapes of Qwen2.5-0.5B with few layers: exercises bias, tying, GQA 7:1.
    "qwen2_tiny": ModelConfig(arch="qwen2", vocab_size=256, hidden_size=112, intermediate_size=224,
                              num_heads=7, num_kv_heads=1, head_dim=16, qkv_bias=True,
                              tie_embeddings=True, rope_theta=1e6),
}

# The published shapes of real models (as their Hugging Face config.json), for
# planning (`python -m grpojax.plan`) and from-scratch runs at scale. Built from
# scratch they keep their own vocabulary (the character tokenizer's ids fit inside).
_QWEN2_5 = dict(arch="qwen2", vocab_size=151936, num_kv_heads=2, head_dim=128, qkv_bias=True,
                tie_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)
_LLAMA3_2 = dict(arch="llama", vocab_size=128256, num_kv_heads=8, rms_norm_eps=1e-5,
                 rope_theta=500000.0, rope_type="llama3", rope_factor=32.0,
                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_position=8192, max_position_embeddings=131072,
                 tie_embeddings=True)
PUBLISHED: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": ModelConfig(**dict(_QWEN2_5, hidden_size=896, intermediate_size=4864,
                                       num_layers=24, num_heads=14, head_dim=64)),
    "qwen2.5-1.5b": ModelConfig(**dict(_QWEN2_5, hidden_size=1536, intermediate_size=8960,
                                       num_layers=28, num_heads=12)),
    "qwen2.5-3b": ModelConfig(**dict(_QWEN2_5, hidden_size=2048, intermediate_size=11008,
                                     num_layers=36, num_heads=16)),
    "qwen2.5-7b": ModelConfig(**dict(_QWEN2_5, vocab_size=152064, hidden_size=3584,
                                     intermediate_size=18944, num_layers=28, num_heads=28,
                                     num_kv_heads=4, tie_embeddings=False)),
    "llama-3.2-1b": ModelConfig(**dict(_LLAMA3_2, hidden_size=2048, intermediate_size=8192,
                                       num_layers=16, num_heads=32, head_dim=64)),
    "llama-3.2-3b": ModelConfig(**dict(_LLAMA3_2, hidden_size=3072, intermediate_size=8192,
                                       num_layers=28, num_heads=24, head_dim=128)),
}
PRESETS.update(PUBLISHED)


def get_preset(name: str, **overrides) -> ModelConfig:
  """A named preset with fields overridden, e.g. get_preset("tiny", vocab_size=64)."""
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r} is unknown; known: {', '.join(PRESETS)}")
  return PRESETS[name].replace(**overrides)
