"""Models: one decoder for Llama / Qwen2 / Qwen3 / Mistral, HF checkpoints in and out, tokenizers."""

from grpojax.models.arch import Architecture
from grpojax.models.cache import KVCache
from grpojax.models.config import PRESETS, ModelConfig, get_preset, register_architecture
from grpojax.models.hf import from_pretrained, read_config, save_pretrained
from grpojax.models.sharding import DEFAULT_RULES, logical_to_spec
from grpojax.models.tokenizers import CharTokenizer, HFTokenizer, load_tokenizer
from grpojax.models.transformer import (Transformer, build_model, decode_params, decode_step,
                                        forward, param_shardings, param_specs, prefill,
                                        shard_model)

__all__ = [
    "Architecture", "CharTokenizer", "DEFAULT_RULES", "HFTokenizer", "KVCache", "ModelConfig",
    "PRESETS", "Transformer", "build_model", "decode_params", "decode_step", "forward",
    "from_pretrained", "get_preset", "load_tokenizer", "logical_to_spec", "param_shardings",
    "param_specs", "prefill", "read_config", "register_architecture", "save_pretrained",
    "shard_model",
]
