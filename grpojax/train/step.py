"""The update program, after the rollout (rollout.py): policy log-probs of the
rollout's completions, the policy loss, and optimizer steps over minibatches,
all in one jitted function. Read top to bottom: `update` scans `_optimizer_step`
over the minibatches; a step takes `_minibatch_grads` (micro-batch by
micro-batch), each of `_loss` over the rows' log-probs (`_logps_and_entropy`).

Axes: N = B*G rows (groups contiguous), P prompt length, T completion length,
D model width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from grpojax.core import losses, ppo
from grpojax.models.config import ModelConfig
from grpojax.train.rollout import Rollout, completion_logps, critic_values
from grpojax.train.state import TrainState, split_trainable

Array = jax.Array


def _minibatch_indices(rng, num_rows: int, group_size: int, minibatches: int,
                       num_iterations: int) -> Array:
  """[num_iterations * minibatches, rows per minibatch]: whole groups, reshuffled each pass."""
  groups = num_rows // group_size

  def one_pass(key):
    order = jax.random.permutation(key, groups)
    rows = order[:, None] * group_size + jnp.arange(group_size)[None]
    return rows.reshape(minibatches, -1)

  keys = jax.random.split(rng, num_iterations)
  return jax.vmap(one_pass)(keys).reshape(num_iterations * minibatches, -1)


@functools.partial(
    jax.jit,
    static_argnames=("loss_config", "group_size", "num_iterations", "minibatches", "temperature",
                     "chunk_size", "grad_accum_steps", "micro_batches"),
    donate_argnums=(0,),
)
def update(state: TrainState, rollout: Rollout, rng: Array, *, loss_config: losses.LossConfig,
           group_size: int, num_iterations: int = 1, minibatches: int = 1,
           temperature: float = 1.0, chunk_size: int = 1024,
           grad_accum_steps: int = 1, micro_batches: int = 1) -> tuple[TrainState, dict]:
  """`num_iterations` passes x `minibatches` optimizer steps on one rollout.

  Args:
    state: donated; the returned state replaces it.
    rollout: a Rollout with N rows; N / group_size groups split evenly into minibatches.
      The forward reads its mask, the loss and every normaliser its loss_mask.
    rng: this step's key (minibatch shuffling).
    loss_config: which loss and its hyperparameters.
    temperature: the sampling temperature (log-probs are of the tempered policy).
    grad_accum_steps: minibatch gradients the optimizer (optax.MultiSteps) averages
      into one step: the `optim.grad_accum_steps` that built `state.tx`.
    micro_batches: each minibatch's gradient is summed over this many
      micro-batches of whole groups, run one after another: the same loss and
      gradient as the whole minibatch (each part weighted as its aggregation
      says, see losses.Aggregation.part_weight), with activations for 1 /
      micro_batches of its rows. Not extra optimizer steps (that is `minibatches`).

  With PPO's critic (state.critic_params; the rollout's advantages [N, T], values and
  returns) each minibatch's loss is the policy's plus loss_config.vf_coef x the
  critic's clipped value loss (grpojax.core.ppo.value_loss), and one optimizer step
  moves both (state.trainable). With loss_config.kl_in_reward the KL is in the
  rollout's rewards already: the loss adds none (the `kl` metric is still reported).

  Returns:
    (new state, metrics averaged over the optimizer steps, plus the counts
    `nonfinite/loss`, `nonfinite/grads`, `nonfinite/params` of optimizer steps
    whose loss, gradients or updated parameters were not finite, and
    `nonfinite/skipped` of those dropped: such a step leaves parameters and
    optimizer state unchanged (with gradient accumulation, its micro-batch is
    left out and the accumulated step completes one micro-batch later).)
  """
  n = rollout.tokens.shape[0]
  if (n // group_size) % minibatches:
    raise ValueError(f"{n // group_size} groups do not split into {minibatches} minibatches")
  if (n // group_size // minibatches) % micro_batches:
    raise ValueError(f"{n // group_size // minibatches} groups per minibatch do not split into "
                     f"{micro_batches} micro-batches")
  if rollout.old_logps is None and (num_iterations > 1 or minibatches > 1):
    raise ValueError("off-policy updates (num_iterations or minibatches > 1) need old_logps")
  if rollout.loss_mask is None:  # no untrained tokens: every existing one is trained
    rollout = rollout.replace(loss_mask=rollout.mask)
  if (state.critic_params is None) != (rollout.returns is None):
    raise ValueError("PPO's critic needs both: a state with critic_params and a rollout with "
                     "values and returns (advantage.estimator=gae)")
  aggregation = losses.aggregation(loss_config.loss_type)
  u = _Settings(
      cfg=state.model_config, loss_config=loss_config, group_size=group_size,
      critic_cfg=state.critic_config if state.critic_params is not None else None,
      temperature=temperature, chunk_size=chunk_size, micro_batches=micro_batches,
      aggregation=aggregation,
      # MultiSteps averages accumulated gradients, which is right for per-minibatch
      # means; a loss already divided by the whole batch's tokens (dapo, cispo) must
      # be summed over them instead (as TRL does), or accumulating k shrinks it k-fold.
      grad_scale=float(grad_accum_steps) if aggregation.by_batch_tokens else 1.0,
      # dapo/cispo normalise by the whole generation batch's trained tokens (as TRL).
      num_items=jnp.sum(rollout.loss_mask).astype(jnp.float32),
      frozen=state.frozen or {})
  idx = _minibatch_indices(rng, n, group_size, minibatches, num_iterations)
  (trainable, opt_state), (metrics, counts) = jax.lax.scan(
      functools.partial(_optimizer_step, u, state.tx, rollout),
      (state.trainable, state.opt_state), idx)
  # One (value, 1) part per optimizer step: their mean, or min / max.
  metrics = losses.metric_values({k: (v, jnp.ones_like(v)) for k, v in metrics.items()})
  metrics.update(jax.tree.map(jnp.sum, counts))
  state = state.with_trainable(trainable)
  return state.replace(step=state.step + 1, opt_state=opt_state), metrics


@dataclasses.dataclass(frozen=True)
class _Settings:
  """What every part of one update reads: its static settings, the loss's aggregation,
  the gradient scale for accumulation, num_items, the generation batch's
  completion tokens ([] float32, traced), and LoRA's frozen base (traced; {} when
  the whole model trains): the forward's parameters are it plus the trained ones."""

  cfg: ModelConfig
  loss_config: losses.LossConfig
  group_size: int
  critic_cfg: ModelConfig | None  # PPO's critic, or None
  temperature: float
  chunk_size: int
  micro_batches: int
  aggregation: losses.Aggregation
  grad_scale: float
  num_items: Array
  frozen: dict

  @property
  def needs_entropy(self) -> bool:
    c = self.loss_config
    return c.top_entropy_quantile < 1.0 or c.entropy_coef > 0


def _rows(rollout: Rollout, rows: Array) -> Rollout:
  """The rollout's rows `rows` [n]."""
  return jax.tree.map(lambda x: x[rows], rollout)


def _logps_and_entropy(u: _Settings, trainable, mb: Rollout) -> tuple[Array, Array]:
  """[n, T] log-probs and entropies of mb's completions under the policy's part of
  `trainable`: the forward reads mask (every token that exists is attended to),
  never loss_mask."""
  params, _ = split_trainable(trainable)
  return completion_logps(u.cfg, {**u.frozen, **params}, mb.prompt_tokens, mb.prompt_mask,
                          mb.tokens, mb.mask, temperature=u.temperature,
                          chunk_size=u.chunk_size, with_entropy=True, group_size=u.group_size)


def _loss(u: _Settings, trainable, mb: Rollout, weight=1.0, entropy_threshold=None,
          entropy_tokens=None, value_weight=1.0) -> tuple[Array, dict]:
  """(weight x policy term - entropy_coef x bonus [+ vf_coef x value_weight x the
  critic's value loss], metrics) of the rows in mb."""
  logps, ent = _logps_and_entropy(u, trainable, mb)
  # The entropy keeps its gradient only for the entropy bonus.
  ent = ent if u.loss_config.entropy_coef > 0 else jax.lax.stop_gradient(ent)
  config = u.loss_config
  if config.kl_in_reward:  # the rollout's rewards hold beta x KL already
    config = dataclasses.replace(config, beta=0.0, kl_in_reward=False)
  policy, bonus, metrics = losses.loss_terms(
      logps, mb.old_logps, mb.advantages, mb.loss_mask, config=config,
      ref_logps=mb.ref_logps, num_items_in_batch=u.num_items, entropy=ent,
      sampler_logps=mb.sampler_logps, entropy_threshold=entropy_threshold,
      entropy_tokens=entropy_tokens)
  loss = weight * policy - config.entropy_coef * bonus
  if u.critic_cfg is not None:
    _, critic = split_trainable(trainable)  # with LoRA: adapters on the policy's base
    values = critic_values(u.critic_cfg, {**u.frozen, **critic}, mb.prompt_tokens,
                           mb.prompt_mask, mb.tokens, mb.mask, group_size=u.group_size)
    value_loss, clipfrac = ppo.value_loss(values, mb.values, mb.returns, mb.loss_mask,
                                          config.cliprange_value)
    loss = loss + config.vf_coef * value_weight * value_loss
    vmask = ppo.value_mask(mb.loss_mask)
    one = jnp.ones((), jnp.float32)
    metrics.update(jax.lax.stop_gradient({
        "value/loss": (value_loss, one), "value/clipfrac": (clipfrac, one),
        "value/mean": (jnp.sum(jnp.where(vmask != 0, values, 0)), jnp.sum(vmask)),
        "value/returns_mean": (jnp.sum(jnp.where(vmask != 0, mb.returns, 0)), jnp.sum(vmask))}))
  return loss, metrics


def _entropy_cut(u: _Settings, params, rollout: Rollout, parts: Array) -> tuple:
  """(the high-entropy threshold or None, the bonus's token count) over a whole
  minibatch (parts [micro_batches, rows]), from one forward of its micro-batches:
  each micro-batch's loss then uses the minibatch's, as one pass over it would."""
  mask = rollout.loss_mask[parts].reshape(-1, rollout.loss_mask.shape[-1]).astype(jnp.float32)
  if u.loss_config.top_entropy_quantile == 1.0:
    return None, jnp.sum(mask)

  def entropies(part_rows):
    return _logps_and_entropy(u, params, _rows(rollout, part_rows))[1]

  ent = jax.lax.stop_gradient(jax.lax.map(entropies, parts)).reshape(mask.shape)
  threshold = losses.entropy_quantile(ent, mask, u.loss_config.top_entropy_quantile)
  return threshold, jnp.sum((mask > 0) & (ent >= threshold))


def _minibatch_grads(u: _Settings, params, rollout: Rollout, rows: Array):
  """((loss, metrics), grads) of the minibatch `rows`, micro-batch by micro-batch."""
  if u.micro_batches == 1:
    (loss, metrics), grads = jax.value_and_grad(functools.partial(_loss, u), has_aux=True)(
        params, _rows(rollout, rows))
    return (loss, losses.metric_values(metrics)), grads
  whole = rollout.loss_mask[rows].astype(jnp.float32)
  # The value loss is a mean over the minibatch's critic slots: each part weighs its share.
  value_slots = jnp.maximum(jnp.sum(ppo.value_mask(whole)), 1.0)
  parts = rows.reshape(u.micro_batches, -1)  # whole groups: rows come group by group
  threshold, entropy_tokens = (_entropy_cut(u, params, rollout, parts) if u.needs_entropy
                               else (None, None))
  compute = _compute_copy(params, u.cfg.dtype)

  def micro(acc, part_rows):
    part = _rows(rollout, part_rows)
    w = u.aggregation.part_weight(part.loss_mask.astype(jnp.float32), whole)
    vw = jnp.sum(ppo.value_mask(part.loss_mask.astype(jnp.float32))) / value_slots
    (loss, metrics), grads = jax.value_and_grad(functools.partial(_loss, u), has_aux=True)(
        compute, part, w, threshold, entropy_tokens, vw)
    acc_loss, acc_grads = acc
    return (acc_loss + loss,
            jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)), metrics

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (loss, grads), metrics = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), parts)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return (loss, losses.metric_values(metrics)), grads


def _optimizer_step(u: _Settings, tx, rollout: Rollout, carry, rows: Array):
  """One optimizer step on the minibatch `rows`: (params, opt_state) -> the next, and
  (metrics, the non-finite counts); a non-finite step leaves both as they were."""
  params, opt_state = carry
  (loss, metrics), grads = _minibatch_grads(u, params, rollout, rows)
  if u.grad_scale != 1.0:
    grads = jax.tree.map(lambda g: g * u.grad_scale, grads)
  grad_norm = optax.global_norm(grads)  # NaN or inf if any gradient is

  def apply(params, opt_state):
    updates, new_opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state

  # The new weights' finiteness is one reduction over the optimizer's elementwise
  # pass (nothing stored), taken on a barrier's copy of the state so that XLA
  # cannot merge it with the pass below. That pass then knows `skip` and fuses
  # the select, writing in place into the donated state; selecting by a
  # finiteness read off the new weights themselves would hold a second copy of
  # the weights and both moments (3x the weights' bytes) at the peak.
  bad = {"loss": ~jnp.isfinite(loss), "grads": ~jnp.isfinite(grad_norm),
         "params": ~_all_finite(apply(*jax.lax.optimization_barrier((params, opt_state)))[0])}
  skip = bad["loss"] | bad["grads"] | bad["params"]
  # A non-finite step is dropped here, on device: the state stays as it was,
  # whatever the loop then does (stop or carry on), so no NaN ever reaches a
  # checkpoint, the next rollout or an export.
  keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
  new_params, new_opt_state = apply(params, opt_state)
  params = jax.tree.map(keep, new_params, params)
  opt_state = jax.tree.map(keep, new_opt_state, opt_state)
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm)
  counts = {f"nonfinite/{k}": v.astype(jnp.int32) for k, v in bad.items()}
  counts["nonfinite/skipped"] = skip.astype(jnp.int32)
  return (params, opt_state), (metrics, counts)


def _compute_copy(params: dict, dtype) -> dict:
  """The layers' stacked matrices ([L, ...]) in the compute dtype, once per minibatch.

  The forward casts each at its use anyway, so a gradient with respect to this
  copy is the same numbers, held in the compute dtype (not a float32 copy of the
  weights per micro-batch) until it is added to the float32 sum. A matrix used
  twice (the shared-prompt forward's prompt and completions) has its two parts
  added in the compute dtype first: one more rounding of a gradient already
  rounded to it. The embedding stays float32 (its gradient sums a token's every
  occurrence), as do norm scales and biases."""
  return {k: v.astype(dtype) if v.ndim >= 3 else v for k, v in params.items()}


def _all_finite(tree) -> Array:
  """[] bool: every element of every array in `tree` is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
