"""Reward models (rewards.models; grpojax.models.reward): the scores the rollout's program
computes on the device equal what TRL's GRPOTrainer gets for the same completions: its
texts (a conversation through the reward model's own chat template, or prompt +
completion), its tokenizer call (no special tokens, right padding), transformers'
PyTorch sequence classifier on the same weights, logits[:, 0]."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_models_helpers as H
from grpojax.models.tokenizers import CharTokenizer
from grpojax.parallel import mesh as mesh_lib
from grpojax.models import reward as reward_lib
from grpojax.rewards.runtime.host import HostRewards
from grpojax.run.settings import read as read_settings

torch, transformers = H.torch, H.transformers
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _reward_model_dir(tmp_path, *, template: bool, seed: int = 3) -> str:
  """A random Llama sequence classifier (one label) and a character-level HF tokenizer,
  with a chat template when `template` (the HF files only: both sides read the same)."""
  path = str(tmp_path / "rm")
  tok = CharTokenizer()
  hf = H.hf_model("llama", seed=seed, auto="AutoModelForSequenceClassification", num_labels=1,
                  vocab_size=tok.vocab_size, pad_token_id=tok.pad_id)
  hf.save_pretrained(path)
  tok.save_pretrained(path)
  os.remove(os.path.join(path, "char_tokenizer.json"))  # load through transformers
  config = json.load(open(os.path.join(path, "tokenizer_config.json")))
  if template:
    config["chat_template"] = TEMPLATE
  json.dump(config, open(os.path.join(path, "tokenizer_config.json"), "w"))
  return path


def _trl_scores(path, prompts, completions) -> np.ndarray:
  """TRL 1.16's GRPOTrainer._calculate_rewards for a reward model, line for line."""
  from trl.data_utils import apply_chat_template, is_conversational

  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  model = transformers.AutoModelForSequenceClassification.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()
  if tokenizer.pad_token_id is None:
    tokenizer.pad_token = tokenizer.eos_token
  model.config.pad_token_id = tokenizer.pad_token_id
  if is_conversational({"prompt": prompts[0]}):
    texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"]
             for p, c in zip(prompts, completions)]
  else:
    texts = [p + c for p, c in zip(prompts, completions)]
  inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                     add_special_tokens=False)
  with torch.no_grad():
    return model(**inputs).logits[:, 0].float().numpy()


def _host(path, rows, *, fns=(), max_length=64, mesh=None):
  """HostRewards over `rows` (looked up by index) with the reward model, and its params."""
  rm, params = reward_lib.load(path, dtype="float32", max_length=max_length, mesh=mesh)
  tok = CharTokenizer()
  host = HostRewards(list(fns), decode=lambda ids: [tok.decode(x) for x in ids],
                     lookup=lambda i: rows[i], num_workers=0, models=[rm])
  return host, rm, params


def _completions(texts, width=12):
  tok = CharTokenizer()
  ids = np.zeros((len(texts), width), np.int32)
  mask = np.zeros((len(texts), width), bool)
  for i, t in enumerate(texts):
    e = tok.encode(t)
    ids[i, :len(e)], mask[i, :len(e)] = e, True
  return ids, mask


@pytest.mark.parametrize("conversational", [False, True])
def test_device_scores_equal_trls_reward_model_scores(tmp_path, conversational):
  path = _reward_model_dir(tmp_path, template=conversational)
  if conversational:
    rows = [{"prompt": [{"role": "system", "content": "Add."},
                        {"role": "user", "content": f"{i}+{i}?"}]} for i in range(3)]
  else:
    rows = [{"prompt": f"{i} + {i} = "} for i in range(3)]
  texts = ["4", "12 or 13", "", "6", "x" * 12, "0"]  # an empty completion; one full width
  ids = np.array([0, 0, 1, 1, 2, 2])
  host, rm, params = _host(path, rows)
  tokens, mask = _completions(texts)
  got, errors = jax.jit(lambda i, t, m, p: host(i, t, m, reward_params=(p,)))(
      jnp.asarray(ids), jnp.asarray(tokens), jnp.asarray(mask), params)
  assert got.shape == (6, 1) and host.names == ("rm",) and list(np.asarray(errors)) == [0]
  prompts = [rows[i]["prompt"] for i in ids]
  completions = ([[{"role": "assistant", "content": t}] for t in texts] if conversational
                 else texts)
  want = _trl_scores(path, prompts, completions)
  np.testing.assert_allclose(np.asarray(got)[:, 0], want, atol=1e-4, rtol=0)
  assert len(set(np.round(want, 4))) == 6  # the rows' texts differ, and so do their scores
  if conversational:  # the reward model's own template, not the policy's
    assert rm.texts(prompts[:1], completions[:1])[0].startswith("<|system|>Add.\n<|user|>0+0?\n")


def test_reward_model_column_follows_the_functions_and_rows_shard_over_a_mesh(tmp_path):
  path = _reward_model_dir(tmp_path, template=False)
  rows = [{"prompt": f"{i}*{i}="} for i in range(4)]

  def length(completions, **unused):
    return [float(len(c)) for c in completions]

  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  host, rm, params = _host(path, rows, fns=[length], mesh=mesh)
  texts = ["1", "22", "333", "4444", "5", "66", "777", "8888"]
  ids = np.repeat(np.arange(4), 2)
  tokens, mask = _completions(texts)
  got, errors = jax.jit(lambda i, t, m, p: host(i, t, m, mesh=mesh, reward_params=(p,)))(
      jnp.asarray(ids), jnp.asarray(tokens), jnp.asarray(mask), params)
  assert host.names == ("length", "rm") and np.asarray(errors).tolist() == [0, 0]
  got = np.asarray(got)
  np.testing.assert_array_equal(got[:, 0], [len(t) for t in texts])
  want = _trl_scores(path, [rows[i]["prompt"] for i in ids], texts)
  np.testing.assert_allclose(got[:, 1], want, atol=1e-4, rtol=0)


def test_a_long_text_keeps_its_end_and_padding_rows_score_nan(tmp_path):
  path = _reward_model_dir(tmp_path, template=False)
  rows = [{"prompt": "0123456789" * 3}]
  host, rm, params = _host(path, rows, max_length=8)
  ids_, lengths = rm.inputs([rows[0]["prompt"]], ["ab"])
  assert CharTokenizer().decode(ids_[0]) == "456789ab" and lengths.tolist() == [8]
  assert rm.truncated == 1
  tokens, mask = _completions(["ab", "cd"])
  got, _ = jax.jit(lambda i, t, m, v, p: host(i, t, m, valid=v, reward_params=(p,)))(
      jnp.zeros(2, jnp.int32), jnp.asarray(tokens), jnp.asarray(mask), jnp.array([True, False]),
      params)
  got = np.asarray(got)[:, 0]
  want = _trl_scores(path, ["456789"], ["ab"])  # what the model sees: the text's last 8
  np.testing.assert_allclose(got[0], want[0], atol=1e-4)
  assert np.isnan(got[1])


def test_a_causal_lm_is_refused_as_a_reward_model(tmp_path):
  hf = H.hf_model("llama", seed=1)
  hf.save_pretrained(tmp_path / "lm")
  CharTokenizer().save_pretrained(str(tmp_path / "lm"))
  with pytest.raises(ValueError, match="is a LlamaForCausalLM: a reward model is a sequence "
                                       "classifier"):
    reward_lib.load(str(tmp_path / "lm"), dtype="float32", max_length=8)


def digits(completions, **unused):
  """The fraction of a completion's characters that are digits: the verifiable reward
  the reward model is fitted to, logged at weight 0 beside it."""
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _fitted_reward_model(path: str, prompts: list[str]) -> None:
  """A tiny Llama sequence classifier whose score head is fitted (least squares on its
  last hidden state) to `digits` over random texts, saved in HF format at `path`."""
  from grpojax import models
  from grpojax.models import transformer

  tok = CharTokenizer()
  rm = models.build_model("tiny", head="score", num_labels=1, seed=2, pad_token_id=tok.pad_id)
  rng = np.random.default_rng(0)
  alphabet = np.array(list(tok.chars))
  texts, targets = [], []
  for _ in range(512):
    share = rng.uniform()
    n = int(rng.integers(1, 12))
    chars = [rng.choice(list("0123456789")) if rng.uniform() < share else rng.choice(alphabet)
             for _ in range(n)]
    completion = "".join(chars)
    texts.append(prompts[int(rng.integers(len(prompts)))] + completion)
    targets.append(digits([completion])[0])
  width = max(len(t) for t in texts)
  ids = np.zeros((len(texts), width), np.int32)
  for i, t in enumerate(texts):
    ids[i, :len(t)] = tok.encode(t)
  lengths = np.array([len(t) for t in texts])
  hidden = transformer.forward(rm.config, rm.param_dict(), jnp.asarray(ids),
                               mask=jnp.asarray(np.arange(width)[None] < lengths[:, None]))
  last = np.asarray(hidden)[np.arange(len(texts)), lengths - 1]
  x = np.concatenate([last, np.ones((len(texts), 1))], axis=1)
  w = np.linalg.solve(x.T @ x + 1e-3 * np.eye(x.shape[1]), x.T @ np.asarray(targets))
  # A score head has no bias: the intercept is dropped (a constant moves no advantage).
  rm.score[...] = jnp.asarray(w[None, :-1], jnp.float32)
  fit = x[:, :-1] @ w[:-1] + w[-1]
  assert np.corrcoef(fit, targets)[0, 1] > 0.8  # the probe reads the digit share
  models.save_pretrained(rm, path, tokenizer=tok)


@pytest.mark.slow
def test_a_policy_rewarded_by_a_reward_model_alone_learns_what_it_was_fitted_to(tmp_path):
  """GRPO with a reward model as the only reward (TRL's reward_funcs=[model_dir]): the
  digit share it was fitted to rises, though the policy never sees that reward."""
  from grpojax.api import GRPOConfig, GRPOTrainer
  from grpojax.train import metrics as metrics_lib

  prompts = [f"Say {i}: " for i in range(8)]
  _fitted_reward_model(str(tmp_path / "rm"), prompts)
  args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=12, per_device_train_batch_size=16,
                    num_generations=8, max_completion_length=8, learning_rate=1e-2,
                    lr_scheduler_type="constant", logging_steps=1, seed=0, report_to="none",
                    reward_weights=[0.0, 1.0], beta=0.0,
                    # The texts are ~20 tokens: the reward model reads each whole, as at
                    # the default 1024, without 1024-token rows of padding to score.
                    config={"rewards.model_max_length": 32})
  trainer = GRPOTrainer(model="tiny", reward_funcs=[digits, str(tmp_path / "rm")], args=args,
                        train_dataset=[{"prompt": p} for p in prompts])
  assert trainer.config.rewards.models == str(tmp_path / "rm")
  trainer.train()
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "run")) if r["step"]]
  share = [r["rewards/digits/mean"] for r in rows]
  scored = [r["rewards/rm/mean"] for r in rows]
  assert np.mean(share[-4:]) > np.mean(share[:4]) + 0.15, share
  assert np.mean(scored[-4:]) > np.mean(scored[:4]), scored


def test_trls_reward_funcs_order_is_kept_in_the_weights(tmp_path):
  """TRL weighs reward_funcs in their order; grpojax puts models after functions, and
  their weights go with them."""
  from grpojax import api

  path = _reward_model_dir(tmp_path, template=False)
  funcs, dirs, weights = api._reward_models([path, digits, "m:f"], "2,0.5,0.25", None)
  assert funcs == [digits, "m:f"] and dirs == [os.path.abspath(path)]
  assert weights == "0.5,0.25,2"
  with pytest.raises(Exception, match="reward_processing_classes"):
    api._reward_models([path], "", [object()])


def test_configs_a_reward_model_cannot_serve_are_refused_in_one_line(tmp_path):
  from grpojax import config as config_lib

  path = _reward_model_dir(tmp_path, template=False)
  cfg = config_lib.get_config()
  cfg.rewards.models = path
  cfg.parallel.rollout_devices = 1
  with pytest.raises(config_lib.ConfigError, match="rollout_devices"):
    config_lib.validate(cfg)
  cfg.parallel.rollout_devices = 0
  cfg.task.name, cfg.task.dataset = "prompt", str(tmp_path)  # the reward model alone
  with pytest.raises(config_lib.ConfigError, match="eval.num_prompts=.* must be 0"):
    config_lib.validate(cfg)
  cfg.eval.num_prompts = 0
  config_lib.validate(cfg)
  cfg.rewards.models = str(tmp_path)  # no config.json
  with pytest.raises(config_lib.ConfigError, match="not a Hugging Face model directory"):
    config_lib.validate(cfg)


def test_a_reward_model_by_hub_id_is_taken_and_fetched_as_model_path_is(tmp_path, monkeypatch):
  """TRL's reward_funcs="owner/name": a reward model; offline and not cached, the run
  stops in one line naming rewards.models."""
  from grpojax import api
  from grpojax import config as config_lib
  from grpojax.train import wiring

  import huggingface_hub
  from huggingface_hub.utils import LocalEntryNotFoundError

  funcs, dirs, _ = api._reward_models(["owner/some-reward-model", digits], "", None)
  assert funcs == [digits] and dirs == ["owner/some-reward-model"]
  fetched = []

  def not_cached(repo_id, **kw):  # no network here: the cache is empty, HF_HUB_OFFLINE set
    fetched.append((repo_id, kw.get("local_files_only", False)))
    raise LocalEntryNotFoundError("not in the cache")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  cfg = config_lib.get_config()
  cfg.rewards.models = "owner/some-reward-model"
  config_lib.validate(cfg)  # a Hub id passes validation: it is fetched at the start
  with pytest.raises(config_lib.ConfigError, match=r"rewards.models='owner/some-reward-model' "
                                                   r"is not a directory.*local cache"):
    wiring.run_reward_models(read_settings(cfg))
  assert fetched == [("owner/some-reward-model", True), ("owner/some-reward-model", False)]
