"""Held-out evaluation: greedy pass@1 (`eval/accuracy`) and sampled pass@k.

Axes: E eval prompts, b prompts per eval batch, k samples per prompt.
"""

from __future__ import annotations

import jax
import numpy as np

from grpojax.data.pipeline import prompt_text
from grpojax.data.tasks import Row, Task
from grpojax.models import sharding as sharding_lib
from grpojax.models.tokenizers import left_pad
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import sampler
from grpojax.sampling.strategies import SamplingParams


def pass_at_k(correct_Ek: np.ndarray) -> float:
  """Fraction of prompts with at least one correct sample among their k."""
  return float(np.mean(np.any(correct_Ek, axis=1))) if correct_Ek.size else 0.0


class Evaluator:
  """Scores the policy on a fixed held-out set.

  Args:
    rows: held-out rows of `task` (prompts longer than max_prompt_length are skipped).
    batch_size: prompts per generate call (the last batch is padded by repeating rows).
    k: samples per prompt for pass@k (0: greedy accuracy only).
    temperature: sampling temperature for pass@k.
    mesh: shard eval rows over ("data", "fsdp") when given.
    rewards: a grpojax.rewards.host.HostRewards whose first function is the
      task's verifier, when `task.is_correct` is derived from it: completions
      are then scored by its worker pool, all of a batch at once, instead of
      one by one in this process. None: `task.is_correct` here.
  """

  def __init__(self, rows: list[Row], task: Task, tokenizer, *, batch_size: int,
               max_prompt_length: int, max_new_tokens: int, k: int = 0,
               temperature: float = 1.0, mesh=None, rewards=None):
    texts = [prompt_text(task, r, tokenizer) for r in rows]
    encoded = [tokenizer.encode(t) for t in texts]
    keep = [i for i, e in enumerate(encoded) if len(e) <= max_prompt_length]
    self.rows = [rows[i] for i in keep]
    self.prompts = [task.reward_prompt(rows[i], texts[i]) for i in keep]
    self.encoded = [encoded[i] for i in keep]
    self.task, self.tokenizer, self.mesh, self.rewards = task, tokenizer, mesh, rewards
    self.batch_size, self.k, self.temperature = batch_size, k, temperature
    self.max_prompt_length, self.max_new_tokens = max_prompt_length, max_new_tokens

  def _batches(self):
    n = len(self.rows)
    for start in range(0, n, self.batch_size):
      ids = [i % n for i in range(start, start + self.batch_size)]
      tokens, mask = left_pad([self.encoded[i] for i in ids], self.tokenizer.pad_id,
                              max_length=self.max_prompt_length)
      yield ids[:min(self.batch_size, n - start)], tokens, mask.astype(np.int32)

  def _correct(self, cfg, params, rng, num_samples: int, sampling: SamplingParams) -> np.ndarray:
    """[E, num_samples] bool."""
    out = []
    for b, (ids, tokens, mask) in enumerate(self._batches()):
      if self.mesh is not None:
        rows = mesh_lib.row_sharding(self.mesh, tokens.shape[0])
        tokens, mask = jax.device_put(tokens, rows), jax.device_put(mask, rows)
      res = sampler.generate_from_params(
          cfg, params, tokens, mask, rng=jax.random.fold_in(rng, b), num_samples=num_samples,
          max_new_tokens=self.max_new_tokens, sampling=sampling,
          eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id, mesh=self.mesh)
      tokens, mask = sharding_lib.to_host(res.tokens), sharding_lib.to_host(res.mask) > 0
      n = len(ids) * num_samples  # the padding rows of the last batch are not scored
      texts = self.tokenizer.batch_decode(tokens[:n], mask[:n])
      if self.rewards is not None:
        # As the training verifiers see a row: its formatted prompt in the prompt column.
        rows = [dict(self.rows[i], prompt=self.prompts[i]) for i in ids for _ in range(num_samples)]
        token_ids = [t[m].tolist() for t, m in zip(tokens[:n], mask[:n])]
        # NaN (a failed or interrupted call) compares False: not correct.
        correct = self.rewards.score(rows, texts, token_ids)[:, 0] >= 1.0
      else:
        rows = [self.rows[i] for i in ids for _ in range(num_samples)]
        correct = [self.task.is_correct(t, row) for t, row in zip(texts, rows)]
      out += list(correct)
    return np.asarray(out, bool).reshape(-1, num_samples)

  def __call__(self, cfg, params, rng) -> dict[str, float]:
    """{"eval/accuracy": greedy pass@1, "eval/pass@k": sampled pass@k (if k > 0)}."""
    if not self.rows:
      return {}
    greedy = self._correct(cfg, params, rng, 1, SamplingParams(temperature=0.0))
    metrics = {"eval/accuracy": float(greedy.mean())}
    if self.k > 0:
      sampled = self._correct(cfg, params, rng, self.k, SamplingParams(temperature=self.temperature))
      metrics[f"eval/pass@{self.k}"] = pass_at_k(sampled)
    return metrics
