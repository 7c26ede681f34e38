"""TrainState: the policy's parameters, optimizer state, step, and the frozen reference.

Parameters are a flat {name: array} dict (grpojax.models.param_specs names) so
that every program is a pure function of explicit state. The reference copy
exists only when the KL penalty is on (loss.beta > 0), in its own dtype
(bfloat16 by default: it is only ever run forward).

With LoRA (models/lora.py) the trained `params` are the adapters alone, and
`frozen` holds the base model, in the compute dtype or quantised: the optimizer
sees only the adapters, and the KL reference is the base itself, adapters off.

PPO (advantage.estimator=gae) adds a critic: `critic_params`, a score model
(`critic_config`, head "score" with one label) trained beside the policy by the
same optimizer, as TRL's PPO trains its policy-and-value wrapper: the optimizer
state is over `trainable`, the policy's parameters and the critic's under
`CRITIC_PREFIX`, one flat dict (one global-norm clip over both). With LoRA the
critic is adapters of its own (the policy's rank and targets) and its score head on
the policy's frozen base: `critic_params` holds those alone, and the base is shared,
not copied (`critic_model_params`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from grpojax.models import lora as lora_lib
from grpojax.models import sharding as sharding_lib
from grpojax.models import transformer
from grpojax.models.config import ModelConfig
from grpojax.parallel import mesh as mesh_lib

Params = dict[str, jax.Array]
# The critic's parameter names in `TrainState.trainable` (and the optimizer state).
CRITIC_PREFIX = "critic/"


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32: GRPO steps done
  params: Params  # float32 master weights
  opt_state: optax.OptState
  ref_params: Params | None  # None when beta == 0, and with LoRA (the reference is `frozen`)
  frozen: Params | None  # LoRA's base model, never updated; None in full fine-tuning
  model_config: ModelConfig = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  # The reward models' parameters (rewards.models), frozen, read by the rollout's
  # scoring (grpojax.models.reward); not checkpointed: a resume loads them again.
  reward_params: tuple[Params, ...] | None = None
  # PPO's critic (advantage.estimator=gae): a score model's float32 parameters, or None.
  critic_params: Params | None = None
  critic_config: ModelConfig | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def trainable(self) -> Params:
    """What the optimizer updates: `params`, and the critic's under CRITIC_PREFIX."""
    if self.critic_params is None:
      return self.params
    return {**self.params, **{CRITIC_PREFIX + k: v for k, v in self.critic_params.items()}}

  def with_trainable(self, trainable: Params) -> "TrainState":
    """This state with `trainable` (as `.trainable` lays it out) as its parameters."""
    params, critic = split_trainable(trainable)
    return self.replace(params=params, critic_params=critic if self.critic_params is not None
                        else None)

  @property
  def critic_model_params(self) -> Params:
    """The critic's whole parameter dict: with LoRA the policy's frozen base under its
    own adapters and score head, else `critic_params`."""
    if self.critic_params is None or self.frozen is None:
      return self.critic_params
    return {**self.frozen, **self.critic_params}

  @property
  def model_params(self) -> Params:
    """The policy's whole parameter dict: the base and its adapters with LoRA, else params."""
    return self.params if self.frozen is None else {**self.frozen, **self.params}

  def reference(self) -> tuple[ModelConfig, Params] | None:
    """(config, parameters) of the KL reference: the reference copy in its own dtype, or
    with LoRA the frozen base (adapters off); None when the run keeps no reference."""
    if self.ref_params is not None:
      dtype = jnp.dtype(next(iter(self.ref_params.values())).dtype).name
      return self.model_config.replace(param_dtype=dtype, dtype=dtype), self.ref_params
    if self.frozen is not None:
      return self.model_config, self.frozen
    return None


def create_train_state(model_config: ModelConfig, params: Params, tx: optax.GradientTransformation,
                       *, with_reference: bool, ref_dtype: str = "bfloat16",
                       lora: lora_lib.LoraConfig | None = None, seed: int = 0,
                       release: bool = False) -> TrainState:
  """A fresh state. Parameters become float32 master weights; the policy still
  computes in `model_config.dtype`.

  Args:
    model_config: the model's config (static).
    params: initial parameters ({name: array}, possibly sharded: shardings are kept).
    tx: the optax transformation.
    with_reference: keep a frozen copy as the KL reference (only when beta > 0).
    ref_dtype: the reference copy's dtype.
    lora: with rank > 0, `params` become the frozen base (in the compute dtype, or
      quantised) and fresh float32 adapters are trained; the base is the reference.
    seed: the adapters' initialisation.
    release: LoRA only: the caller gives `params` up, and the base is made from them in
      place (lora.frozen_base): no copy, each quantised weight's original freed.
  """
  if lora is not None and lora.enabled:
    return _lora_state(model_config, params, tx, lora, seed, release)
  # A copy: `update` donates the state, which must not delete the caller's model arrays.
  params = {k: jnp.array(v, dtype=jnp.float32, copy=True) for k, v in params.items()}
  # A copy even in float32 (astype would alias): donating `params` and `ref_params`
  # in one call must not hand XLA the same buffer twice.
  ref = ({k: jnp.array(v, dtype=ref_dtype, copy=True) for k, v in params.items()}
         if with_reference else None)
  step, opt_state = _replicated_scalars(params, (jnp.zeros((), jnp.int32), tx.init(params)))
  return TrainState(
      step=step,
      params=params,
      opt_state=opt_state,
      ref_params=ref,
      frozen=None,
      model_config=model_config.replace(param_dtype="float32"),
      tx=tx,
  )


def _lora_state(model_config, params, tx, lora, seed, release) -> TrainState:
  sharding = next(iter(params.values())).sharding
  frozen = lora_lib.frozen_base(params, lora, model_config.dtype, release=release)
  adapters = lora_lib.init_adapters(model_config, lora, jax.random.key(seed))
  if isinstance(sharding, NamedSharding):  # each adapter on the mesh by its logical axes
    shardings = sharding_lib.named_shardings(lora_lib.adapter_specs(model_config, lora),
                                             sharding.mesh)
    adapters = {k: mesh_lib.put(v, shardings[k]) for k, v in adapters.items()}
  step, opt_state = _replicated_scalars(adapters, (jnp.zeros((), jnp.int32), tx.init(adapters)))
  return TrainState(step=step, params=adapters, opt_state=opt_state, ref_params=None,
                    frozen=frozen,
                    model_config=model_config.replace(param_dtype="float32",
                                                      lora_scale=lora.scale), tx=tx)


def split_trainable(trainable: Params) -> tuple[Params, Params]:
  """(the policy's parameters, the critic's: {} without one) of a `trainable` dict."""
  n = len(CRITIC_PREFIX)
  policy = {k: v for k, v in trainable.items() if not k.startswith(CRITIC_PREFIX)}
  return policy, {k[n:]: v for k, v in trainable.items() if k.startswith(CRITIC_PREFIX)}


def with_critic(state: TrainState, critic_config: ModelConfig, critic_params: Params
                ) -> TrainState:
  """`state` with PPO's critic (a score model: head "score", one label) beside the
  policy, its parameters as float32 copies, and the optimizer state made again over
  both (`trainable`). With LoRA, critic_params are the critic's adapters and score
  head only (`lora_critic`): its decoder is the policy's frozen base."""
  if state.frozen is not None:
    extra = sorted(k for k in critic_params if not lora_lib.is_adapter(k) and k != "score")
    if extra:
      raise ValueError(f"a critic beside LoRA adapters is adapters and a score head on the "
                       f"policy's base (lora_critic), not a decoder of its own ({extra[:3]}...)")
  if critic_config.head != "score" or critic_config.num_labels != 1:
    raise ValueError(f"a critic is a score model with one label, not head={critic_config.head!r}"
                     f" num_labels={critic_config.num_labels}")
  # Copies: the update donates the state, which must not delete the caller's arrays.
  critic = {k: jnp.array(v, dtype=jnp.float32, copy=True) for k, v in critic_params.items()}
  state = state.replace(critic_params=critic,
                        critic_config=critic_config.replace(param_dtype="float32"))
  return state.replace(opt_state=init_optimizer(state.tx, state.trainable))


def lora_critic(policy_config: ModelConfig, adapters: Params, key: jax.Array
                ) -> tuple[ModelConfig, Params]:
  """(config, parameters) of a LoRA run's critic: fresh float32 adapters of the policy's
  rank and targets (`adapters`, the policy's, give them) and a fresh score head
  N(0, 0.02) [1, D], to run on the policy's frozen base. Its values start as the
  base model's with a fresh head, as a full critic started from the policy does."""
  lora = lora_lib.config_of(adapters, policy_config.lora_scale)
  critic_cfg = policy_config.replace(head="score", num_labels=1)
  k_adapters, k_head = jax.random.split(key)
  params = lora_lib.init_adapters(critic_cfg, lora, k_adapters)
  params["score"] = 0.02 * jax.random.normal(k_head, (1, critic_cfg.hidden_size), jnp.float32)
  sharding = next(iter(adapters.values())).sharding
  if isinstance(sharding, NamedSharding):  # each on the mesh by its logical axes
    shardings = sharding_lib.named_shardings(lora_critic_specs(critic_cfg, lora), sharding.mesh)
    params = {k: mesh_lib.put(v, shardings[k]) for k, v in params.items()}
  return critic_cfg, params


def lora_critic_specs(critic_config: ModelConfig, lora: lora_lib.LoraConfig) -> dict:
  """{name: (shape, logical axes)} of a LoRA critic's parameters (lora_critic)."""
  return {**lora_lib.adapter_specs(critic_config, lora),
          "score": transformer.param_specs(critic_config)["score"]}


def init_optimizer(tx: optax.GradientTransformation, params: Params) -> optax.OptState:
  """`tx.init(params)` with its scalars (Adam's count) placed as jitted steps return them."""
  return _replicated_scalars(params, tx.init(params))


def _replicated_scalars(params: Params, tree):
  sharding = next(iter(params.values())).sharding
  if not isinstance(sharding, NamedSharding):
    return tree
  # Jitted steps return unsharded leaves (step counters, Adam's count) replicated
  # on the mesh: start them there, or the second call sees new shardings and retraces.
  replicated = NamedSharding(sharding.mesh, PartitionSpec())
  return jax.tree.map(
      lambda x: x if isinstance(x.sharding, NamedSharding) else mesh_lib.put(x, replicated), tree)


class NonFiniteError(RuntimeError):
  """Training produced NaN or inf; the message is one line for the user."""


@jax.jit
def _finite_flags(params: Params) -> dict[str, jax.Array]:
  return {k: jnp.all(jnp.isfinite(v)) for k, v in params.items()}


def check_finite(params: Params, purpose: str) -> None:
  """Raises NonFiniteError naming the parameters that hold NaN or inf (one host sync)."""
  flags = jax.device_get(_finite_flags(params))
  bad = sorted(k for k, ok in flags.items() if not ok)
  if bad:
    raise NonFiniteError(f"refusing to {purpose}: parameters {', '.join(bad)} hold NaN or inf")


def sync_reference(state: TrainState, alpha: float) -> TrainState:
  """TR-DPO style reference update: ref <- alpha * policy + (1 - alpha) * ref."""
  if state.ref_params is None:
    return state
  ref = {
      k: (alpha * state.params[k] + (1 - alpha) * r.astype(jnp.float32)).astype(r.dtype)
      for k, r in state.ref_params.items()
  }
  return state.replace(ref_params=ref)
