"""Reward models: a sequence classifier (HF's *ForSequenceClassification, a score head
on the decoder) scores each completion on the device, in the rollout's program.

TRL's GRPOTrainer takes a model id in `reward_funcs` and, per batch, renders each
prompt and completion as text (a conversational row through the reward model's own
chat template, a plain one as prompt + completion), tokenizes it with the reward
model's tokenizer (no special tokens added, padded on the right) and reads the
score head's first output at the last token that is not the pad id. Here the host
does only the text-to-ids half, in the reward callback it already runs, and hands
the ids back; the forward runs on the device inside the jitted rollout, with the
reward model's weights sharded like the policy's (TrainState.reward_params). Its
column joins the reward functions' as one more reward: weighed by rewards.weights
and normalised with the others into advantages.

Axes: n rows, R the reward model's input length (rewards.model_max_length).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.models import transformer
from grpojax.models.config import ModelConfig


@dataclasses.dataclass(eq=False)
class RewardModel:
  """One reward model: its config (head "score"), tokenizer and input length.

  name: its column's name (rewards/<name>/mean), the directory's base name as TRL's.
  max_length: R, the token ids a row's text may take; a longer text keeps its last R
    (the end, where the score is read, and the completion), counted in `truncated`.
  """

  name: str
  config: ModelConfig
  tokenizer: object
  max_length: int
  truncated: int = 0  # rows cut to max_length so far

  @property
  def __name__(self) -> str:  # noqa: PLW3201  the name rewards/<name>/* use, as a function's
    return self.name

  @property
  def pad_id(self) -> int:
    # TRL: the reward tokenizer's pad token, its EOS where it has none, is the pad id
    # the score is read before (HFTokenizer.pad_id is that rule already).
    return int(self.tokenizer.pad_id)

  def score(self, params, ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """Traceable: `scores` of this model (the reward callback's caller scores with it)."""
    return scores(self, params, ids, lengths)

  def texts(self, prompts, completions) -> list[str]:
    """TRL's reward-model texts: prompt messages + completion messages through this
    model's chat template (no generation prompt), or prompt text + completion text."""
    out = []
    for p, c in zip(prompts, completions):
      if isinstance(p, (list, tuple)):
        out.append(self.tokenizer.apply_chat_template(list(p) + list(c),
                                                      add_generation_prompt=False))
      else:
        out.append(f"{p or ''}{c}")
    return out

  def inputs(self, prompts, completions) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, R] int32, lengths [n] int32): TRL's texts tokenized without special
    tokens, right-padded with the pad id; a text longer than R keeps its last R."""
    ids = np.full((len(completions), self.max_length), self.pad_id, np.int32)
    lengths = np.zeros(len(completions), np.int32)
    for i, text in enumerate(self.texts(prompts, completions)):
      row = self.tokenizer.encode(text, add_special_tokens=False)
      if len(row) > self.max_length:
        if not self.truncated:
          logging.warning("reward model %s: a text of %d tokens is longer than "
                          "rewards.model_max_length=%d; its last %d are scored (counted in "
                          "RewardModel.truncated; shown once)", self.name, len(row),
                          self.max_length, self.max_length)
        self.truncated += 1
        row = row[-self.max_length:]
      ids[i, :len(row)], lengths[i] = row, len(row)
    return ids, lengths


def scores(model: RewardModel, params, ids: jax.Array, lengths: jax.Array) -> jax.Array:
  """Traceable: the first output of the score head [n] float32 for ids [n, R], at
  HF's position (the last token that is not the pad id); `lengths` [n] (the rows'
  real tokens) make the attention mask, so a pad id inside a text is attended, as
  the tokenizer's mask has it."""
  R = ids.shape[1]
  # At least the first token: an empty text (or a padding row) scores, never NaN.
  mask = jnp.arange(R)[None, :] < jnp.maximum(lengths, 1)[:, None]
  cfg = model.config.replace(pad_token_id=model.pad_id)
  return transformer.sequence_scores(cfg, params, ids, mask)[:, 0]


def load(path: str, *, dtype: str, max_length: int, mesh=None, rules=None, abstract: bool = False
         ) -> tuple[RewardModel, dict]:
  """(RewardModel, its parameters) from a HF directory of a *ForSequenceClassification
  model (its tokenizer beside it); placed by the logical-axis rules on `mesh`.
  abstract: the parameters as ShapeDtypeStructs (with their shardings on a mesh), from
  config.json alone: what the planner compiles against, no weights read."""
  from grpojax.models import hf as hf_lib  # pylint: disable=import-outside-toplevel
  from grpojax.models import tokenizers  # pylint: disable=import-outside-toplevel

  cfg = hf_lib.read_config(path)
  if cfg.head != "score":
    raise ValueError(f"reward model {path!r} is a {cfg.architecture.hf_class_for(cfg.head)}: a "
                     "reward model is a sequence classifier (*ForSequenceClassification, one "
                     "score per text)")
  if abstract:
    cfg = cfg.replace(param_dtype=dtype, dtype=dtype)
    shardings = (transformer.param_shardings(cfg, mesh, rules) if mesh is not None else {})
    params = {n: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=shardings.get(n))
              for n, (shape, _) in transformer.param_specs(cfg).items()}
  else:
    cfg, params = hf_lib.load_params(path, dtype=dtype, mesh=mesh, rules=rules)
  tokenizer = tokenizers.load_tokenizer(path)
  name = os.path.basename(os.path.normpath(path))
  return RewardModel(name=name, config=cfg, tokenizer=tokenizer, max_length=max_length), params
