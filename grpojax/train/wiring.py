"""From a run's settings to its parts, each rule stated once.

grpojax.run.assemble builds a run through these functions, for the loop
(train/loop.py, and the Python API through it) and the planner (grpojax/plan.py):
the model config, tokenizer, task, reward functions, rollout settings and the
update's settings. Each takes the run's settings (`s`, grpojax.run.settings.Settings:
the config read once) and returns typed values; nothing here reads the config,
runs a program or imports the loop or the planner.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from grpojax import models, ops
from grpojax.data import get_task, load_rows, prompt_text
from grpojax.data.tasks import DataError, MissingSplit
from grpojax.errors import ConfigError
from grpojax.models import config as model_config_lib
from grpojax.models import hf as hf_lib
from grpojax.models.tokenizers import TOKENIZER_FILES, load_tokenizer
from grpojax.rewards import format as format_rewards
from grpojax.rewards import resolve
from grpojax.train.optim import make_optimizer
from grpojax.train.rollout import RolloutConfig, logp_temperature


def model_config(s, tokenizer, *, remat: bool | str | None = None) -> models.ModelConfig:
  """The ModelConfig the run loads or builds (model.path's config.json alone, or model.arch),
  its kernels resolved (grpojax.ops.resolve: the CPU kernels are built here, before any trace).

  remat: the resolved model.remat (see grpojax.run.fit); default: the fastest of
  model.remat's choices ("auto" as False).
  """
  m = s.model
  if remat is None:
    remat = m.remat_choices[0]
  if m.path:  # as from_pretrained reads it
    out = models.read_config(hf_lib.local_dir(m.path), param_dtype=m.dtype, dtype=m.dtype,
                             remat=remat, kernels=m.kernels, attention_block=m.attention_block)
  else:
    # Tiny presets take the tokenizer's vocabulary; published shapes keep their own.
    vocab = {} if m.arch in model_config_lib.PUBLISHED else {"vocab_size": tokenizer.vocab_size}
    out = models.get_preset(m.arch, dtype=m.dtype, remat=remat, kernels=m.kernels,
                            attention_block=m.attention_block, **vocab)
  return ops.resolve(out)


def run_environments(s):
  """The run's grpojax.tools.Environments (rollout.environment, with rollout.tools'
  schemas beside each environment's), or None without one."""
  factories = resolve.environment_factories(s.rollout.environment)
  if factories is None:
    return None
  from grpojax.tools import Environments, schema_tools  # pylint: disable=import-outside-toplevel

  return Environments(factories, group_size=s.rollout.group_size,
                      tools=schema_tools(resolve.tools(s.rollout.tools)))


def run_tokenizer(s, environments=None):
  """The run's tokenizer: model.tokenizer's, else model.path's, else the character one.
  Raises config.ConfigError, in one line, for a directory with no tokenizer in it.

  environments: the run's (run_environments); made here where rollout.environment
  names one and none is given: each row's prompt shows its environment's tools."""
  key = "model.tokenizer" if s.model.tokenizer else "model.path"
  path = s.model.tokenizer or hf_lib.local_dir(s.model.path) or "char"
  if path != "char" and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
    raise ConfigError(
        f"config: {key}={getattr(s.model, key.split('.')[1])!r} has no tokenizer (none of "
        f"{', '.join(TOKENIZER_FILES)}): give model.tokenizer=DIR, a directory that has one")
  tokenizer = load_tokenizer(path)
  if s.rollout.multi_turn:
    from grpojax.tools import schema_tools  # pylint: disable=import-outside-toplevel

    if not hasattr(tokenizer, "template_kwargs"):
      key = "rollout.tools" if s.rollout.tools else "rollout.environment"
      raise ConfigError(
          f"config: {key} needs a tokenizer whose chat template renders tools (an HF "
          "tokenizer, e.g. Qwen2.5's); the character tokenizer has none")
    # Every prompt the run renders (train, eval, the planner's) shows the tools' schemas.
    tokenizer.template_kwargs["tools"] = schema_tools(resolve.tools(s.rollout.tools))
    if s.rollout.environment:
      tokenizer.row_tools = (environments or run_environments(s)).schema
  return tokenizer


def tool_hook(s, tokenizer, environments=None):
  """The engine's turn loop (sampling.engine.turns.TurnHook) over rollout.tools and the
  rows' environments (the run's Environments: made here where rollout.environment names
  one and none is given), run on the host by a grpojax.tools.ToolRunner; None without
  tools."""
  if not s.rollout.multi_turn:
    return None
  from grpojax.sampling.engine.turns import TurnHook  # pylint: disable=import-outside-toplevel
  from grpojax.tools import CALL_CLOSE, ToolRunner  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() > 1:
    raise ConfigError(
        "config: rollout.tools runs on one process for now (each process would run its own "
        "rows' tools and count only them): start one process, or give rollout.tools=''")
  r = s.rollout
  if environments is None and r.environment:
    environments = run_environments(s)
  runner = ToolRunner(tokenizer, resolve.tools(r.tools), timeout_s=r.tool_timeout_s,
                      response_tokens=r.tool_response_tokens, isolation=r.tool_isolation,
                      environments=environments)
  calls = r.max_tool_calling_iterations
  return TurnHook(host=runner, eos=tuple(tokenizer.eos_ids),
                  call_end=tuple(tokenizer.encode(CALL_CLOSE)),
                  max_calls=r.max_completion_length if calls < 0 else calls,
                  response_tokens=r.tool_response_tokens)


def run_task(s):
  """The run's task, with rewards.functions as its verifiers when it has none of its own
  (the "prompt" task): eval's is_correct then derives from the first of them."""
  task = get_task(s.task.name)
  if not task.reward_fns:
    task = dataclasses.replace(task, reward_fns=resolve.reward_functions(s.rewards.functions),
                               is_correct=None, reward_weights=s.rewards.function_weights)
  return task


def run_rewards(s, task, environments=None) -> tuple[tuple, tuple | None]:
  """The reward functions and their weights: the task's, then the config's additions
  (rewards.functions, weighed by rewards.weights), then the environments' get_reward
  (weight 1 each)."""
  fns, weights = tuple(task.reward_fns), task.reward_weights
  extra = resolve.reward_functions(s.rewards.functions)
  if extra and fns != extra:  # (the "prompt" task's own are these already: see run_task)
    weights = (*(weights or (1.0,) * len(fns)),
               *(s.rewards.function_weights or (1.0,) * len(extra)))
    fns += extra
  if environments is not None and environments.rewarded:
    weights = (*(weights or (1.0,) * len(fns)), *(1.0,) * len(environments.rewarded))
    fns += tuple(environments.reward_functions())
  if not fns and not s.rewards.models:
    raise ConfigError(
        "config: rewards.functions is empty and the environment has no get_reward(): the run "
        "has no reward; name reward functions, or give the environment a get_reward()")
  if s.rewards.overlong_buffer:
    fns += (format_rewards.OverlongPenalty(s.rollout.max_completion_length,
                                           s.rewards.overlong_buffer),)
    weights = (*(weights or (1.0,) * (len(fns) - 1)), 1.0)
  return fns, weights


def run_reward_models(s, mesh=None, *, abstract: bool = False
                      ) -> tuple[list, tuple, tuple[float, ...]]:
  """(RewardModels, their parameters placed on `mesh`, their weights): rewards.models,
  loaded in rewards.model_dtype (model.dtype when ""); abstract: their shapes and
  shardings only (the planner)."""
  from grpojax.models import reward as reward_lib

  models, params = [], []
  for path in s.rewards.models:
    m, p = reward_lib.load(hf_lib.local_dir(path, "rewards.models"),
                          dtype=s.rewards.model_dtype or s.model.dtype,
                          max_length=s.rewards.model_max_length, mesh=mesh, abstract=abstract)
    models.append(m)
    params.append(p)
  return models, tuple(params), s.rewards.model_weights


def critic_config(s, policy: models.ModelConfig) -> models.ModelConfig:
  """PPO's critic's config (advantage.estimator=gae), computing as `policy` does (dtype,
  remat, kernels, attention block): from "policy", the policy's decoder with one score
  label; else the config.json of the reward model at advantage.critic, a sequence
  classifier of one label whose vocabulary holds the policy's tokens (ConfigError)."""
  source = s.advantage.critic
  if source == "policy":
    out = policy.replace(head="score", num_labels=1)
  else:
    out = models.read_config(hf_lib.local_dir(source, "advantage.critic"))
    if out.head != "score" or out.num_labels != 1:
      raise ConfigError(
          f"config: advantage.critic={source!r} is a {out.architecture.hf_class_for(out.head)}"
          f" with {out.num_labels} labels: a critic starts from a sequence classifier "
          "with one (a reward model), or from 'policy'")
    if out.vocab_size < policy.vocab_size:
      raise ConfigError(
          f"config: advantage.critic={source!r} has a vocabulary of {out.vocab_size} "
          f"tokens, the policy {policy.vocab_size}: the critic reads the policy's tokens, so "
          "it must share its tokenizer")
  return out.replace(dtype=policy.dtype, remat=policy.remat, kernels=policy.kernels,
                     attention_block=policy.attention_block)


def critic(s, state, mesh=None) -> tuple[models.ModelConfig, dict]:
  """(config, parameters) of PPO's critic (advantage.estimator=gae; its config is
  `critic_config`'s): from "policy", the policy's decoder with a fresh scalar head
  (N(0, 0.02), seeded by train.seed); else the reward model at advantage.critic. With
  LoRA, the critic's own adapters and score head on the policy's frozen base
  (state.lora_critic)."""
  import jax  # pylint: disable=import-outside-toplevel

  from grpojax.models import transformer  # pylint: disable=import-outside-toplevel
  from grpojax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel

  policy = state.model_config
  source = s.advantage.critic
  key = jax.random.fold_in(jax.random.key(s.train.seed), 0x5C0E)
  if state.frozen is not None:  # LoRA: adapters and a head on the policy's base (the
    # settings refuse another advantage.critic with LoRA)
    from grpojax.train.state import lora_critic  # pylint: disable=import-outside-toplevel
    return lora_critic(policy, state.params, key)
  critic_cfg = critic_config(s, policy)
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


def splits(s, task) -> tuple[str, str]:
  """The (train, eval) splits: the config's, where set, else the task's own."""
  return s.task.train_split or task.splits[0], s.task.eval_split or task.splits[1]


def run_rows(s, task) -> tuple[list, list[tuple[str, list]]]:
  """(the train rows, [(name, rows)] of each held-out set eval reads): the run's own
  set first (name ""), then each of eval.sets, eval.num_prompts rows each; no sets
  when eval is off (eval.num_prompts=0)."""
  train_split, eval_split = splits(s, task)
  seed = s.train.seed
  train = load_rows(task, s.task.dataset, train_split, seed=seed)
  held_out = []
  if s.eval.num_prompts:
    for name, dataset, split in (("", "", ""), *s.eval.sets):
      try:
        rows = load_rows(task, dataset or s.task.dataset, split or eval_split, seed=seed)
      except MissingSplit as e:
        if name:  # an eval.sets entry names its own split: its message says enough
          raise
        raise DataError(f"eval: {e}: give the held-out split as task.eval_split=NAME, or "
                        "eval.num_prompts=0 for no eval") from None
      held_out.append((name, rows[:s.eval.num_prompts]))
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


def with_prompt_length(s, task, tokenizer, row_sets):
  """`s` where rollout.max_prompt_length is a number: itself, or for "auto" a copy
  holding the bucket of the longest rendered prompt in `row_sets` (lists of rows: the
  train rows and the held-out ones), so that none is filtered."""
  if s.rollout.max_prompt_length != "auto":
    return s
  longest = max((len(tokenizer.encode(prompt_text(task, row, tokenizer)))
                 for rows in row_sets for row in rows), default=1)
  length = prompt_bucket(longest)
  logging.getLogger(__name__).info(
      "rollout.max_prompt_length=auto: %d tokens (the longest prompt is %d)", length, longest)
  return dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, max_prompt_length=length))


def optimizer(s):
  """The run's optax transformation: optim.* over all its optimizer steps (train.steps
  rollouts of updates_per_step each)."""
  return make_optimizer(s.optim, s.train.steps * s.updates_per_step)


def rollout_config(s, tokenizer, micro_batches: int = 1, kv_pages: int = 0,
                   decode_slots: int = 0, environments=None) -> RolloutConfig:
  """micro_batches: the update's (fitted); the rollout's log-prob forwards take as many rows.
  kv_pages, decode_slots: the engine's pool and slots where rollout's are "auto" (fitted).
  environments: the run's (see tool_hook)."""
  r, t, a = s.rollout, s.train, s.advantage
  return RolloutConfig(
      group_size=r.group_size, max_new_tokens=r.max_completion_length,
      sampling=r.sampling, eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id,
      estimator=a.estimator, advantage_scale=a.scale, advantage_eps=a.eps,
      with_reference=s.uses_reference, with_old_logps=s.uses_old_logps,
      mask_truncated=s.loss.mask_truncated_completions,
      logprob_chunks=t.minibatches * micro_batches, generation_chunks=r.generation_chunks,
      engine=r.engine_config(kv_pages, decode_slots),
      max_staleness=r.max_staleness, partial=r.partial, carried_batches=r.carried_batches,
      hook=tool_hook(s, tokenizer, environments), gamma=a.gamma, lam=a.lam,
      whiten_rewards=a.whiten_rewards,
      reward_kl_coef=s.loss.beta if s.loss.kl_in_reward else 0.0,
      kl_estimator=s.loss.kl_estimator)


def rollout_strategy(s, engine) -> str:
  """The registered rollout strategy a run draws its rollouts with: rollout.strategy, or
  for "auto" the built-in one its dynamic sampling and engine (an EngineConfig, None
  for the lockstep sampler) call for."""
  from grpojax.train import strategy as strategy_lib

  r = s.rollout
  if r.strategy != "auto":
    return r.strategy
  return strategy_lib.choose(r.dynamic_sampling, engine, r.max_staleness)


def update_settings(s, micro_batches: int) -> dict:
  """`train.step.update`'s keyword arguments for this run, micro_batches its fitted
  number of micro-batches (grpojax.run.fit)."""
  r, t = s.rollout, s.train
  return dict(loss_config=s.loss, group_size=r.group_size,
              num_iterations=t.num_iterations, minibatches=t.minibatches,
              temperature=logp_temperature(r.sampling),
              grad_accum_steps=s.optim.grad_accum_steps, micro_batches=micro_batches)
