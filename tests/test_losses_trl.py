"""grpojax's loss options against TRL 1.16's own loss code, on random inputs.

Each TRL test runs `GRPOTrainer._compute_loss` itself (through
tests/trl_reference.py, in float64) and grpojax's `policy_loss` (float32) on the
same inputs, and compares the loss, its gradient w.r.t. the log-probs and the
entropies, and the metrics both log under the same name and definition. The
equivalence tests at the end need only grpojax.

Axes: N rows (completions), T completion positions, K reward functions.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.core import advantages as advantages_lib
from grpojax.core import losses
from grpojax.core.losses import LossConfig

# Float32 against float64: the loss and metrics agree to 1e-5 (relative when
# large); gradients are ~1/(N*T) in size, so their absolute slack is tighter.
RTOL, ATOL, GRAD_ATOL = 1e-5, 1e-5, 1e-6

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# IS bounds that clip some ratios and pass others: a token ratio is exp of one
# N(0, 0.3) gap, a sequence ratio exp of a sum of up to T of them, so the
# sequence bounds are wider.
IS_BOUNDS = {"token": (0.8, 1.25), "sequence": (0.5, 2.0)}


def level_of(mode):
  return mode.split("_")[0]


# Metrics grpojax logs under TRL's name with TRL's definition; TRL's name ->
# grpojax's. (TRL's policy_loss, entropy_coef, clip_ratio/low_min and
# clip_ratio/high_max have no grpojax counterpart.)
SHARED_METRICS = {k: k for k in (
    "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "vespo/phi_seq_mean",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")}
SHARED_METRICS["cispo_clip_ratio"] = "clip_ratio/high_mean"  # same test, TRL's cispo-only name

# LossConfig fields that are trl_reference.trl_loss arguments of the same name.
TRL_FIELDS = (
    "loss_type", "beta", "epsilon_low", "epsilon_high", "delta", "importance_sampling_level",
    "importance_sampling_correction", "importance_sampling_mode", "importance_sampling_clip_min",
    "importance_sampling_clip_max", "off_policy_mask_threshold", "top_entropy_quantile",
    "use_bias_correction_kl", "entropy_coef", "sapo_tau_pos", "sapo_tau_neg", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "max_completion_length")


@pytest.fixture(scope="module")
def trl_ref():
  pytest.importorskip("torch")
  pytest.importorskip("trl")
  import trl_reference
  return trl_reference


class Batch(NamedTuple):
  logps: np.ndarray  # [N, T]
  old: np.ndarray  # [N, T] logps + N(0, 0.3)
  sampler: np.ndarray  # [N, T] old + N(0, 0.3)
  ref: np.ndarray  # [N, T] logps + N(0, 0.3)
  entropy: np.ndarray  # [N, T] uniform, so no ties
  adv: np.ndarray  # [N]
  mask: np.ndarray  # [N, T] ragged, row 0 full: the completion mask (the tokens exist)
  tool: np.ndarray | None = None  # [N, T] TRL's tool_mask: 0 on untrained tokens in rows

  @property
  def loss_mask(self) -> np.ndarray:
    """[N, T] the tokens trained: TRL's completion_mask * tool_mask, grpojax's loss_mask."""
    return self.mask if self.tool is None else self.mask * self.tool


def _batch(seed, *, empty_row=False, shape=(7, 6), tool=False) -> Batch:
  # One shape for most tests: eager JAX compiles every op once per shape, and
  # each extra shape costs the file seconds; test_other_shapes varies it.
  rng = np.random.default_rng(seed)
  n, t = shape
  logps = -rng.uniform(0.1, 3.0, size=(n, t))
  old = logps + rng.normal(scale=0.3, size=(n, t))
  sampler = old + rng.normal(scale=0.3, size=(n, t))
  ref = logps + rng.normal(scale=0.3, size=(n, t))
  entropy = rng.uniform(0.05, 3.0, size=(n, t))
  adv = rng.normal(size=n)
  lengths = rng.integers(1, t + 1, size=n)
  lengths[0] = t
  if empty_row:
    lengths[-1] = 0
  tool_mask = None
  if tool:
    # A tool-response-like run of untrained tokens inside each row long enough to
    # hold one with the policy's tokens on both sides, and a last row whose every
    # token is untrained (yet exists). TRL pads its tool_mask with 1s.
    lengths[-1] = max(lengths[-1], 2)
    tool_mask = np.ones((n, t))
    for i, length in enumerate(lengths[:-1]):
      if length >= 3:
        start = rng.integers(1, length - 1)
        tool_mask[i, start:rng.integers(start + 1, length)] = 0
    tool_mask[-1, :lengths[-1]] = 0
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
  f32 = lambda x: None if x is None else x.astype(np.float32)
  return Batch(*map(f32, (logps, old, sampler, ref, entropy, adv, mask, tool_mask)))


class Result(NamedTuple):
  loss: float
  grad_logps: np.ndarray
  grad_entropies: np.ndarray
  metrics: dict


def _grpojax(cfg, b, *, on_policy=False, sampler=False, num_items_in_batch=None) -> Result:
  """policy_loss on b (float32), with its gradient w.r.t. logps and entropy."""
  old = None if on_policy else jnp.asarray(b.old)
  ref = jnp.asarray(b.ref) if cfg.beta > 0 else None
  sampler_logps = jnp.asarray(b.sampler) if sampler else None

  def f(logps, entropy):
    return losses.policy_loss(logps, old, jnp.asarray(b.adv), jnp.asarray(b.loss_mask), config=cfg,
                              ref_logps=ref, num_items_in_batch=num_items_in_batch,
                              entropy=entropy, sampler_logps=sampler_logps)

  (loss, metrics), (g_lp, g_ent) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      jnp.asarray(b.logps), jnp.asarray(b.entropy))
  return Result(float(loss), np.asarray(g_lp), np.asarray(g_ent),
                {k: float(v) for k, v in metrics.items()})


def _trl(trl_ref, cfg, b, *, on_policy=False, sampler=False, num_items_in_batch=None) -> Result:
  """TRL's _compute_loss on the same inputs and options."""
  r = trl_ref.trl_loss(
      logps=b.logps, advantages=b.adv, mask=b.mask, tool_mask=b.tool, entropies=b.entropy,
      old_logps=None if on_policy else b.old,
      ref_logps=b.ref if cfg.beta > 0 else None,
      sampler_logps=b.sampler if sampler else None,
      num_items_in_batch=num_items_in_batch,
      **{k: getattr(cfg, k) for k in TRL_FIELDS})
  return Result(*r)


def _check(trl_ref, cfg, b, *, unshared=(), **kw) -> tuple[Result, Result]:
  """Runs both and asserts they agree; returns (grpojax, trl). unshared: TRL
  metrics left out of the comparison (each use says why)."""
  assert cfg.kl_estimator == "k3"  # TRL's only estimator
  ours, theirs = _grpojax(cfg, b, **kw), _trl(trl_ref, cfg, b, **kw)
  np.testing.assert_allclose(ours.loss, theirs.loss, rtol=RTOL, atol=ATOL, err_msg="loss")
  np.testing.assert_allclose(ours.grad_logps, theirs.grad_logps, rtol=RTOL, atol=GRAD_ATOL,
                             err_msg="d loss / d logps")
  np.testing.assert_allclose(ours.grad_entropies, theirs.grad_entropies, rtol=RTOL,
                             atol=GRAD_ATOL, err_msg="d loss / d entropies")
  for name, value in theirs.metrics.items():
    if name in SHARED_METRICS and name not in unshared:
      ours_name = SHARED_METRICS[name]
      assert ours_name in ours.metrics, f"TRL logs {name}; grpojax has no {ours_name}"
      np.testing.assert_allclose(ours.metrics[ours_name], value, rtol=RTOL, atol=ATOL,
                                 err_msg=f"metric {name}")
  # Guards against comparing two zeros: every case here has a live gradient,
  # and off-policy the clip range bites.
  assert np.abs(theirs.grad_logps).max() > 1e-4
  if not kw.get("on_policy"):
    assert theirs.metrics.get("clip_ratio/region_mean", 1.0) > 0
  return ours, theirs


def _cfg(loss_type, **kw):
  if loss_type == "cispo":
    kw.setdefault("epsilon_high", 5.0)
  if kw.get("importance_sampling_level") == "sequence":
    # A sequence ratio is exp of a mean of T log-ratios, far nearer 1 than a
    # token's: a GSPO-sized clip range makes the clipping (and its metrics) bite.
    kw.setdefault("epsilon_low", 0.05)
  return LossConfig(loss_type=loss_type, **kw)


# --- the harness itself ------------------------------------------------------------


def test_transcriptions_are_trls_lines(trl_ref):
  """The IS ratio (grpo_trainer.py 2660-2707, metrics 2860-2896) and GDPO
  (2759, 2790-2799, 2810) blocks of trl_reference are TRL's own lines."""
  assert trl_ref.transcription_lines_missing_from_trl() == []


def test_defaults_match_trl():
  """LossConfig's defaults are GRPOConfig's (trl/trainer/grpo_config.py)."""
  trl = pytest.importorskip("trl")
  trl_defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
  ours = LossConfig()
  pairs = {
      "loss_type": "loss_type", "epsilon_low": "epsilon", "epsilon_high": "epsilon_high",
      "delta": "delta", "beta": "beta", "importance_sampling_level": "importance_sampling_level",
      "sapo_tau_pos": "sapo_temperature_pos", "sapo_tau_neg": "sapo_temperature_neg",
      "use_bias_correction_kl": "use_bias_correction_kl",
      "importance_sampling_mode": "vllm_importance_sampling_mode",
      "importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
      "importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
      "off_policy_mask_threshold": "off_policy_mask_threshold",
      "top_entropy_quantile": "top_entropy_quantile", "entropy_coef": "entropy_coef",
      "mask_truncated_completions": "mask_truncated_completions",
      **{k: k for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
  }
  for ours_name, trl_name in pairs.items():
    assert getattr(ours, ours_name) == trl_defaults[trl_name], (ours_name, trl_name)
  # Deliberately different: TRL's default (True) is about vLLM's sampler; a
  # grpojax run whose sampler is its own model has no mismatch to correct.
  assert trl_defaults["vllm_importance_sampling_correction"] is True
  assert ours.importance_sampling_correction is False


# --- sampler/trainer importance sampling -------------------------------------------


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", IS_MODES)
def test_importance_sampling_correction(trl_ref, mode, level, loss_type):
  """vLLM IS ratio (grpo_trainer.py 2660-2707, transcribed) applied in
  `_compute_loss` 3146-3147, after the policy loss and masks, before the KL."""
  b = _batch(20)
  lo, hi = IS_BOUNDS[level_of(mode)]
  gap = (b.old - b.sampler) * b.mask
  raw = np.exp(gap.sum(-1)) if level_of(mode) == "sequence" else np.exp(gap[b.mask > 0])
  assert ((raw < lo) | (raw > hi)).any() and ((raw > lo) & (raw < hi)).any()  # bounds bite, not all
  cfg = _cfg(loss_type, importance_sampling_level=level, importance_sampling_correction=True,
             importance_sampling_mode=mode, importance_sampling_clip_min=lo,
             importance_sampling_clip_max=hi)
  _check(trl_ref, cfg, b, sampler=True)


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_importance_sampling_default_bounds(trl_ref, mode, on_policy):
  """TRL's default bounds (clip_min None, clip_max 3; grpo_config.py), on- and
  off-policy (on-policy TRL still has old log-probs: the policy's values)."""
  cfg = _cfg("dapo", importance_sampling_correction=True, importance_sampling_mode=mode)
  _check(trl_ref, cfg, _batch(2), sampler=True, on_policy=on_policy)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_importance_sampling_lower_bound_only(trl_ref, mode):
  """clip_max None: only C_min acts (grpo_config.py, vllm_importance_sampling_clip_min)."""
  cfg = _cfg("dapo", importance_sampling_correction=True, importance_sampling_mode=mode,
             importance_sampling_clip_min=IS_BOUNDS[level_of(mode)][0],
             importance_sampling_clip_max=None)
  _check(trl_ref, cfg, _batch(20), sampler=True)


# --- off-policy sequence mask ------------------------------------------------------


def _mid_threshold(b, ref_logps):
  """A threshold between two negative-advantage rows' mean KL(ref || policy)
  (k1, so it can be negative; thresholds must be >= 0), so the mask drops
  some rows and keeps others, none on the edge."""
  kl = ((ref_logps - b.logps) * b.loss_mask).sum(-1) / np.maximum(b.loss_mask.sum(-1), 1)
  neg = np.sort(kl[b.adv < 0].astype(np.float64))
  mids = [(x + y) / 2 for x, y in zip(neg[:-1], neg[1:]) if (x + y) / 2 > 0]
  assert mids, f"no positive threshold splits these rows' KLs {neg}"
  return float(mids[len(mids) // 2])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("with_sampler", [True, False])
def test_off_policy_mask(trl_ref, with_sampler, level):
  """GRPOTrainer.get_off_policy_mask (grpo_trainer.py 2944-2969), fed the
  sampler's log-probs when present, else the old ones (3068-3081)."""
  b = _batch(3)
  threshold = _mid_threshold(b, b.sampler if with_sampler else b.old)
  for loss_type in ("dapo", "grpo"):
    cfg = _cfg(loss_type, off_policy_mask_threshold=threshold, importance_sampling_level=level)
    _check(trl_ref, cfg, b, sampler=with_sampler)
  # The mask bites: the loss without it differs.
  assert abs(_grpojax(_cfg("dapo"), b).loss - _grpojax(
      _cfg("dapo", off_policy_mask_threshold=threshold), b, sampler=with_sampler).loss) > 1e-4


def test_off_policy_mask_on_policy(trl_ref):
  """On-policy without a sampler TRL measures the policy against itself
  (grpo_trainer.py 3066 and 3073: the fallback is old, on-policy
  per_token_logps.detach()), so nothing is dropped; with the sampler's
  log-probs, rows are."""
  b = _batch(4)
  _check(trl_ref, _cfg("dapo", off_policy_mask_threshold=0.0), b, on_policy=True)
  threshold = _mid_threshold(b, b.sampler)
  _check(trl_ref, _cfg("dapo", off_policy_mask_threshold=threshold), b, on_policy=True,
         sampler=True)


# --- high-entropy token mask and entropy bonus -------------------------------------


def _check_quantile_position(b, quantile):
  # torch.quantile interpolates at (1 - q) * (n - 1), in float32; keep that
  # position off integers that rounding could put it an ulp either side of
  # (q = 0, 0.5 and 1 give exact positions).
  pos = (1 - quantile) * (b.loss_mask.sum() - 1)
  assert quantile in (0.0, 0.5, 1.0) or abs(pos - round(pos)) > 1e-3, pos


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5])
def test_top_entropy_quantile(trl_ref, quantile, loss_type):
  """GRPOTrainer.get_high_entropy_mask (grpo_trainer.py 1380-1416) with
  threshold 1 - top_entropy_quantile (3049-3052), applied at 3143-3144."""
  b = _batch(5)
  _check_quantile_position(b, quantile)
  _check(trl_ref, _cfg(loss_type, top_entropy_quantile=quantile), b)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("quantile", [1.0, 0.2])
def test_entropy_bonus(trl_ref, quantile, loss_type):
  """The entropy bonus (grpo_trainer.py 3186-3211): minus entropy_coef times the
  mean entropy over the tokens the policy loss keeps, whatever the loss type."""
  b = _batch(6)
  _check_quantile_position(b, quantile)
  ours, _ = _check(trl_ref, _cfg(loss_type, entropy_coef=0.05, top_entropy_quantile=quantile), b)
  assert np.abs(ours.grad_entropies).max() > 1e-4
  assert (ours.grad_entropies <= 0).all()  # a bonus: more entropy, lower loss


# --- KL to the reference -----------------------------------------------------------


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_kl_bias_correction(trl_ref, bias_correction, level, on_policy):
  """k3 KL (grpo_trainer.py 3097-3105), times the differentiable ratio coef_1
  with use_bias_correction_kl, added after the masks (3149-3150)."""
  cfg = _cfg("dapo", beta=0.04, use_bias_correction_kl=bias_correction,
             importance_sampling_level=level)
  _check(trl_ref, cfg, _batch(7), on_policy=on_policy)


# --- LUSPO and VESPO ---------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["sequence", "token"])
def test_luspo(trl_ref, level, beta):
  """luspo: the clipped surrogate (grpo_trainer.py 3112-3120) summed over each
  row's tokens, mean over rows (3175-3182)."""
  _check(trl_ref, _cfg("luspo", importance_sampling_level=level, beta=beta), _batch(8))


@pytest.mark.parametrize("mode", [None, *IS_MODES])
def test_vespo(trl_ref, mode):
  """GRPOTrainer.get_gamma_weights (grpo_trainer.py 2970-3018, no_grad: phi only
  scales the gradient), -phi A logp (3125-3136); with the IS correction the
  ratio goes into phi, not onto the loss (3146)."""
  b = _batch(9)
  kw = {}
  if mode is not None:
    lo, hi = IS_BOUNDS[level_of(mode)]
    kw = dict(importance_sampling_correction=True, importance_sampling_mode=mode,
              importance_sampling_clip_min=lo, importance_sampling_clip_max=hi)
  _check(trl_ref, _cfg("vespo", **kw), b, sampler=mode is not None)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vespo_on_policy_with_kl(trl_ref, level):
  """vespo on-policy (phi(1) = 1: REINFORCE) with the bias-corrected KL."""
  _check(trl_ref, _cfg("vespo", beta=0.04, importance_sampling_level=level), _batch(10),
         on_policy=True)


# --- the existing loss types, all defaults -----------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_existing_losses_with_defaults(trl_ref, loss_type):
  """grpo_trainer.py 3109-3124 (per-token losses) and 3152-3184 (normalisers),
  with the default use_bias_correction_kl=True and beta > 0; dr_grpo with a
  max_completion_length above T, dapo and cispo with a generation batch larger
  than this one."""
  b = _batch(11)
  kw = {"max_completion_length": b.mask.shape[1] + 2} if loss_type == "dr_grpo" else {}
  cfg = _cfg(loss_type, beta=0.04, **kw)
  assert cfg.use_bias_correction_kl
  _check(trl_ref, cfg, b, num_items_in_batch=b.mask.sum() + 9)
  _check(trl_ref, cfg, b, on_policy=True)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_delta_two_sided_clip(trl_ref, loss_type):
  """delta caps the unclipped ratio (grpo_trainer.py 3115-3116)."""
  _check(trl_ref, _cfg(loss_type, delta=1.3, epsilon_high=0.28), _batch(12))


def test_delta_inside_the_clip_range(trl_ref):
  """delta = 1.1 < 1 + epsilon_high: the loss still agrees, but TRL counts
  clip_ratio/high_* on the ratio already capped at delta (coef_1 is reassigned
  at grpo_trainer.py 3115-3116, before the metrics at 3272-3279), so it never
  sees a ratio above 1.28; grpojax counts the uncapped ratio. Left out."""
  _check(trl_ref, _cfg("dapo", delta=1.1, epsilon_high=0.28), _batch(12),
         unshared=("clip_ratio/high_mean", "clip_ratio/region_mean"))


# --- everything at once ------------------------------------------------------------


COMBINED = dict(beta=0.04, importance_sampling_correction=True, importance_sampling_clip_min=0.5,
                importance_sampling_clip_max=2.0, top_entropy_quantile=0.5, entropy_coef=0.02)


@pytest.mark.parametrize("loss_type,level,mode", [
    ("grpo", "token", "sequence_mask"), ("bnpo", "token", "token_truncate"),
    ("dr_grpo", "token", "token_mask"), ("dapo", "token", "sequence_truncate"),
    ("dapo", "sequence", "token_mask"), ("cispo", "token", "sequence_mask"),
    ("sapo", "token", "token_truncate"), ("luspo", "sequence", "sequence_mask"),
    ("vespo", "token", "token_mask"), ("vespo", "sequence", "sequence_truncate"),
    ("grpo", "sequence", "token_truncate")])
def test_all_options_together(trl_ref, loss_type, level, mode):
  """IS correction, off-policy mask, high-entropy mask, KL and entropy bonus at
  once: TRL's order (grpo_trainer.py 3140-3150): loss x off-policy mask x
  entropy mask x IS ratio + beta KL."""
  b = _batch(13)
  _check_quantile_position(b, COMBINED["top_entropy_quantile"])
  cfg = _cfg(loss_type, importance_sampling_level=level, importance_sampling_mode=mode,
             off_policy_mask_threshold=_mid_threshold(b, b.sampler), **COMBINED)
  _check(trl_ref, cfg, b, sampler=True)


@pytest.mark.parametrize("shape", [(8, 5)])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_other_shapes(trl_ref, loss_type, shape):
  """All options at once on another batch shape than _batch's default."""
  b = _batch(22, shape=shape)
  _check_quantile_position(b, COMBINED["top_entropy_quantile"])
  cfg = _cfg(loss_type, importance_sampling_mode="token_mask",
             off_policy_mask_threshold=_mid_threshold(b, b.sampler), **COMBINED)
  _check(trl_ref, cfg, b, sampler=True)


# TRL metrics with one value per row ([N, 1]: sequence-level clip ratios,
# vespo's phi), which TRL's global_masked_mean (grpo_trainer.py 3259-3265)
# averages over all N rows, empty ones included, and grpojax over the
# non-empty rows: they differ when a row is empty.
ROW_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
               "vespo/phi_seq_mean")
EMPTY_ROW_CASES = [("grpo", "token"), ("dapo", "token"), ("luspo", "sequence"),
                   ("vespo", "token"), ("grpo", "sequence")]


def _empty_row_case(loss_type, level):
  b = _batch(21, empty_row=True)
  _check_quantile_position(b, COMBINED["top_entropy_quantile"])
  cfg = _cfg(loss_type, importance_sampling_level=level, importance_sampling_mode="sequence_mask",
             off_policy_mask_threshold=_mid_threshold(b, b.sampler), **COMBINED)
  return cfg, b


@pytest.mark.parametrize("loss_type,level", EMPTY_ROW_CASES)
def test_all_options_with_an_empty_row(trl_ref, loss_type, level):
  """As above with one all-masked row (what mask_truncated_completions makes of
  a truncated completion): it adds nothing to the loss and counts in no
  normaliser. Row metrics: see the next test."""
  cfg, b = _empty_row_case(loss_type, level)
  row_level = level == "sequence" or loss_type == "vespo"
  _check(trl_ref, cfg, b, sampler=True, unshared=ROW_METRICS if row_level else ())


@pytest.mark.xfail(strict=True, reason="TRL averages per-row metrics over empty rows too")
@pytest.mark.parametrize("loss_type,level", [("vespo", "token"), ("grpo", "sequence")])
def test_row_metrics_with_an_empty_row(trl_ref, loss_type, level):
  """A known difference, kept visible: with an empty row TRL's vespo/phi_seq_mean
  and sequence-level clip_ratio/* count it (phi 1, not clipped) in their mean
  over N rows; grpojax's mean is over the N - 1 rows with tokens."""
  cfg, b = _empty_row_case(loss_type, level)
  _check(trl_ref, cfg, b, sampler=True)


# --- untrained tokens inside completions (TRL's tool_mask) --------------------------


# Every loss type TRL 1.16 has (grpo_config.py, loss_type), token level, and GSPO
# (importance_sampling_level="sequence") for each aggregation family.
TOOL_CASES = [(t, "token") for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo",
                                     "luspo", "vespo")]
TOOL_CASES += [(t, "sequence") for t in ("grpo", "dapo", "luspo", "vespo")]
TOOL_OPTIONS = {
    "kl_and_entropy_bonus": dict(beta=0.04, entropy_coef=0.02),
    "everything": dict(COMBINED, importance_sampling_mode="token_mask"),
}


def _worst_error(ours: Result, theirs: Result, unshared=()) -> float:
  """The largest absolute difference over the loss, both gradients and the shared metrics."""
  errors = [abs(ours.loss - theirs.loss), np.abs(ours.grad_logps - theirs.grad_logps).max(),
            np.abs(ours.grad_entropies - theirs.grad_entropies).max()]
  errors += [abs(ours.metrics[SHARED_METRICS[k]] - v) for k, v in theirs.metrics.items()
             if k in SHARED_METRICS and k not in unshared]
  return float(max(errors))


@pytest.mark.parametrize("options", list(TOOL_OPTIONS))
@pytest.mark.parametrize("loss_type,level", TOOL_CASES)
def test_untrained_tokens_inside_rows_as_trls_tool_mask(trl_ref, loss_type, level, options):
  """Tokens that exist but are not trained (a tool's response inside a completion)
  are TRL's tool_mask: _compute_loss reads completion_mask * tool_mask everywhere
  (grpo_trainer.py 3027: losses, sequence ratio, KL, entropy mask and bonus,
  every normaliser and metric), num_items_in_batch counts it (2497-2498), and so
  does the IS ratio (2661, 2862). grpojax gets the product as its loss mask."""
  b = _batch(48, tool=True)
  assert ((b.mask > 0) & (b.tool == 0)).sum(-1)[:-1].any()  # interior untrained runs
  assert b.mask[-1].any() and not b.loss_mask[-1].any()  # a row that exists, all untrained
  kw = dict(TOOL_OPTIONS[options])
  if "top_entropy_quantile" in kw:
    _check_quantile_position(b, kw["top_entropy_quantile"])
    kw["off_policy_mask_threshold"] = _mid_threshold(b, b.sampler)
  cfg = _cfg(loss_type, importance_sampling_level=level, **kw)
  # The all-untrained row is an empty row to the loss: TRL's per-row metrics count
  # it, grpojax's do not (test_row_metrics_with_an_empty_row).
  unshared = ROW_METRICS if level == "sequence" or loss_type == "vespo" else ()
  with_sampler = cfg.importance_sampling_correction
  ours, theirs = _check(trl_ref, cfg, b, unshared=unshared, sampler=with_sampler)
  assert _worst_error(ours, theirs, unshared) <= 1e-5
  untrained = b.loss_mask == 0
  assert not ours.grad_logps[untrained].any() and not ours.grad_entropies[untrained].any()
  assert not theirs.grad_logps[untrained].any()
  # The tool mask bites: the same rows trained whole give another loss.
  whole = _grpojax(cfg, b._replace(tool=None), sampler=with_sampler)
  assert abs(whole.loss - ours.loss) > 1e-4


# --- GDPO advantages ---------------------------------------------------------------


def _gdpo_rewards(seed, n_groups=3, group_size=4, k=3):
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(n_groups * group_size, k)).astype(np.float32)
  r[:, 1] = rng.integers(0, 2, size=n_groups * group_size)  # a 0/1 verifier
  r[rng.uniform(size=r.shape) < 0.2] = np.nan  # functions that returned None
  r[5] = np.nan  # a row no function could score
  return r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gdpo_advantages(trl_ref, seed):
  """TRL's multi_objective_aggregation="normalize_then_sum" (grpo_trainer.py
  2759, 2790-2799, 2810; transcribed), NaN entries and an unscorable row included."""
  rewards = _gdpo_rewards(seed)
  weights = np.array([1.0, 0.5, 2.0], np.float32)
  theirs = trl_ref.gdpo_advantages(rewards, 4, weights).numpy()
  ours = advantages_lib.get_advantage_fn("gdpo")(jnp.asarray(rewards), 4,
                                                 weights=jnp.asarray(weights), eps=1e-4)
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=RTOL, atol=ATOL)
  assert theirs[5] == 0.0


def test_gdpo_edge_groups(trl_ref):
  """Groups TRL treats specially: a function with one verdict in its group
  (nanstd is NaN there, so nansum drops it), a row whose every verdict is such
  a singleton (reward 0, yet scorable), a constant group (std 0), K = 1."""
  nan = np.nan
  rewards = np.array([
      [1.0, nan], [0.0, 2.0], [1.0, nan], [nan, nan],  # fn 1 has a single verdict
      [3.0, nan], [nan, 1.0], [nan, nan], [nan, nan],  # rows 4, 5: singletons only
      [2.0, 2.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0],  # constant
  ], np.float32)
  weights = np.array([1.0, 3.0], np.float32)
  theirs = trl_ref.gdpo_advantages(rewards, 4, weights).numpy()
  ours = advantages_lib.get_advantage_fn("gdpo")(jnp.asarray(rewards), 4,
                                                 weights=jnp.asarray(weights), eps=1e-4)
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=RTOL, atol=ATOL)
  one = rewards[:, :1]
  np.testing.assert_allclose(
      np.asarray(advantages_lib.get_advantage_fn("gdpo")(
          jnp.asarray(one), 4, weights=jnp.ones(1), eps=1e-4)),
      trl_ref.gdpo_advantages(one, 4, np.ones(1)).numpy(), rtol=RTOL, atol=ATOL)


# --- equivalences (grpojax only) ---------------------------------------------------


def _value_and_grads(cfg, b, **kw):
  r = _grpojax(cfg, b, **kw)
  return r.loss, r.grad_logps, r.grad_entropies


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo"])
@pytest.mark.parametrize("mode", IS_MODES)
def test_is_correction_without_mismatch_is_a_no_op(mode, loss_type):
  """Sampler log-probs equal to the trainer's: every ratio is exp(0) = 1, inside
  any bounds, so the corrected loss is the uncorrected one, bit for bit."""
  b = _batch(15)
  plain = _cfg(loss_type, beta=0.04)
  corrected = dataclasses.replace(plain, importance_sampling_correction=True,
                                  importance_sampling_mode=mode, importance_sampling_clip_min=0.5)
  for on_policy in (False, True):
    same = b._replace(sampler=b.logps if on_policy else b.old)
    expected = _value_and_grads(plain, same, on_policy=on_policy)
    got = _value_and_grads(corrected, same, on_policy=on_policy, sampler=True)
    for g, e in zip(got, expected):
      np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("with_sampler", [False, True])
def test_off_policy_mask_with_huge_threshold_is_a_no_op(with_sampler):
  """A threshold no row's mean KL reaches drops nothing: the mask is all ones."""
  b = _batch(16)
  expected = _value_and_grads(_cfg("grpo"), b)
  got = _value_and_grads(_cfg("grpo", off_policy_mask_threshold=1e9), b, sampler=with_sampler)
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(g, e)


def test_top_entropy_quantile_one_is_off():
  """q = 1 keeps every token (TRL skips the mask); passing entropies then only
  feeds the metric."""
  b = _batch(17)
  cfg = _cfg("dapo", beta=0.04, top_entropy_quantile=1.0)
  with_entropy = _grpojax(cfg, b)
  old, adv, mask, ref = (jnp.asarray(x) for x in (b.old, b.adv, b.mask, b.ref))
  f = lambda lp: losses.policy_loss(lp, old, adv, mask, config=cfg, ref_logps=ref)[0]
  loss, grad = jax.value_and_grad(f)(jnp.asarray(b.logps))
  assert with_entropy.loss == float(loss)
  np.testing.assert_array_equal(with_entropy.grad_logps, np.asarray(grad))
  assert not with_entropy.grad_entropies.any()
