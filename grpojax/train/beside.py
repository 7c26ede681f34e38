"""The rollout on devices of its own, beside the update (parallel.rollout_devices = K).

The update runs on a mesh of the first devices, the rollout on a mesh of the last
K (parallel.rollout_shape, tensor-parallel by default). Step i's update trains on
the rollout drawn during step i - 1 by the weights update i - 1 started from: one
version stale, verl's one-step-off-policy mode. While update i runs on its
devices, rollout i + 1 runs on the rollout devices with a copy of the weights
update i starts from, dispatched before the update donates them. JAX's
asynchronous dispatch makes the overlap: no threads, and nothing waits for the
host between the two dispatches.

The step's proximal log-probs (the weights at the start of the update: old_logps
where the update needs them, loss.decoupled's clip) and the reference's are
computed on the update's devices as the rollout is handed over. The sampler's
own log-probs are the behaviour policy's (Rollout.sampler_logps):
loss.decoupled or loss.importance_sampling_correction weighs the staleness; the
plain loss ignores it, as verl's one-step-off mode does.

The first rollout of a run (and of a resume that saved no rollout) is drawn on the
spot, on-policy. A checkpoint holds the rollout drawn ahead, so a resumed run
trains on exactly what the uninterrupted one would have.

Shapes: N = B*G rows, P prompt length, T completion length.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax import models
from grpojax.models import sharding as sharding_lib
from grpojax.parallel import mesh as mesh_lib
from grpojax.train import strategy as strategy_lib
from grpojax.train.rollout import Rollout, RolloutConfig, with_logps
from grpojax.train.state import TrainState

_log = logging.getLogger(__name__)


def split_meshes(shape, rollout_shape, rollout_devices: int, devices=None) -> tuple[Mesh, Mesh]:
  """(update mesh over the first devices by `shape`, rollout mesh over the last
  `rollout_devices` by `rollout_shape`), each a ("data", "fsdp", "tensor") mesh."""
  devices = jax.devices() if devices is None else list(devices)
  if jax.process_count() > 1:
    raise ValueError("parallel.rollout_devices runs in one process: the rollout and the update "
                     "must each be on devices this process holds")
  if not 0 < rollout_devices < len(devices):
    raise ValueError(f"parallel.rollout_devices={rollout_devices}: needs at least one device "
                     f"for the rollout and one for the update ({len(devices)} devices here)")
  return (mesh_lib.make_mesh(shape, devices[:-rollout_devices]),
          mesh_lib.make_mesh(rollout_shape, devices[-rollout_devices:]))


def _projected(x: jax.Array, mesh: Mesh) -> NamedSharding:
  """x's partitioning carried to `mesh`: each dim keeps the mesh axes it is split over
  where they divide it there, else it is replicated."""
  spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
  out = []
  for size, entry in zip(x.shape, tuple(spec) + (None,) * (x.ndim - len(spec))):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    keep = tuple(a for a in axes if mesh.shape[a] > 1)
    n = math.prod(mesh.shape[a] for a in keep)
    out.append(None if not keep or size % n else (keep[0] if len(keep) == 1 else keep))
  return NamedSharding(mesh, PartitionSpec(*out))


class Beside(strategy_lib.RolloutStrategy):
  """Another strategy's rollouts drawn on the rollout mesh one step ahead of the update.

  inner: the strategy that draws (plain or carried), built on `rollout_mesh` with a
  config that computes no old or reference log-probs (`make_beside`). config: the
  run's RolloutConfig (what the update needs). mesh: the update's mesh.

  Metrics: the inner strategy's (carry/* staleness counts versions on the rollout
  side: the update is one version past them), plus beside/on_policy (1 where the
  rollout was drawn on the spot by the update's own weights, 0 where one step ahead).
  """

  name = "beside"

  def __init__(self, inner: strategy_lib.RolloutStrategy, config: RolloutConfig, *, mesh: Mesh,
               rollout_mesh: Mesh):
    self.inner, self.config, self.mesh, self.rollout_mesh = inner, config, mesh, rollout_mesh
    self.host_rewards, self.names = inner.host_rewards, inner.names
    self.num_prompts, self.max_rounds, self.weights = (inner.num_prompts, inner.max_rounds,
                                                       inner.weights)
    self._pending = None  # (Rollout on the rollout mesh, metrics): what the next step trains on
    self._saved = None  # a resumed run's pending rollout, host arrays
    self._source = None  # the pending rollout's source (_RolloutSource): what it drew
    self._shardings = {}  # the rollout mesh's sharding of each parameter
    self._before = None  # the inner state before a call that drew two rollouts
    self._score = jax.jit(lambda state, rollout: with_logps(config, state, rollout))

  # ----------------------------------------------------------------- the two meshes

  def _placement(self, name: str, x, model_config):
    """Where parameter `name` (an array, or a quantised weight's tree) goes on the
    rollout mesh: a base weight by its logical axes, anything else (adapters,
    quantised codes and scales) by its partitioning carried over."""
    if name not in self._shardings:
      specs = models.param_specs(model_config)
      if name in specs and getattr(x, "shape", None) == specs[name][0]:
        self._shardings[name] = sharding_lib.named_shardings(
            {name: specs[name]}, self.rollout_mesh)[name]
      else:
        self._shardings[name] = jax.tree.map(lambda leaf: _projected(leaf, self.rollout_mesh), x)
    return self._shardings[name]

  def rollout_state(self, state: TrainState) -> TrainState:
    """The policy of `state` copied onto the rollout mesh (its step: the version the
    rollout's tokens are stamped with); no optimizer state, no reference."""
    params = {name: jax.device_put(x, self._placement(name, x, state.model_config))
              for name, x in state.model_params.items()}
    step = jax.device_put(state.step, mesh_lib.replicated(self.rollout_mesh))
    return TrainState(step=step, params=params, opt_state=None, ref_params=None, frozen=None,
                      model_config=state.model_config, tx=state.tx)

  def _on_update_mesh(self, rollout: Rollout) -> Rollout:
    return jax.tree.map(lambda x: jax.device_put(
        x, mesh_lib.row_sharding(self.mesh, x.shape[0], x.ndim)), rollout)

  # ----------------------------------------------------------------- the steps

  def _draw(self, state: TrainState, source, rng):
    """The inner strategy's rollout on the rollout mesh, dispatched (not waited for)."""
    self._source = _RolloutSource(source, self.rollout_mesh)
    rng = jax.device_put(rng, mesh_lib.replicated(self.rollout_mesh))
    return self.inner(self.rollout_state(state), self._source, rng)

  def __call__(self, state, source, rng):
    source = strategy_lib.as_source(source)
    if self._saved is not None:
      self._pending, self._saved = _unpack(self._saved), None
    on_policy = self._pending is None
    self._before = None
    if on_policy:  # the run's first rollout: nothing was drawn ahead
      # What `undo` puts back: this call draws two rollouts, and strategies undo one.
      self._before = getattr(self.inner, "state_dict", dict)()
      self._pending = self._draw(state, source, rng)
    rollout, metrics = self._pending
    # The next step's rollout, by the weights this update starts from: copied and
    # dispatched now, before the update donates them, and run while it runs.
    self._pending = self._draw(state, source, jax.random.fold_in(rng, 1))
    rollout = self._score(state, self._on_update_mesh(rollout))
    return rollout, {**metrics, "beside/on_policy": float(on_policy)}

  def undo(self) -> None:
    """The step's rollout was cut short (SIGTERM during its rewards): the rollout drawn
    beside it is put back too (its prompts are served again). The cut one's prompts are
    served again where it was drawn in the same call; where it was drawn a step ahead
    they are skipped (a resumed run draws the step's rollout anew, on-policy)."""
    if self._pending is None:
      return
    self._pending = None
    if self._before is not None:
      if hasattr(self.inner, "load_state_dict"):
        self.inner.load_state_dict(self._before)
    else:
      getattr(self.inner, "undo", lambda: None)()
      _log.warning("a rollout drawn beside the update was cut short: its step's %d prompts "
                   "are skipped on resume", self.num_prompts)

  def state_dict(self) -> dict:
    """The rollout drawn ahead (host arrays, waited for) and the inner strategy's state.
    A rollout whose rewards a SIGTERM cut short is not kept: its prompts go back to the
    source and the inner strategy back to before it."""
    if self._saved is not None:
      out = dict(self._saved)
    elif self._pending is None:
      out = {}
    else:
      rollout, metrics = jax.device_get(self._pending)
      if self.host_rewards.interrupted:
        self._pending = None
        getattr(self.inner, "undo", lambda: None)()
        if self._source.draws:
          self._source.rewind(self._source.draws, 0)
        out = {}
      else:
        out = _pack(rollout, metrics)
    inner = getattr(self.inner, "state_dict", dict)()
    return {**out, **{f"inner.{k}": v for k, v in inner.items()}}

  def load_state_dict(self, saved) -> None:
    """The rollout drawn ahead and the inner strategy's state, from `state_dict`."""
    saved = dict(saved)
    inner = {k[len("inner."):]: v for k, v in saved.items() if k.startswith("inner.")}
    if hasattr(self.inner, "load_state_dict"):
      self.inner.load_state_dict(inner)
    mine = {k: v for k, v in saved.items() if not k.startswith("inner.")}
    self._pending, self._saved = None, mine or None

  def lower(self, state, rng, *, prompt_length: int):
    """The inner strategy's program on the rollout mesh (`state` abstract)."""
    def on(name, x):
      return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
                          x, self._placement(name, x, state.model_config))

    replicated = mesh_lib.replicated(self.rollout_mesh)
    rollout_state = TrainState(
        step=jax.ShapeDtypeStruct(state.step.shape, state.step.dtype, sharding=replicated),
        params={name: on(name, x) for name, x in state.model_params.items()}, opt_state=None,
        ref_params=None, frozen=None, model_config=state.model_config, tx=state.tx)
    return self.inner.lower(rollout_state, jax.ShapeDtypeStruct(rng.shape, rng.dtype,
                                                                sharding=replicated),
                            prompt_length=prompt_length)


class _RolloutSource:
  """The loop's source, its batches placed on the rollout mesh; counts the draws."""

  def __init__(self, source, mesh: Mesh):
    self.source, self.mesh, self.draws = source, mesh, 0

  def next(self):
    self.draws += 1
    return {k: jax.device_put(v, mesh_lib.row_sharding(self.mesh, v.shape[0], v.ndim))
            for k, v in self.source.next().items()}

  def rewind(self, back: int, used: int) -> None:
    self.source.rewind(back, used)


_METRIC_NAMES = "metric_names"


def _pack(rollout: Rollout, metrics: dict) -> dict:
  out = {f"pending.{f.name}": np.asarray(getattr(rollout, f.name))
         for f in dataclasses.fields(rollout) if getattr(rollout, f.name) is not None}
  names = sorted(metrics)
  out[_METRIC_NAMES] = np.frombuffer("\n".join(names).encode(), np.uint8).copy()
  out["metric_values"] = np.asarray([float(metrics[k]) for k in names], np.float64)
  return out


def _unpack(saved: dict):
  rollout = Rollout(**{k[len("pending."):]: v for k, v in saved.items()
                       if k.startswith("pending.")})
  names = bytes(np.asarray(saved[_METRIC_NAMES], np.uint8)).decode().split("\n")
  metrics = dict(zip(names, np.asarray(saved["metric_values"]).tolist()))
  return rollout, metrics


def make_beside(name: str, config: RolloutConfig, host_rewards, *, mesh: Mesh,
                rollout_mesh: Mesh, **kw) -> Beside:
  """The strategy registered as `name` drawing on `rollout_mesh`, one step ahead of the
  update on `mesh` (kw: strategy_lib.make's)."""
  if name not in ("plain", "carried"):
    raise ValueError(f"parallel.rollout_devices runs the plain or carried rollout beside the "
                     f"update, not {name!r}: dynamic sampling picks its groups on the host "
                     "between rounds, which would hold the update back")
  inner_config = dataclasses.replace(config, with_old_logps=False, with_reference=False)
  inner = strategy_lib.make(name, inner_config, host_rewards, mesh=rollout_mesh, **kw)
  return Beside(inner, config, mesh=mesh, rollout_mesh=rollout_mesh)
