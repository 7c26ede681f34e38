"""A tiny tokenizer whose chat template speaks Qwen2.5's tool format, built in code: one
id per character plus the template's special tokens (each one id, as in Qwen's
vocabulary)."""

import json
import os
import string

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]
CHARS = string.digits + string.ascii_letters + " \n" + string.punctuation

# Qwen2.5's tool format, written small: the tools' schemas in the system turn, calls in
# <tool_call> tags, each run of tool results one user turn of <tool_response> blocks.
TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}"
    "{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant' }}"
    "{%- if m.content %}{{ '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{ (c.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tool_tokenizer(path: str) -> str:
  """Writes the tokenizer to `path` (an HF directory AutoTokenizer loads); returns it."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

  os.makedirs(path, exist_ok=True)
  vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
  hf = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  hf.decoder = decoders.Fuse()
  hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  hf.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
               "eos_token": "<|im_end|>", "chat_template": TEMPLATE,
               "model_max_length": 1 << 30}, f, indent=2)
  return path
