"""Tokenizers with one interface: an AutoTokenizer wrapper and a built-in character tokenizer.

Axes: B texts, P padded prompt length, T tokens.

`batch_encode` left-pads to a length bucket so jitted programs see a few static
shapes; `batch_decode` reads back only the tokens a mask marks as real.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence

import numpy as np

CHAR_TOKENIZER_FILE = "char_tokenizer.json"
# A directory with none of these holds no tokenizer AutoTokenizer (or ours) can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
                   CHAR_TOKENIZER_FILE)


def buckets_up_to(max_length: int, smallest: int = 16) -> list[int]:
  """Powers of two from `smallest` below max_length, then max_length itself."""
  out, n = [], smallest
  while n < max_length:
    out.append(n)
    n *= 2
  return out + [max_length]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, *, max_length: int,
             buckets: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Token lists → (tokens [B, P] int32, mask [B, P] bool), right-aligned.

  P is the smallest bucket holding the longest sequence (buckets default to
  buckets_up_to(max_length)). Sequences longer than max_length keep their last
  max_length tokens: the end of a prompt (question, generation prompt) matters most.
  """
  if max_length < 1:
    raise ValueError(f"max_length must be >= 1, got {max_length}")
  seqs = [list(s)[-max_length:] for s in seqs]
  longest = max((len(s) for s in seqs), default=0)
  fits = [b for b in (buckets or buckets_up_to(max_length)) if b >= longest]
  width = min(fits) if fits else max_length
  tokens = np.full((len(seqs), width), pad_id, np.int32)
  mask = np.zeros((len(seqs), width), bool)
  for b, s in enumerate(seqs):
    if s:
      tokens[b, width - len(s):] = s
      mask[b, width - len(s):] = True
  return tokens, mask


class _Batching:
  """batch_encode / batch_decode on top of a subclass's encode / decode."""

  pad_id: int

  def batch_encode(self, texts: Sequence[str], *, max_length: int,
                   buckets: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Texts → left-padded (tokens [B, P] int32, mask [B, P] bool); see left_pad."""
    return left_pad([self.encode(t) for t in texts], self.pad_id, max_length=max_length,
                    buckets=buckets)

  def batch_decode(self, tokens, mask=None, *, skip_special_tokens: bool = True) -> list[str]:
    """tokens [B, T] (mask [B, T]: keep only True positions) → B strings."""
    tokens = np.asarray(tokens)
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    return [self.decode(row[m].tolist(), skip_special_tokens=skip_special_tokens)
            for row, m in zip(tokens, mask)]


class HFTokenizer(_Batching):
  """transformers.AutoTokenizer from a model directory, with chat templates."""

  def __init__(self, path: str):
    if not os.path.isdir(path):
      raise FileNotFoundError(f"tokenizer path {path!r} does not exist or is not a directory")
    import transformers  # heavy; only needed when a real tokenizer is used

    self.hf = transformers.AutoTokenizer.from_pretrained(path)
    eos = self.hf.eos_token_id
    ids = [] if eos is None else [eos]
    # Instruct models often end turns with extra ids listed only in generation_config.json.
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
      with open(gen, encoding="utf-8") as f:
        extra = json.load(f).get("eos_token_id")
      ids += extra if isinstance(extra, list) else [] if extra is None else [extra]
    if not ids:
      raise ValueError(f"tokenizer in {path!r} has no eos token")
    self.eos_ids = tuple(dict.fromkeys(ids))
    self.eos_id = self.eos_ids[0]
    # Llama tokenizers ship without a pad token; padding is masked out, any id works.
    self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
    self.bos_id = self.hf.bos_token_id
    self.vocab_size = len(self.hf)
    # Passed to every apply_chat_template (e.g. tools=[...]: the tools' schemas).
    self.template_kwargs: dict = {}
    # row -> the tools its prompt shows, where they differ by row (environments: see
    # grpojax.data.pipeline.prompt_text); None: template_kwargs' for every row.
    self.row_tools = None

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids. No special tokens by default: chat templates already contain them."""
    return self.hf.encode(text, add_special_tokens=add_special_tokens)

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          **template_kwargs) -> str:
    """messages [{"role", "content"}] → prompt text (e.g. enable_thinking=False for Qwen3)."""
    if not self.hf.chat_template:
      raise ValueError("this tokenizer has no chat_template; use encode() on plain text")
    return self.hf.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       **{**self.template_kwargs, **template_kwargs})

  def save_pretrained(self, path: str) -> None:
    self.hf.save_pretrained(path)


class CharTokenizer(_Batching):
  """One id per character: digits, letters, space, newline and ASCII punctuation.

  Ids 0-3 are <pad>, <bos>, <eos>, <unk>; unknown characters map to <unk>.
  For from-scratch experiments with no download.
  """

  SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

  def __init__(self, chars: str | None = None):
    if chars is None:
      chars = string.digits + string.ascii_letters + " \n" + string.punctuation
    if len(set(chars)) != len(chars):
      raise ValueError("CharTokenizer chars must be distinct")
    self.chars = chars
    self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
    self.eos_ids = (self.eos_id,)
    self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
    self.vocab_size = len(self.SPECIALS) + len(chars)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    ids = [self._ids.get(c, self.unk_id) for c in text]
    return [self.bos_id] + ids if add_special_tokens else ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    n = len(self.SPECIALS)
    out = []
    for i in ids:
      i = int(i)
      if i < 0:
        raise ValueError(f"token id {i} is outside the char vocabulary of {self.vocab_size}")
      if i >= n + len(self.chars):
        # A model's vocabulary may be larger than its tokenizer's (a published shape
        # built from scratch; Qwen pads its embedding): such ids decode to nothing,
        # as transformers' tokenizers decode them.
        continue
      if i >= n:
        out.append(self.chars[i - n])
      elif not skip_special_tokens:
        out.append(self.SPECIALS[i])
    return "".join(out)

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          **template_kwargs) -> str:
    """The built-in template: message contents joined by newlines (tiny models, short prompts)."""
    del add_generation_prompt, template_kwargs  # nothing marks the assistant's turn
    return "\n".join(m["content"] for m in messages)

  def save_pretrained(self, path: str) -> None:
    """Our own file, plus the same vocabulary as a Hugging Face fast tokenizer
    (tokenizer.json: one token per character), which AutoTokenizer loads as is."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CHAR_TOKENIZER_FILE), "w", encoding="utf-8") as f:
      json.dump({"chars": self.chars}, f)
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*self.SPECIALS, *self.chars])}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()  # characters back together, no spaces between
    hf.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
                 "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                 "model_max_length": 1 << 30}, f, indent=2)


def load_tokenizer(path: str) -> HFTokenizer | CharTokenizer:
  """"char" → the built-in CharTokenizer; a directory → its saved tokenizer."""
  if path == "char":
    return CharTokenizer()
  char_file = os.path.join(path, CHAR_TOKENIZER_FILE)
  if os.path.isfile(char_file):
    with open(char_file, encoding="utf-8") as f:
      return CharTokenizer(json.load(f)["chars"])
  return HFTokenizer(path)
