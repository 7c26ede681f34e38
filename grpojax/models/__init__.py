"""Models: one decoder for Llama / Qwen2 / Qwen3 / Mistral, HF checkpoints in and out, tokenizers."""

from grpojax.models.cache import KVCache, init_cache, repeat_rows
from grpojax.models.config import PRESETS, ModelConfig, get_preset
from grpojax.models.hf import from_pretrained, read_config, save_pretrained
from grpojax.models.sharding import DEFAULT_RULES, logical_to_spec
from grpojax.models.tokenizers import CharTokenizer, HFTokenizer, load_tokenizer
from grpojax.models.transformer import (Transformer, build_model, forward, param_shardings,
                                        param_specs, shard_model)

__all__ = [
    "DEFAULT_RULES", "CharTokenizer", "HFTokenizer", "KVCache", "ModelConfig", "PRESETS",
    "Transformer", "build_model", "forward", "from_pretrained", "get_preset", "init_cache",
    "load_tokenizer", "logical_to_spec", "param_shardings", "param_specs", "read_config",
    "repeat_rows", "save_pretrained", "shard_model",
]
