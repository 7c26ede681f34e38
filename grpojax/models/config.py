"""ModelConfig: the frozen description of one decoder, and named presets (tiny runs; real shapes).

One config covers Llama, Qwen2/2.5, Qwen3, Mistral and Gemma 2/3: they differ in
the flags below (biases, q/k norm, tied embeddings, RoPE scaling, sliding windows,
soft-capping) and in their Architecture (models/arch.py, models/gemma.py). `arch` names the
registered Architecture, which also holds the Hugging Face names `save_pretrained`
writes.
"""

from __future__ import annotations

import dataclasses

from grpojax import registry
from grpojax.ops import BACKENDS
from grpojax.models import arch as arch_lib
from grpojax.models import gemma

# ModelConfig.arch -> its Architecture (models/arch.py), the one registry the decoder and
# the HF format (models/hf.py) read; research code adds variants.
ARCHITECTURES = registry.Registry[arch_lib.Architecture]("ModelConfig.arch")
for _name, _family in {**arch_lib.FAMILIES, **gemma.FAMILIES}.items():
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
LAYER_TYPES = ("sliding_attention", "full_attention")


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
  # Sliding-window attention: a query at position p sees keys at p - window < k <= p
  # (HF's bound). layer_types (HF's "sliding_attention" / "full_attention", one per
  # layer) says which layers it applies to; None: every layer when a window is set.
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  # RoPE base of the sliding layers (Gemma 3's rope_local_base_freq, unscaled); None:
  # every layer uses rope_theta with its scaling.
  rope_local_theta: float | None = None
  # Attention scale query_pre_attn_scalar**-0.5 (Gemma); None: head_dim**-0.5.
  query_pre_attn_scalar: float | None = None
  # Soft-capping c * tanh(x / c) of the attention scores (before masking) and of the
  # final logits (Gemma 2); None: none.
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
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
    if isinstance(self.layer_types, list):  # from a config.json: hashable, as jit needs
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.layer_types is not None:
      bad = set(self.layer_types) - set(LAYER_TYPES)
      if len(self.layer_types) != self.num_layers or bad:
        raise ValueError(f"ModelConfig.layer_types must list num_layers={self.num_layers} of "
                         f"{', '.join(LAYER_TYPES)}; got {self.layer_types}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window is None")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  @property
  def architecture(self) -> arch_lib.Architecture:
    return ARCHITECTURES.get(self.arch)

  @property
  def layer_windows(self) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: it attends to every earlier key)."""
    if self.layer_types is None:
      return (self.sliding_window,) * self.num_layers
    return tuple(self.sliding_window if t == "sliding_attention" else None
                 for t in self.layer_types)

  @property
  def attention_scale(self) -> float:
    """The factor on q . k before the softmax."""
    return (self.query_pre_attn_scalar or self.head_dim)**-0.5

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
    # Gemma 3's features at a few thousand parameters: (1 + w) norms, four per block, GeGLU,
    # q/k norms, a sliding layer (8 tokens, its own RoPE base) then a global one.
    "gemma3_tiny": ModelConfig(arch="gemma3", vocab_size=128, hidden_size=64,
                               intermediate_size=128, num_heads=4, num_kv_heads=1, head_dim=16,
                               qk_norm=True, tie_embeddings=True, rope_theta=1e6,
                               rope_local_theta=1e4, query_pre_attn_scalar=16, sliding_window=8,
                               layer_types=("sliding_attention", "full_attention")),
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
_GEMMA3 = dict(arch="gemma3", vocab_size=262144, qk_norm=True, tie_embeddings=True,
               rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=256,
               max_position_embeddings=32768, bos_token_id=2, eos_token_id=(1, 106),
               pad_token_id=0)
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
    # google/gemma-3-1b-pt: 5 sliding-window layers (512 tokens) to each global one.
    "gemma-3-1b": ModelConfig(**dict(_GEMMA3, hidden_size=1152, intermediate_size=6912,
                                     num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                                     sliding_window=512,
                                     layer_types=tuple("full_attention" if (i + 1) % 6 == 0
                                                       else "sliding_attention"
                                                       for i in range(26)))),
    "llama-3.2-3b": ModelConfig(**dict(_LLAMA3_2, hidden_size=3072, intermediate_size=8192,
                                       num_layers=28, num_heads=24, head_dim=128)),
}
PRESETS.update(PUBLISHED)


def get_preset(name: str, **overrides) -> ModelConfig:
  """A named preset with fields overridden, e.g. get_preset("tiny", vocab_size=64)."""
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r} is unknown; known: {', '.join(PRESETS)}")
  return PRESETS[name].replace(**overrides)
