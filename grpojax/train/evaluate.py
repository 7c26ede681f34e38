"""Held-out evaluation: greedy accuracy, and from n sampled completions per prompt
the unbiased pass@k, mean@n and majority-vote maj@k estimators.

Axes: E eval prompts, b prompts per eval batch, n samples per prompt.
"""

from __future__ import annotations

import collections
import math
import zlib
from collections.abc import Sequence

import jax
import numpy as np

from grpojax.data.pipeline import observed_prompt, prompt_text
from grpojax.data.tasks import Row, Task
from grpojax.models import sharding as sharding_lib
from grpojax.models.tokenizers import left_pad
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import sampler
from grpojax.sampling.engine import EngineConfig
from grpojax.sampling.strategies import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
  """Chen et al. (2021)'s unbiased pass@k of one prompt with c of n samples correct:
  1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without replacement hold
  a correct one.

  In product form, 1 - prod_{i=n-c+1..n} (1 - k/i): the binomials themselves
  overflow a float for n in the hundreds.
  """
  if n - c < k:
    return 1.0  # every k-subset holds a correct sample
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _capped(m: int, cap: int, p: float) -> np.ndarray:
  """sum_{x <= cap} C(m, x) p^x (1-p)^(m-x) z^x as coefficients of z: the ways to
  draw x <= cap samples of a class of m, each weighted by a binomial pmf term."""
  x = np.arange(min(cap, m) + 1)
  log_comb = np.array([math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1)
                       for i in x])
  return np.exp(log_comb + x * math.log(p) + (m - x) * math.log1p(-p))


def _ways(classes: list[tuple[int, int]], free: int, k: int, p: float) -> float:
  """[z^k] of (1-p+pz)^free * prod over (size m, cap) of _capped(m, cap): the weighted
  number of k-subsets drawing at most cap samples from each class."""
  poly = _capped(free, free, p)
  for m, cap in classes:
    poly = np.convolve(poly, _capped(m, cap, p))[:k + 1]
  return float(poly[k]) if len(poly) > k else 0.0


def maj_at_k(keys: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
  """Expected majority-vote correctness of one prompt over every k-subset of its n samples.

  A subset votes for the answer key most of its samples share; samples whose key
  is None (no answer found) do not vote, and a subset with no votes is wrong. An
  answer is correct when any of its samples was scored correct (samples sharing a
  key give the same answer: they differ only if a verifier call failed). Ties:
  the vote is correct only if every answer with the most votes is correct -- a
  tie between a right and a wrong answer counts as wrong (deterministic, and a
  lower bound on breaking ties at random).

  No enumeration of the C(n, k) subsets: with class sizes m_j, the subsets whose
  top count is v and whose top answers are all correct number A(v) - B(v), where
  A(v) caps correct classes at v and wrong ones at v-1, B(v) caps all at v-1; each
  is one coefficient of a product of per-class polynomials. The terms carry
  binomial pmf weights p^x (1-p)^(m-x) (which cancel in the ratio) so that nothing
  overflows for large n.
  """
  n = len(keys)
  if not 1 <= k <= n:
    raise ValueError(f"maj@k needs 1 <= k <= n, got k={k}, n={n}")
  sizes, right = collections.Counter(), collections.defaultdict(bool)
  for key, ok in zip(keys, correct):
    if key is not None:
      sizes[key] += 1
      right[key] |= bool(ok)
  top = max((m for key, m in sizes.items() if right[key]), default=0)
  if not top:
    return 0.0
  free = n - sum(sizes.values())
  p = k / (n + 1)  # any p in (0, 1) gives the same ratio; near k/n keeps the terms in range
  total = _ways([], n, k, p)  # C(n, k), weighted alike
  out = 0.0
  for v in range(1, min(top, k) + 1):
    a = _ways([(m, v if right[key] else v - 1) for key, m in sizes.items()], free, k, p)
    b = _ways([(m, v - 1) for m in sizes.values()], free, k, p)
    out += a - b
  return float(np.clip(out / total, 0.0, 1.0))


def sampled_metrics(correct_En: np.ndarray, keys_En: Sequence[Sequence[str | None]] | None,
                    ks: Sequence[int]) -> dict[str, float]:
  """{"pass@k", "maj@k" (each k; maj only with keys), "mean@n"}, averaged over prompts.

  correct_En: [E, n] bool, n >= every k; keys_En: [E][n] answer keys, or None.
  """
  E, n = correct_En.shape
  if not E:
    return {}
  c_E = correct_En.sum(axis=1)
  out = {f"pass@{k}": float(np.mean([pass_at_k(n, int(c), k) for c in c_E])) for k in ks}
  if keys_En is not None:
    for k in ks:
      out[f"maj@{k}"] = float(np.mean([maj_at_k(keys, correct, k)
                                       for keys, correct in zip(keys_En, correct_En)]))
  out[f"mean@{n}"] = float(correct_En.mean())  # the expected pass@1 of a sample
  return out


class Evaluator:
  """Scores the policy on a fixed held-out set.

  Args:
    rows: held-out rows of `task` (prompts longer than max_prompt_length are skipped).
    batch_size: prompts per generate call (the last batch is padded by repeating rows).
    ks: the k of pass@k and maj@k (empty: greedy accuracy, and mean@n if n > 0).
    n: sampled completions per prompt, >= every k (0: the largest k).
    temperature: sampling temperature of the n samples.
    name: "" reports eval/accuracy, eval/pass@k, ...; else eval/<name>/accuracy, ...
    mesh: shard eval rows over ("data", "fsdp") when given.
    rewards: a grpojax.rewards.runtime.host.HostRewards whose first function is the
      task's verifier, when `task.is_correct` is derived from it: completions
      are then scored by its worker pool, all of a batch at once, instead of
      one by one in this process. None: `task.is_correct` here.
    engine: the paged engine's sizes (sampling.engine.EngineConfig; the default:
      every row in a slot), or None: the lockstep reference sampler.
    hook: the rollout's row-event hook (its tool turns: sampling.engine.turns), run
      on the eval rows as on the training rows.
    environments: a grpojax.tools.Environments of eval's own (the instances the
      `hook`'s runner calls): each batch resets its rows' environments first (1 per
      prompt for greedy, n for the samples), a reset's text joins its prompt, and the
      verifier gets the instances as `environments` (with `rewards`; where the run's
      only reward is an environment's get_reward, it is the verifier).
  """

  def __init__(self, rows: list[Row], task: Task, tokenizer, *, batch_size: int,
               max_prompt_length: int, max_new_tokens: int, ks: Sequence[int] = (), n: int = 0,
               temperature: float = 1.0, name: str = "", mesh=None, rewards=None,
               engine: EngineConfig | None = EngineConfig(), hook=None, environments=None):
    texts = [prompt_text(task, r, tokenizer) for r in rows]
    encoded = [tokenizer.encode(t) for t in texts]
    keep = [i for i, e in enumerate(encoded) if len(e) <= max_prompt_length]
    self.rows = [rows[i] for i in keep]
    self.prompts = [task.reward_prompt(rows[i], texts[i]) for i in keep]
    self.encoded = [encoded[i] for i in keep]
    self.task, self.tokenizer, self.mesh, self.rewards = task, tokenizer, mesh, rewards
    self.engine, self.hook, self.environments = engine, hook, environments
    self.ks = tuple(sorted(set(ks)))
    self.n = n or (self.ks[-1] if self.ks else 0)
    if self.ks and self.ks[-1] > self.n:
      raise ValueError(f"pass@k needs n >= k samples per prompt, got ks={self.ks}, n={n}")
    self.batch_size, self.temperature = batch_size, temperature
    self.prefix = f"eval/{name}/" if name else "eval/"
    self.max_prompt_length, self.max_new_tokens = max_prompt_length, max_new_tokens

  def _batches(self, num_samples: int):
    """(ids [b'] of the prompts scored, their reward prompts [b'], tokens [b, P], mask
    [b, P]) per batch; b' < b in the last, padded by repeating rows."""
    n = len(self.rows)
    for start in range(0, n, self.batch_size):
      ids = [i % n for i in range(start, start + self.batch_size)]
      encoded, prompts = [self.encoded[i] for i in ids], [self.prompts[i] for i in ids]
      if self.environments is not None:  # padding rows too: the engine runs their turns
        # Keyed by the prompt: greedy and sampled passes, and every eval, draw alike.
        keys = [(zlib.crc32(self.prefix.encode()), i) for i in ids]
        texts = self.environments.reset([self.rows[i] for i in ids], group_size=num_samples,
                                        keys=keys)
        for j, text in enumerate(texts):
          if text is not None:
            encoded[j], prompts[j] = observed_prompt(self.task, self.rows[ids[j]], self.tokenizer,
                                                     text, self.max_prompt_length)
      tokens, mask = left_pad(encoded, self.tokenizer.pad_id, max_length=self.max_prompt_length)
      scored = min(self.batch_size, n - start)
      yield ids[:scored], prompts[:scored], tokens, mask.astype(np.int32)

  def _correct(self, cfg, params, rng, num_samples: int,
               sampling: SamplingParams) -> tuple[np.ndarray, list[str]]:
    """correct: [E, num_samples] bool; texts: the E * num_samples completions, row-major."""
    out, all_texts = [], []
    for b, (ids, prompts, tokens, mask) in enumerate(self._batches(num_samples)):
      if self.mesh is not None:
        rows = mesh_lib.row_sharding(self.mesh, tokens.shape[0])
        tokens, mask = jax.device_put(tokens, rows), jax.device_put(mask, rows)
      tools = getattr(self.hook, "host", None)
      if hasattr(tools, "begin"):
        tools.begin()  # each batch's rows own their tools' state
      res = sampler.generate_from_params(
          cfg, params, tokens, mask, rng=jax.random.fold_in(rng, b), num_samples=num_samples,
          max_new_tokens=self.max_new_tokens, sampling=sampling,
          eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id, mesh=self.mesh,
          engine=self.engine, hook=self.hook)
      tokens, mask = sharding_lib.to_host(res.tokens), sharding_lib.to_host(res.mask) > 0
      n = len(ids) * num_samples  # the padding rows of the last batch are not scored
      texts = self.tokenizer.batch_decode(tokens[:n], mask[:n])
      if self.rewards is not None:
        # As the training verifiers see a row: its formatted prompt in the prompt column.
        rows = [dict(self.rows[i], prompt=p) for i, p in zip(ids, prompts)
                for _ in range(num_samples)]
        if self.environments is not None:  # the rows' own instances, prompt-major as the rows
          for row, live in zip(rows, self.environments.columns(range(n))["environments"]):
            row["environments"] = live
        token_ids = [t[m].tolist() for t, m in zip(tokens[:n], mask[:n])]
        said = getattr(tools, "conversation", None)  # tool-using rows as TRL's messages
        conversations = None if said is None else [said(r, ids) for r, ids in enumerate(token_ids)]
        # NaN (a failed or interrupted call) compares False: not correct.
        correct = self.rewards.score(rows, texts, token_ids,
                                     conversations=conversations)[:, 0] >= 1.0
      else:
        rows = [self.rows[i] for i in ids for _ in range(num_samples)]
        correct = [self.task.is_correct(t, row) for t, row in zip(texts, rows)]
      out += list(correct)
      all_texts += list(texts)
    return np.asarray(out, bool).reshape(-1, num_samples), all_texts

  def __call__(self, cfg, params, rng) -> dict[str, float]:
    """{prefix + "accuracy": greedy pass@1} and, when n > 0, pass@k and maj@k for each
    k (maj@k only for tasks with an answer_key) and mean@n."""
    if not self.rows:
      return {}
    greedy, _ = self._correct(cfg, params, rng, 1, SamplingParams(temperature=0.0))
    metrics = {"accuracy": float(greedy.mean())}
    if self.n:
      sampled, texts = self._correct(cfg, params, rng, self.n,
                                     SamplingParams(temperature=self.temperature))
      keys = None
      if self.task.answer_key is not None and self.ks:
        keys = [[self.task.answer_key(texts[e * self.n + s], row) for s in range(self.n)]
                for e, row in enumerate(self.rows)]
      metrics.update(sampled_metrics(sampled, keys, self.ks))
    return {self.prefix + k: v for k, v in metrics.items()}
