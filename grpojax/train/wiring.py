"""From a validated config to the run's parts, each rule stated once.

grpojax.run.assemble builds a run through these functions, for the loop
(train/loop.py, and the Python API through it) and the planner (grpojax/plan.py):
the model config, tokenizer, task, reward functions, rollout settings and the
update's settings. Each takes the
config (`cfg`, an ml_collections.ConfigDict that grpojax.config.validate
accepted) and returns typed values; nothing here runs a program or imports the
loop or the planner. Below this layer no function takes the config.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

from grpojax import config as config_lib
from grpojax import models, ops
from grpojax.data import get_task, load_rows, prompt_text
from grpojax.data.tasks import DataError, MissingSplit
from grpojax.models import config as model_config_lib
from grpojax.models import hf as hf_lib
from grpojax.models.tokenizers import TOKENIZER_FILES, load_tokenizer
from grpojax.rewards import format as format_rewards
from grpojax.rewards import resolve
from grpojax.train.optim import make_optimizer
from grpojax.train.rollout import RolloutConfig, logp_temperature


def model_config(cfg, tokenizer, *, remat: bool | str | None = None) -> models.ModelConfig:
  """The ModelConfig the run loads or builds (model.path's config.json alone, or model.arch),
  its kernels resolved (grpojax.ops.resolve: the CPU kernels are built here, before any trace).

  remat: the resolved model.remat (see grpojax.plan.fit); default: the fastest of
  `remat_choices` (model.remat, "auto" as False).
  """
  m = cfg.model
  if remat is None:
    remat = remat_choices(cfg)[0]
  if m.path:  # as from_pretrained reads it
    out = models.read_config(hf_lib.local_dir(m.path), param_dtype=m.dtype, dtype=m.dtype,
                             remat=remat, kernels=m.kernels, attention_block=m.attention_block)
  else:
    # Tiny presets take the tokenizer's vocabulary; published shapes keep their own.
    vocab = {} if m.arch in model_config_lib.PUBLISHED else {"vocab_size": tokenizer.vocab_size}
    out = models.get_preset(m.arch, dtype=m.dtype, remat=remat, kernels=m.kernels,
                            attention_block=m.attention_block, **vocab)
  return ops.resolve(out)


def remat_choices(cfg) -> list:
  """model.remat's candidates, fastest first: no remat, the matmul outputs saved, only
  each layer's input saved ([False, "dots", True]) where "auto", else the one given."""
  return [False, "dots", True] if cfg.model.remat == "auto" else [cfg.model.remat]


def micro_batch_choices(cfg) -> list[int]:
  """train.micro_batches' candidates, fastest (fewest) first: the divisors of a
  minibatch's groups where "auto", else the one given."""
  t = cfg.train
  if t.micro_batches != "auto":
    return [int(t.micro_batches)]
  groups = cfg.rollout.prompts_per_step // t.minibatches
  return [m for m in range(1, groups + 1) if groups % m == 0]


def _tools(cfg) -> tuple:
  """The functions and classes rollout.tools names, resolved."""
  return resolve.tools(config_lib.tool_paths(cfg))


def _reward_functions(cfg) -> tuple:
  """The functions rewards.functions names, resolved."""
  return resolve.reward_functions(config_lib.reward_paths(cfg))


def run_environments(cfg):
  """The run's grpojax.tools.Environments (rollout.environment, with rollout.tools'
  schemas beside each environment's), or None without one."""
  factories = resolve.environment_factories(config_lib.environment_paths(cfg))
  if factories is None:
    return None
  from grpojax.tools import Environments, schema_tools  # pylint: disable=import-outside-toplevel

  return Environments(factories, group_size=cfg.rollout.group_size,
                      tools=schema_tools(_tools(cfg)))


def run_tokenizer(cfg, environments=None):
  """The run's tokenizer: model.tokenizer's, else model.path's, else the character one.
  Raises config.ConfigError, in one line, for a directory with no tokenizer in it.

  environments: the run's (run_environments); made here where rollout.environment
  names one and none is given: each row's prompt shows its environment's tools."""
  key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
  path = cfg.model.tokenizer or hf_lib.local_dir(cfg.model.path) or "char"
  if path != "char" and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
    raise config_lib.ConfigError(
        f"config: {key}={cfg.model[key.split('.')[1]]!r} has no tokenizer (none of "
        f"{', '.join(TOKENIZER_FILES)}): give model.tokenizer=DIR, a directory that has one")
  tokenizer = load_tokenizer(path)
  if config_lib.tool_paths(cfg) or config_lib.environment_paths(cfg):
    from grpojax.tools import schema_tools  # pylint: disable=import-outside-toplevel

    if not hasattr(tokenizer, "template_kwargs"):
      key = "rollout.tools" if config_lib.tool_paths(cfg) else "rollout.environment"
      raise config_lib.ConfigError(
          f"config: {key} needs a tokenizer whose chat template renders tools (an HF "
          "tokenizer, e.g. Qwen2.5's); the character tokenizer has none")
    # Every prompt the run renders (train, eval, the planner's) shows the tools' schemas.
    tokenizer.template_kwargs["tools"] = schema_tools(_tools(cfg))
    if config_lib.environment_paths(cfg):
      tokenizer.row_tools = (environments or run_environments(cfg)).schema
  return tokenizer


def tool_hook(cfg, tokenizer, environments=None):
  """The engine's turn loop (sampling.engine.turns.TurnHook) over rollout.tools and the
  rows' environments (the run's Environments: made here where rollout.environment names
  one and none is given), run on the host by a grpojax.tools.ToolRunner; None without
  tools."""
  if not (config_lib.tool_paths(cfg) or config_lib.environment_paths(cfg)):
    return None
  from grpojax.sampling.engine.turns import TurnHook  # pylint: disable=import-outside-toplevel
  from grpojax.tools import CALL_CLOSE, ToolRunner  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() > 1:
    raise config_lib.ConfigError(
        "config: rollout.tools runs on one process for now (each process would run its own "
        "rows' tools and count only them): start one process, or give rollout.tools=''")
  r = cfg.rollout
  if environments is None and config_lib.environment_paths(cfg):
    environments = run_environments(cfg)
  runner = ToolRunner(tokenizer, _tools(cfg), timeout_s=r.tool_timeout_s,
                      response_tokens=r.tool_response_tokens, isolation=r.tool_isolation,
                      environments=environments)
  calls = r.max_tool_calling_iterations
  return TurnHook(host=runner, eos=tuple(tokenizer.eos_ids),
                  call_end=tuple(tokenizer.encode(CALL_CLOSE)),
                  max_calls=r.max_completion_length if calls < 0 else calls,
                  response_tokens=r.tool_response_tokens)


def run_task(cfg):
  """The run's task, with rewards.functions as its verifiers when it has none of its own
  (the "prompt" task): eval's is_correct then derives from the first of them."""
  task = get_task(cfg.task.name)
  if not task.reward_fns:
    task = dataclasses.replace(task, reward_fns=_reward_functions(cfg), is_correct=None,
                               reward_weights=config_lib.function_weights(cfg))
  return task


def run_rewards(cfg, task, environments=None) -> tuple[tuple, tuple | None]:
  """The reward functions and their weights: the task's, then the config's additions
  (rewards.functions, weighed by rewards.weights), then the environments' get_reward
  (weight 1 each)."""
  fns, weights = tuple(task.reward_fns), task.reward_weights
  extra = _reward_functions(cfg)
  if extra and fns != extra:  # (the "prompt" task's own are these already: see run_task)
    weights = (*(weights or (1.0,) * len(fns)),
               *(config_lib.function_weights(cfg) or (1.0,) * len(extra)))
    fns += extra
  if environments is not None and environments.rewarded:
    weights = (*(weights or (1.0,) * len(fns)), *(1.0,) * len(environments.rewarded))
    fns += tuple(environments.reward_functions())
  if not fns and not config_lib.reward_model_paths(cfg):
    raise config_lib.ConfigError(
        "config: rewards.functions is empty and the environment has no get_reward(): the run "
        "has no reward; name reward functions, or give the environment a get_reward()")
  if cfg.rewards.overlong_buffer:
    fns += (format_rewards.OverlongPenalty(cfg.rollout.max_completion_length,
                                           cfg.rewards.overlong_buffer),)
    weights = (*(weights or (1.0,) * (len(fns) - 1)), 1.0)
  return fns, weights


def run_reward_models(cfg, mesh=None, *, abstract: bool = False
                      ) -> tuple[list, tuple, tuple[float, ...]]:
  """(RewardModels, their parameters placed on `mesh`, their weights): rewards.models,
  loaded in rewards.model_dtype (model.dtype when ""); abstract: their shapes and
  shardings only (the planner)."""
  from grpojax.models import reward as reward_lib

  models, params = [], []
  for path in config_lib.reward_model_paths(cfg):
    m, p = reward_lib.load(hf_lib.local_dir(path, "rewards.models"),
                          dtype=cfg.rewards.model_dtype or cfg.model.dtype,
                          max_length=cfg.rewards.model_max_length, mesh=mesh, abstract=abstract)
    models.append(m)
    params.append(p)
  return models, tuple(params), config_lib.model_weights(cfg)


def critic_config(cfg, policy: models.ModelConfig) -> models.ModelConfig:
  """PPO's critic's config (advantage.estimator=gae), computing as `policy` does (dtype,
  remat, kernels, attention block): from "policy", the policy's decoder with one score
  label; else the config.json of the reward model at advantage.critic, a sequence
  classifier of one label whose vocabulary holds the policy's tokens (ConfigError)."""
  source = cfg.advantage.critic
  if source == "policy":
    out = policy.replace(head="score", num_labels=1)
  else:
    out = models.read_config(hf_lib.local_dir(source, "advantage.critic"))
    if out.head != "score" or out.num_labels != 1:
      raise config_lib.ConfigError(
          f"config: advantage.critic={source!r} is a {out.architecture.hf_class_for(out.head)}"
          f" with {out.num_labels} labels: a critic starts from a sequence classifier "
          "with one (a reward model), or from 'policy'")
    if out.vocab_size < policy.vocab_size:
      raise config_lib.ConfigError(
          f"config: advantage.critic={source!r} has a vocabulary of {out.vocab_size} "
          f"tokens, the policy {policy.vocab_size}: the critic reads the policy's tokens, so "
          "it must share its tokenizer")
  return out.replace(dtype=policy.dtype, remat=policy.remat, kernels=policy.kernels,
                     attention_block=policy.attention_block)


def critic(cfg, state, mesh=None) -> tuple[models.ModelConfig, dict]:
  """(config, parameters) of PPO's critic (advantage.estimator=gae; its config is
  `critic_config`'s): from "policy", the policy's decoder with a fresh scalar head
  (N(0, 0.02), seeded by train.seed); else the reward model at advantage.critic. With
  LoRA, the critic's own adapters and score head on the policy's frozen base
  (state.lora_critic)."""
  import jax  # pylint: disable=import-outside-toplevel

  from grpojax.models import transformer  # pylint: disable=import-outside-toplevel
  from grpojax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel

  policy = state.model_config
  source = cfg.advantage.critic
  key = jax.random.fold_in(jax.random.key(cfg.train.seed), 0x5C0E)
  if state.frozen is not None:  # LoRA: adapters and a head on the policy's base
    if source != "policy":
      raise ValueError(f"advantage.critic={source!r} with LoRA: config.validate refuses it")
    from grpojax.train.state import lora_critic  # pylint: disable=import-outside-toplevel
    return lora_critic(policy, state.params, key)
  critic_cfg = critic_config(cfg, policy)
  if source == "policy":
    _, params = transformer.with_score_head(policy, state.params, key)
  else:
    _, params = hf_lib.load_params(hf_lib.local_dir(source, "advantage.critic"),
                                   dtype="float32", mesh=mesh, remat=policy.remat,
                                   kernels=policy.kernels, attention_block=policy.attention_block)
  if mesh is not None:  # the fresh head (or every loaded tensor) by its logical axes
    shardings = transformer.param_shardings(critic_cfg, mesh)
    params = {k: mesh_lib.put(v, shardings[k]) if k == "score" else v for k, v in params.items()}
  return critic_cfg, params


def splits(cfg, task) -> tuple[str, str]:
  """The (train, eval) splits: the config's, where set, else the task's own."""
  return cfg.task.train_split or task.splits[0], cfg.task.eval_split or task.splits[1]


def run_rows(cfg, task) -> tuple[list, list[tuple[str, list]]]:
  """(the train rows, [(name, rows)] of each held-out set eval reads): the run's own
  set first (name ""), then each of eval.sets, eval.num_prompts rows each; no sets
  when eval is off (eval.num_prompts=0)."""
  train_split, eval_split = splits(cfg, task)
  seed = cfg.train.seed
  train = load_rows(task, cfg.task.dataset, train_split, seed=seed)
  held_out = []
  if cfg.eval.num_prompts:
    for name, dataset, split in [("", "", "")] + config_lib.eval_sets(cfg):
      try:
        rows = load_rows(task, dataset or cfg.task.dataset, split or eval_split, seed=seed)
      except MissingSplit as e:
        if name:  # an eval.sets entry names its own split: its message says enough
          raise
        raise DataError(f"eval: {e}: give the held-out split as task.eval_split=NAME, or "
                        "eval.num_prompts=0 for no eval") from None
      held_out.append((name, rows[:cfg.eval.num_prompts]))
  return train, held_out


def prompt_bucket(tokens: int) -> int:
  """The prompt length rollout.max_prompt_length="auto" gives for a longest prompt of
  `tokens`: the next power of two from 16 up to 256, then the next multiple of 256 (at
  most 2x the longest below 256, 255 tokens more above)."""
  if tokens > 256:
    return -(-tokens // 256) * 256
  out = 16
  while out < tokens:
    out *= 2
  return out


def with_prompt_length(cfg, task, tokenizer, row_sets):
  """`cfg` where rollout.max_prompt_length is a number: itself, or for "auto" a copy
  holding the bucket of the longest rendered prompt in `row_sets` (lists of rows: the
  train rows and the held-out ones), so that none is filtered."""
  if cfg.rollout.max_prompt_length != "auto":
    return cfg
  longest = max((len(tokenizer.encode(prompt_text(task, row, tokenizer)))
                 for rows in row_sets for row in rows), default=1)
  out = copy.deepcopy(cfg)  # (FieldReferences kept: the "auto"-or-number keys)
  out.rollout.max_prompt_length = prompt_bucket(longest)
  logging.getLogger(__name__).info("rollout.max_prompt_length=auto: %d tokens (the longest prompt is %d)",
                  out.rollout.max_prompt_length, longest)
  return out


def uses_reference(cfg) -> bool:
  """Whether the run keeps a frozen reference model: the KL penalty is on (loss.beta > 0).
  At beta = 0 no reference weights are held and no reference forward runs."""
  return config_lib.loss_config(cfg).beta > 0


def uses_old_logps(cfg) -> bool:
  """Whether the rollout scores its rows under the sampling policy first: the update
  is off-policy, with several updates per rollout (train.num_iterations > 1) or
  several minibatches (train.minibatches > 1); or PPO's per-token rewards hold the
  KL of those log-probs to the reference (loss.kl_in_reward)."""
  return (cfg.train.num_iterations > 1 or cfg.train.minibatches > 1
          or bool(cfg.loss.kl_in_reward))


def updates_per_step(cfg) -> int:
  """Optimizer steps per train step (a rollout): num_iterations x minibatches gradients,
  grad_accum_steps of them to an optimizer step."""
  t = cfg.train
  return t.num_iterations * t.minibatches // cfg.optim.grad_accum_steps


def optimizer(cfg):
  """The run's optax transformation: optim.* over all its optimizer steps (train.steps
  rollouts of updates_per_step each)."""
  return make_optimizer(config_lib.optim_config(cfg), cfg.train.steps * updates_per_step(cfg))


def rollout_config(cfg, tokenizer, micro_batches: int = 1, kv_pages: int = 0,
                   decode_slots: int = 0, environments=None) -> RolloutConfig:
  """micro_batches: the update's (fitted); the rollout's log-prob forwards take as many rows.
  kv_pages, decode_slots: the engine's pool and slots where rollout's are "auto" (fitted).
  environments: the run's (see tool_hook)."""
  r, t = cfg.rollout, cfg.train
  return RolloutConfig(
      group_size=r.group_size, max_new_tokens=r.max_completion_length,
      sampling=config_lib.sampling_params(cfg),
      eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id,
      estimator=cfg.advantage.estimator, advantage_scale=cfg.advantage.scale,
      advantage_eps=cfg.advantage.eps, with_reference=uses_reference(cfg),
      with_old_logps=uses_old_logps(cfg),
      mask_truncated=cfg.loss.mask_truncated_completions,
      logprob_chunks=t.minibatches * micro_batches, generation_chunks=r.generation_chunks,
      engine=config_lib.engine_config(cfg, kv_pages, decode_slots),
      max_staleness=r.max_staleness, partial=r.partial, carried_batches=r.carried_batches,
      hook=tool_hook(cfg, tokenizer, environments), gamma=cfg.advantage.gamma,
      lam=cfg.advantage.lam, whiten_rewards=cfg.advantage.whiten_rewards,
      reward_kl_coef=cfg.loss.beta if cfg.loss.kl_in_reward else 0.0,
      kl_estimator=cfg.loss.kl_estimator)


def rollout_strategy(cfg, engine) -> str:
  """The registered rollout strategy a run draws its rollouts with: rollout.strategy, or
  for "auto" the built-in one its dynamic sampling and engine (an EngineConfig, None
  for the lockstep sampler) call for."""
  from grpojax.train import strategy as strategy_lib

  if cfg.rollout.strategy != "auto":
    return cfg.rollout.strategy
  return strategy_lib.choose(cfg.rollout.dynamic_sampling, engine, cfg.rollout.max_staleness)


def update_settings(cfg, micro_batches: int) -> dict:
  """`train.step.update`'s keyword arguments for this run, micro_batches its fitted
  number of micro-batches (grpojax.plan.fit)."""
  r, t = cfg.rollout, cfg.train
  return dict(loss_config=config_lib.loss_config(cfg), group_size=r.group_size,
              num_iterations=t.num_iterations, minibatches=t.minibatches,
              temperature=logp_temperature(config_lib.sampling_params(cfg)),
              grad_accum_steps=cfg.optim.grad_accum_steps, micro_batches=micro_batches)
