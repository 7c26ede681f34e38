"""TRL 1.16's GRPO loss run on given tensors, without a model: the reference
that tests/test_losses_trl.py compares grpojax's losses with.

Axes: N rows (completions), T completion positions, K reward functions.

`trl_loss` calls TRL's own `GRPOTrainer._compute_loss` on a trainer built
without `__init__`, with the forward pass replaced by the log-probs and
entropies we give it. Two pieces TRL computes in
`_generate_and_score_completions` (which needs a model, a sampler and reward
functions) are transcribed instead: the vLLM importance-sampling ratio with
its metrics, and the `normalize_then_sum` (GDPO) advantages. Their lines
between `# TRL>` and `# <TRL` are TRL's statements verbatim, in TRL's order
(re-indented, comments dropped); `transcription_lines_missing_from_trl`
checks that each is a line of TRL's source, so a TRL that changes one fails
the test instead of silently drifting (a line TRL adds goes unnoticed).
"""

from __future__ import annotations

import collections
import inspect
import math
import types
from typing import NamedTuple

import numpy as np
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin, nanstd

# The reference's own rounding stays far below the 1e-5 the tests allow.
DTYPE = torch.float64


def _t(x, dtype=DTYPE):
  return None if x is None else torch.as_tensor(np.asarray(x), dtype=dtype)


class _Accelerator:
  """One process: every collective is the identity."""

  num_processes = 1
  process_index = 0
  sync_gradients = True
  is_main_process = True

  def gather(self, x):
    return x

  def gather_for_metrics(self, x):
    return x

  def reduce(self, x, reduction="sum"):
    return x

  def pad_across_processes(self, x, dim=0, pad_index=0):
    return x


def _metrics_store():
  return collections.defaultdict(lambda: collections.defaultdict(list))


# --- the vLLM importance-sampling ratio ------------------------------------------


def importance_sampling_ratio(old_logps, sampler_logps, mask, is_mode, clip_min=None, clip_max=3.0,
                              tool_mask=None):
  """TRL's vLLM IS ratio and the metrics it logs with it.

  Mirrors trl/trainer/grpo_trainer.py (1.16.0) `_generate_and_score_completions`,
  lines 2660-2707 (the ratio) and 2860-2896 (its `sampling/*` metrics).

  Args:
    old_logps: [N, T] the trainer's log-probs of the sampled tokens.
    sampler_logps: [N, T] the sampler's (TRL: vLLM's) log-probs.
    mask: [N, T] completion mask.
    is_mode: token_truncate | token_mask | sequence_truncate | sequence_mask.
    tool_mask: [N, T] TRL's tool_mask (0 on tool-response tokens), or None.

  Returns:
    (ratio [N, T] for token_* modes or [N, 1] for sequence_*, float64;
     {metric name: float}).
  """
  # Named `self`, `mode`, `device`, `tool_mask` as in TRL so that the lines
  # below are TRL's text and can be checked against its source.
  self = types.SimpleNamespace(
      vllm_importance_sampling_mode=is_mode,
      vllm_importance_sampling_clip_min=clip_min,
      vllm_importance_sampling_clip_max=clip_max,
      accelerator=_Accelerator(),
      _metrics=_metrics_store(),
  )
  old_per_token_logps = _t(old_logps)
  sampling_per_token_logps = _t(sampler_logps)
  completion_mask = _t(mask, torch.long)
  tool_mask = _t(tool_mask, torch.long)
  device = "cpu"
  mode = "train"
  # TRL>
  mask = completion_mask if tool_mask is None else completion_mask * tool_mask
  per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
  per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)

  sequence_level_is = self.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]
  if sequence_level_is:
    per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    logps_diff = per_sequence_logps_diff
  else:
    logps_diff = per_token_logps_diff

  vllm_importance_sampling_ratio = torch.exp(logps_diff)

  if self.vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:
    vllm_importance_sampling_ratio = torch.clamp(
      vllm_importance_sampling_ratio,
      min=self.vllm_importance_sampling_clip_min,
      max=self.vllm_importance_sampling_clip_max,
    )
  elif self.vllm_importance_sampling_mode in ["sequence_mask", "token_mask"]:
    min_val = (
      self.vllm_importance_sampling_clip_min
      if self.vllm_importance_sampling_clip_min is not None
      else -math.inf
    )
    max_val = (
      self.vllm_importance_sampling_clip_max
      if self.vllm_importance_sampling_clip_max is not None
      else math.inf
    )

    invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (
      vllm_importance_sampling_ratio > max_val
    )
    vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(
      invalid_mis_mask, value=0.0
    )
  # <TRL
  else:
    raise ValueError(f"unknown importance sampling mode {is_mode!r}")
  # TRL>
  delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
  mask = completion_mask.bool() if tool_mask is None else (completion_mask * tool_mask).bool()
  delta = delta[mask & ~torch.isnan(delta)]
  mean_delta = torch.mean(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)
  max_delta = torch.max(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)
  self._metrics[mode]["sampling/sampling_logp_difference/mean"].append(
    self.accelerator.gather(mean_delta).mean().item()
  )
  self._metrics[mode]["sampling/sampling_logp_difference/max"].append(
    self.accelerator.gather(max_delta).max().item()
  )
  if sequence_level_is:
    flat_is_ratio = vllm_importance_sampling_ratio.flatten()
  else:
    flat_is_ratio = vllm_importance_sampling_ratio[mask]

  min_importance_sampling_ratio = (
    torch.min(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
  )
  mean_importance_sampling_ratio = (
    torch.mean(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
  )
  max_importance_sampling_ratio = (
    torch.max(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
  )
  self._metrics[mode]["sampling/importance_sampling_ratio/min"].append(
    nanmin(self.accelerator.gather(min_importance_sampling_ratio)).item()
  )
  self._metrics[mode]["sampling/importance_sampling_ratio/mean"].append(
    self.accelerator.gather(mean_importance_sampling_ratio).nanmean().item()
  )
  self._metrics[mode]["sampling/importance_sampling_ratio/max"].append(
    nanmax(self.accelerator.gather(max_importance_sampling_ratio)).item()
  )
  # <TRL
  return vllm_importance_sampling_ratio, {k: v[-1] for k, v in self._metrics[mode].items()}


# --- GDPO advantages (multi_objective_aggregation="normalize_then_sum") -----------


def gdpo_advantages(rewards_NK, num_generations, weights_K):
  """TRL's normalize_then_sum advantages: each reward function normalised within
  its group, weighted sum, then normalised over the batch.

  Mirrors trl/trainer/grpo_trainer.py (1.16.0) `_generate_and_score_completions`,
  lines 2759 (unscorable rows), 2790-2799 (normalize_then_sum) and 2810
  (advantages of unscorable rows set to 0).

  Args:
    rewards_NK: [N, K] rewards, NaN where a reward function returned None.
    num_generations: G, completions per prompt (groups contiguous).
    weights_K: [K] reward weights.

  Returns:
    [N] float64 advantages.
  """
  # `self` and `device` as in TRL, so the lines below are its text.
  self = types.SimpleNamespace(reward_funcs=[None] * np.shape(rewards_NK)[1],
                               reward_weights=_t(weights_K))
  rewards_per_func = _t(rewards_NK)
  device = "cpu"
  # TRL>
  unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
  grouped = rewards_per_func.view(-1, num_generations, len(self.reward_funcs))
  mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
  std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
  reward_k = (grouped - mean_k) / (std_k + 1e-4)
  reward_k = reward_k.view(-1, len(self.reward_funcs))
  rewards = (reward_k * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
  rewards[unscorable_mask] = torch.nan
  std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
  advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
  advantages = torch.nan_to_num(advantages, nan=0.0)
  # <TRL
  return advantages


def transcription_lines_missing_from_trl() -> list[str]:
  """Lines of the `# TRL>` ... `# <TRL` blocks above that are not, stripped of
  indentation, a line of TRL's `_generate_and_score_completions`."""
  trl_lines = {l.strip() for l in inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()}
  missing, inside, checked = [], False, 0
  for fn in (importance_sampling_ratio, gdpo_advantages):
    for line in inspect.getsource(fn).splitlines():
      s = line.strip()
      if s == "# TRL>":
        inside = True
      elif s == "# <TRL":
        inside = False
      elif inside and s and not s.startswith("#"):
        checked += 1
        if s not in trl_lines:
          missing.append(s)
  assert checked > 50, f"only {checked} transcribed lines found: markers lost?"
  return missing


# --- the loss ---------------------------------------------------------------------


class TrlResult(NamedTuple):
  loss: float
  grad_logps: np.ndarray  # [N, T] d loss / d per_token_logps
  grad_entropies: np.ndarray  # [N, T] d loss / d entropies (0 where they do not enter)
  metrics: dict  # what TRL logged, {name: float}, IS metrics included


def trl_loss(
    loss_type: str,
    logps,
    advantages,
    mask,
    *,
    old_logps=None,
    ref_logps=None,
    sampler_logps=None,
    entropies=None,
    num_items_in_batch=None,
    max_completion_length=None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    importance_sampling_correction: bool = False,
    importance_sampling_mode: str = "sequence_mask",
    importance_sampling_clip_min: float | None = None,
    importance_sampling_clip_max: float | None = 3.0,
    off_policy_mask_threshold: float | None = None,
    top_entropy_quantile: float = 1.0,
    use_bias_correction_kl: bool = True,
    entropy_coef: float = 0.0,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    tool_mask=None,
) -> TrlResult:
  """TRL's `GRPOTrainer._compute_loss` (grpo_trainer.py 3020-3290) on these inputs.

  Arguments follow grpojax's `policy_loss` and `LossConfig` (numpy arrays,
  [N, T] / [N]); computed in float64. old_logps None is on-policy, as in TRL
  (its `per_token_logps.detach()`), except with the IS correction, where TRL
  always has old log-probs: there they are `logps`' values. sampler_logps,
  when given, reaches TRL as `sampling_per_token_logps` (its off-policy mask
  prefers them) and with the correction the ratio is `importance_sampling_ratio`
  of (old, sampler). num_items_in_batch None is the mask's sum;
  max_completion_length None is T. tool_mask [N, T] (0 on tokens that exist but
  are not trained, TRL's multi-turn tool responses), when given, reaches TRL as
  `inputs["tool_mask"]`; num_items_in_batch None is then TRL's
  `(completion_mask * tool_mask).sum()` (grpo_trainer.py 2497-2498).
  """
  n, t = np.shape(logps)
  per_token_logps = _t(logps).requires_grad_(True)
  ent = _t(np.zeros((n, t)) if entropies is None else entropies).requires_grad_(True)
  completion_mask = _t(mask, torch.long)
  if num_items_in_batch is None:
    num_items_in_batch = np.sum(mask if tool_mask is None else np.multiply(mask, tool_mask))

  trainer = object.__new__(GRPOTrainer)
  trainer.args = types.SimpleNamespace(
      delta=delta,
      sapo_temperature_pos=sapo_tau_pos,
      sapo_temperature_neg=sapo_tau_neg,
      vespo_k_pos=vespo_k_pos,
      vespo_lambda_pos=vespo_lambda_pos,
      vespo_k_neg=vespo_k_neg,
      vespo_lambda_neg=vespo_lambda_neg,
      use_bias_correction_kl=use_bias_correction_kl,
      steps_per_generation=1,
      entropy_target=0.2,
  )
  trainer.loss_type = loss_type
  trainer.beta = beta
  trainer.epsilon_low = epsilon_low
  trainer.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
  trainer.importance_sampling_level = importance_sampling_level
  trainer.top_entropy_quantile = top_entropy_quantile
  trainer.off_policy_mask_threshold = off_policy_mask_threshold
  trainer.use_vllm = importance_sampling_correction
  trainer.vllm_importance_sampling_correction = importance_sampling_correction
  trainer.model = types.SimpleNamespace(training=True)
  trainer.current_gradient_accumulation_steps = 1
  trainer.max_completion_length = t if max_completion_length is None else max_completion_length
  trainer.accelerator = _Accelerator()
  trainer._metrics = _metrics_store()
  trainer.aux_loss_enabled = False
  trainer.entropy_coef = entropy_coef
  trainer.use_adaptive_entropy = False
  trainer._entropy_bonus_enabled = entropy_coef != 0.0
  # The forward pass, replaced: TRL asks for (log-probs, entropies, aux loss).
  trainer._get_per_token_logps_and_entropies = lambda *a, **k: (per_token_logps, ent, None)

  inputs = {
      "prompt_ids": torch.ones((n, 2), dtype=torch.long),
      "prompt_mask": torch.ones((n, 2), dtype=torch.long),
      "completion_ids": torch.ones((n, t), dtype=torch.long),
      "completion_mask": completion_mask,
      "advantages": _t(advantages),
      "num_items_in_batch": torch.tensor(float(num_items_in_batch), dtype=DTYPE),
  }
  is_metrics = {}
  if importance_sampling_correction:
    if sampler_logps is None:
      raise ValueError("importance_sampling_correction needs sampler_logps")
    old = logps if old_logps is None else old_logps
    inputs["old_per_token_logps"] = _t(old)
    inputs["importance_sampling_ratio"], is_metrics = importance_sampling_ratio(
        old, sampler_logps, mask, importance_sampling_mode,
        importance_sampling_clip_min, importance_sampling_clip_max, tool_mask=tool_mask)
  elif old_logps is not None:
    inputs["old_per_token_logps"] = _t(old_logps)
  if sampler_logps is not None:
    inputs["sampling_per_token_logps"] = _t(sampler_logps)
  if ref_logps is not None:
    inputs["ref_per_token_logps"] = _t(ref_logps)
  if tool_mask is not None:
    inputs["tool_mask"] = _t(tool_mask, torch.long)

  loss = trainer._compute_loss(trainer.model, inputs)
  loss.backward()
  grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
  metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
  metrics.update(is_metrics)
  return TrlResult(loss.item(), per_token_logps.grad.numpy(), grad_ent.numpy(), metrics)
