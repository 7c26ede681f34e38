"""One assembly of a run from its settings: what the trainer, the planner and the API build.

`assemble(settings, mesh)` goes from a run's settings (grpojax.run.settings.read:
the config read once) to the run's parts, in one order: task, environments,
reward functions, tokenizer, data (and the "auto" prompt length it sizes), model
config, the memory fitting of the "auto" sizes, reward models, optimizer and
train state. The trainer (train/loop.py `setup`,
which the Python API calls) takes them real; the planner (grpojax.plan) takes
them abstract (`abstract=True`: shapes and shardings, no weights), so what it
compiles is what the run compiles. What only a live run has (checkpoints,
metrics, the reward workers, evaluators) stays with the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from grpojax import models
from grpojax.errors import ConfigError
from grpojax.models import hf as hf_lib
from grpojax.run import fit as fit_lib
from grpojax.run.settings import Settings
from grpojax.train import wiring
from grpojax.train.rollout import RolloutConfig
from grpojax.train.state import create_train_state, with_critic


@dataclasses.dataclass
class Assembly:
  """A run's parts (see `assemble`).

  settings: the settings they were made from, rollout.max_prompt_length resolved
  where "auto". train_rows, held_out: the data (wiring.run_rows); None and [] where
  an abstract assembly had no need to read it. reward_weights: the functions'
  then the reward models'. model_config: remat fitted. unfit: why the run would
  stop at start-up for lack of memory (only an abstract assembly keeps going,
  with the most frugal choices, so the planner can say how far off it is).
  state: the fresh TrainState (PPO's critic beside it), or its abstract twin;
  without the reward models' parameters, which `with_reward_models` adds.
  update_kw: `train.step.update`'s keyword arguments.
  """

  settings: Settings
  task: Any
  environments: Any
  reward_fns: tuple
  reward_weights: tuple | None
  tokenizer: Any
  train_rows: list | None
  held_out: list
  model_config: models.ModelConfig
  fitted: fit_lib.Fit
  unfit: str | None
  reward_models: list
  reward_params: tuple
  optimizer: Any
  state: Any
  update_kw: dict

  def rollout_config(self, environments=None) -> RolloutConfig:
    """The rollout's settings at the fitted sizes. Made on demand: where the run uses
    tools, it starts their runner (environments: the rows', default the run's)."""
    f = self.fitted
    return wiring.rollout_config(self.settings, self.tokenizer, f.micro_batches, f.kv_pages,
                                 f.decode_slots, self.environments if environments is None
                                 else environments)

  def engine(self):
    """The paged engine's EngineConfig at the fitted pool and slots (None: lockstep)."""
    return self.settings.rollout.engine_config(self.fitted.kv_pages, self.fitted.decode_slots)

  def strategy_name(self) -> str:
    """The registered rollout strategy the run draws its rollouts with."""
    return wiring.rollout_strategy(self.settings, self.engine())

  def with_reward_models(self, state):
    """`state` holding the reward models' parameters (frozen, for the rollout's scoring)."""
    return state.replace(reward_params=self.reward_params) if self.reward_models else state


def load_model(s: Settings, model_cfg: models.ModelConfig, mesh):
  """(the model's config, its parameters): loaded from model.path, or built from
  model.arch with train.seed. A QLoRA run's base is quantised as it loads
  (hf.load_params), never whole in model.dtype."""
  m = s.model
  if m.path:
    lora = m.lora
    try:
      return hf_lib.load_params(
          hf_lib.local_dir(m.path), dtype=m.dtype, mesh=mesh,
          quantize=lora.quantize if lora.enabled else "none", remat=model_cfg.remat,
          kernels=model_cfg.kernels, attention_block=model_cfg.attention_block)
    except FileNotFoundError as e:  # no weights, a shard missing: the user's to fix, one line
      raise ConfigError(f"config: model.path={m.path!r}: {e}") from e
  model = models.build_model(model_cfg, seed=s.train.seed, mesh=mesh)
  return model.config, model.param_dict()


def train_state(s: Settings, model_config: models.ModelConfig, params: dict, tx, mesh=None, *,
                release: bool = False):
  """The fresh TrainState over `params`, with PPO's critic beside it
  (advantage.estimator=gae). release: a LoRA base is made from params in place."""
  state = create_train_state(model_config, params, tx, with_reference=s.uses_reference,
                             ref_dtype=s.model.ref_dtype, lora=s.model.lora,
                             seed=s.train.seed, release=release)
  if s.advantage.needs_critic:
    state = with_critic(state, *wiring.critic(s, state, mesh))
  return state


def assemble(s: Settings, mesh, *, abstract: bool = False, device_bytes: int | None = None,
             kernels: str | None = None,
             phase: Callable[[str], contextlib.AbstractContextManager] | None = None) -> Assembly:
  """The parts of the run of settings `s` on `mesh`.

  abstract: shapes only, as the planner needs them: reward models and the state
  as ShapeDtypeStructs with their shardings, the data read only to size an
  "auto" prompt length, and a fitting that finds nothing within the budget
  recorded in `unfit` rather than raised (ConfigError, as the run raises it).
  device_bytes: the memory budget the fitting works in (default: the device's).
  kernels: the ops backend where model.kernels is "auto" or "cpu" (the planner's
  target device's), instead of this host's.
  phase: a context manager factory phase(what) around the slow parts (the loop
  logs them); the reward functions' startup checks run where they are real.
  """
  phase = phase or (lambda what: contextlib.nullcontext())
  task = wiring.run_task(s)
  environments = wiring.run_environments(s)  # one instance per row, made as rows need them
  reward_fns, reward_weights = wiring.run_rewards(s, task, environments)
  if not abstract:
    for fn in reward_fns:  # e.g. the code sandbox: refuse now, not after SFT and compiles
      getattr(fn, "startup_check", lambda: None)()
  tokenizer = wiring.run_tokenizer(s, environments)
  train_rows, held_out = None, []
  if not abstract or s.rollout.max_prompt_length == "auto":
    with phase("data: loading"):
      train_rows, held_out = wiring.run_rows(s, task)
      s = wiring.with_prompt_length(s, task, tokenizer,
                                    [train_rows] + [rows for _, rows in held_out])
  model_cfg = wiring.model_config(s, tokenizer)
  if kernels is not None and model_cfg.kernels in ("auto", "cpu"):
    model_cfg = model_cfg.replace(kernels=kernels)
  unfit = None
  loading = f"loading {s.model.path}" if s.model.path else f"building {s.model.arch}"
  with phase("model: " + ("fitting" if abstract else loading)):
    # "auto" micro-batches and remat: the fastest choice whose update fits the memory.
    try:
      fitted = fit_lib.fit(s, model_cfg, mesh, device_bytes=device_bytes)
    except ConfigError as e:
      if not abstract:
        raise
      unfit = str(e)  # the planner reports the programs at the most frugal choice fit tried
      fitted = fit_lib.Fit(s.micro_batch_choices[-1], s.model.remat_choices[-1],
                           None, None, f"nothing fits: {e}")
    model_cfg = model_cfg.replace(remat=fitted.remat)
    tx = wiring.optimizer(s)
    if abstract:
      state = fit_lib.abstract_state(s, model_cfg, mesh)
    else:
      loaded_cfg, params = load_model(s, model_cfg, mesh)
      # The parameters are handed over: a LoRA base is made from them in place.
      state = train_state(s, loaded_cfg, params, tx, mesh, release=True)
      del params
  reward_models, reward_params, model_weights = wiring.run_reward_models(s, mesh,
                                                                       abstract=abstract)
  if reward_models:  # their columns come after the functions'
    reward_weights = (*(reward_weights or (1.0,) * len(reward_fns)), *model_weights)
  return Assembly(settings=s, task=task, environments=environments, reward_fns=reward_fns,
                  reward_weights=reward_weights, tokenizer=tokenizer, train_rows=train_rows,
                  held_out=held_out, model_config=model_cfg,
                  fitted=fitted, unfit=unfit, reward_models=reward_models,
                  reward_params=reward_params, optimizer=tx, state=state,
                  update_kw=wiring.update_settings(s, fitted.micro_batches))
