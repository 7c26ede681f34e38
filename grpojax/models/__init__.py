"""Models: one decoder for Llama / Qwen2 / Qwen3 / Mistral, HF checkpoints in and out, tokenizers."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "arch": ["Architecture"],
    "cache": ["KVCache"],
    "config": ["PRESETS", "ModelConfig", "get_preset", "register_architecture"],
    "hf": ["from_pretrained", "read_config", "save_pretrained"],
    "sharding": ["DEFAULT_RULES", "logical_to_spec"],
    "tokenizers": ["CharTokenizer", "HFTokenizer", "load_tokenizer"],
    "transformer": ["Transformer", "build_model", "decode_params", "decode_step", "forward",
                    "param_shardings", "param_specs", "prefill", "shard_model"],
})
