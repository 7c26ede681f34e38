"""Tokenizers: a tiny BPE tokenizer built in code (no download) and the built-in char tokenizer."""

import json

import numpy as np
import pytest

from grpojax import models
from grpojax.models import tokenizers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["What is 12 + 30? The answer is 42.", "Solve 7 * 6 = 42 step by step.",
          "user assistant system", "hello world, hello tokenizer"] * 3


def make_hf_tokenizer_dir(path) -> str:
  """A byte-level BPE tokenizer trained on a few strings, saved as a HF tokenizer directory."""
  tk = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
      additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE)
  fast.save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return make_hf_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def test_hf_chat_template_and_roundtrip(hf_dir):
  tok = tokenizers.load_tokenizer(hf_dir)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7 * 6?"}]
  text = tok.apply_chat_template(messages)
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n7 * 6?<|im_end|>\n"
                  "<|im_start|>assistant\n")
  ids = tok.encode(text)
  assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>")
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.decode(ids) == "system\nBe brief.\nuser\n7 * 6?\nassistant\n"
  assert tok.pad_id == tok.hf.convert_tokens_to_ids("<pad>")
  assert tok.eos_ids == (tok.hf.convert_tokens_to_ids("</s>"),)


def test_hf_batch_encode_left_pads_to_bucket(hf_dir):
  tok = tokenizers.load_tokenizer(hf_dir)
  texts = ["hello world", "What is 12 + 30? The answer is 42.", "hi"]
  tokens, mask = tok.batch_encode(texts, max_length=64, buckets=[8, 16, 32, 64])
  lengths = [len(tok.encode(t)) for t in texts]
  assert tokens.dtype == np.int32 and tokens.shape[1] == min(b for b in (8, 16, 32, 64)
                                                             if b >= max(lengths))
  for row, m, t, n in zip(tokens, mask, texts, lengths):
    assert m.sum() == n and m[-n:].all()  # real tokens right-aligned
    assert row[m].tolist() == tok.encode(t)
    assert (row[~m] == tok.pad_id).all()
  assert tok.batch_decode(tokens, mask) == texts


def test_generation_config_eos_ids_are_merged(tmp_path):
  path = make_hf_tokenizer_dir(tmp_path)
  with open(f"{path}/generation_config.json", "w") as f:
    json.dump({"eos_token_id": [2, 4]}, f)
  tok = tokenizers.load_tokenizer(path)
  assert tok.eos_ids == (2, 4)


def test_left_pad_truncates_from_the_left_and_buckets():
  tokens, mask = tokenizers.left_pad([[1, 2, 3, 4, 5], [6]], 0, max_length=4, buckets=[2, 4])
  np.testing.assert_array_equal(tokens, [[2, 3, 4, 5], [0, 0, 0, 6]])
  np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [0, 0, 0, 1]])
  tokens, _ = tokenizers.left_pad([[1, 2, 3]], 0, max_length=100)
  assert tokens.shape == (1, 16)
  assert tokenizers.buckets_up_to(40) == [16, 32, 40]


def test_char_tokenizer(tmp_path):
  tok = tokenizers.load_tokenizer("char")
  assert tok.vocab_size <= models.get_preset("tiny").vocab_size
  text = "12+30=42\nWhat is x*y? (a-b)/2"
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode("é") == [tok.unk_id]
  assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4
  assert tok.encode("7", add_special_tokens=True) == [tok.bos_id, tok.encode("7")[0]]
  tokens, mask = tok.batch_encode(["1+1=", "12+13="], max_length=8, buckets=[8])
  assert tokens.shape == (2, 8) and tok.batch_decode(tokens, mask) == ["1+1=", "12+13="]
  with_eos = np.concatenate([tokens, np.full((2, 1), tok.eos_id)], 1)
  assert tok.batch_decode(with_eos)[0] == "1+1="  # pad and eos are skipped
  assert tok.apply_chat_template([{"role": "user", "content": "2+2="}]) == "2+2="
  tok.save_pretrained(str(tmp_path))
  again = tokenizers.load_tokenizer(str(tmp_path))
  assert again.encode(text) == tok.encode(text)
  # Ids past the vocabulary (a larger model vocabulary) decode to nothing; negative ids are bugs.
  assert tok.decode([tok.encode("7")[0], tok.vocab_size, 151935]) == "7"
  with pytest.raises(ValueError, match="outside the char vocabulary"):
    tok.decode([-1])


def test_missing_tokenizer_path():
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tokenizers.load_tokenizer("/nonexistent/tokenizer")
