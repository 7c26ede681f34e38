"""The Python API, in TRL's shape: `GRPOTrainer(model, reward_funcs, args, train_dataset,
eval_dataset).train()`, on the config and the wiring the command line uses.

The trainer builds one grpojax config and validates it; `train()` runs it through
`train.loop` like `python -m grpojax.main`, writing the same workdir: config.json and
a config.py beside it, so that `python -m grpojax.main --config WORKDIR/config.py
--workdir WORKDIR` resumes a run started here, and a trainer given that config
(`grpojax.config.from_json`) resumes one started there.

What does not fit in a config is put where one can name it:
  - a dataset given as rows (a `datasets.Dataset`, a list of dicts) is written to
    WORKDIR/data/<hash of its rows>/ as train.jsonl (and test.jsonl, and one file per
    extra eval set), which task.dataset names; the rows come back exactly as given
    (grpojax.data.rows: integers past int64 stay integers), and nothing is written
    before the whole config (eval-set names included) is valid;
  - a reward function is named by its import path (module:name); one that has none
    (defined in a notebook or in the script itself, a lambda) is named
    "__main__:<name>" and found in this process only, each trainer's its own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import json
import math
import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from grpojax import config as config_lib
from grpojax.data import rows as rows_lib
from grpojax.models import config as model_config_lib
from grpojax.models import hf
from grpojax.rewards import resolve
from grpojax.rewards.base import reward_name


@dataclasses.dataclass
class GRPOConfig:
  """TRL's GRPOConfig (1.16) for the fields grpojax has, with TRL's defaults.

  A TRL script's `GRPOConfig(...)` keeps its arguments; `to_config` turns them into
  grpojax's keys (README's "Coming from TRL" has the table). Batches are counted as
  TRL counts them on one process: a generation of `generation_batch_size`
  completions (default per_device_train_batch_size x steps_per_generation) is
  `generation_batch_size / num_generations` prompts, trained in
  `steps_per_generation` minibatches (each of per_device_train_batch_size
  completions: whole groups), `gradient_accumulation_steps` of them to an optimizer
  step, `num_iterations` times. `max_steps`, `logging_steps`, `save_steps`,
  `eval_steps`, `warmup_steps` and `ref_model_sync_steps` count optimizer steps, as in
  TRL. Keys of grpojax's own config go in `config` ({"rollout.decode_slots": "auto"}).
  """

  output_dir: str | None = None  # the workdir; None: "trainer_output", as TRL
  learning_rate: float = 1e-6
  lr_scheduler_type: str = "linear"  # linear | cosine | constant | constant_with_warmup
  warmup_steps: float = 0  # optimizer steps; in (0, 1): that fraction of them
  weight_decay: float = 0.0
  adam_beta1: float = 0.9
  adam_beta2: float = 0.999
  adam_epsilon: float = 1e-8
  max_grad_norm: float = 1.0
  per_device_train_batch_size: int = 8
  gradient_accumulation_steps: int = 1
  steps_per_generation: int | None = None
  generation_batch_size: int | None = None
  num_generations: int = 8
  num_iterations: int = 1
  max_steps: int = -1
  num_train_epochs: float = 3.0
  max_completion_length: int = 512
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float | None = None
  beta: float = 0.0
  epsilon: float = 0.2
  epsilon_high: float | None = None
  delta: float | None = None
  loss_type: str = "dapo"
  importance_sampling_level: str = "token"
  mask_truncated_completions: bool = False
  top_entropy_quantile: float = 1.0
  entropy_coef: float = 0.0
  off_policy_mask_threshold: float | None = None
  use_bias_correction_kl: bool = True
  sapo_temperature_pos: float = 1.0
  sapo_temperature_neg: float = 1.05
  vespo_k_pos: float = 2.0
  vespo_lambda_pos: float = 3.0
  vespo_k_neg: float = 3.0
  vespo_lambda_neg: float = 2.0
  scale_rewards: str | bool = "group"
  multi_objective_aggregation: str = "sum_then_normalize"
  reward_weights: list[float] | None = None
  sync_ref_model: bool = False
  ref_model_mixup_alpha: float = 0.6
  ref_model_sync_steps: int = 512
  seed: int = 42
  logging_steps: float = 10
  save_strategy: str = "steps"  # steps | no (the start and the end only)
  save_steps: float = 500
  save_total_limit: int | None = None  # None: grpojax's train.keep_checkpoints
  eval_strategy: str = "no"  # no (the start and the end only) | steps
  eval_steps: float | None = None  # None: logging_steps
  report_to: str | list[str] = "none"  # none | all | tensorboard | wandb, or a list
  log_completions: bool = False
  bf16: bool | None = None  # True: bfloat16 compute (model.dtype), float32 master weights
  gradient_checkpointing: bool | None = None  # None: grpojax's choice by memory (model.remat)
  use_vllm: bool = False  # grpojax generates with its own engine: False only
  max_tool_calling_iterations: int | None = None  # tool turns per completion; None: any
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # grpojax keys

  def to_config(self, train_rows: int | None = None) -> ml_collections.ConfigDict:
    """grpojax's config for these arguments: get_config() with TRL's values applied,
    then `config`'s. train_rows: the train dataset's length, for num_train_epochs
    (needed when max_steps is -1). Raises config.ConfigError in one line."""
    if self.use_vllm:
      _fail("use_vllm=True", "grpojax generates with its own engine (rollout.engine); "
            "drop use_vllm")
    G, per = self.num_generations, self.per_device_train_batch_size
    spg = self.steps_per_generation or (
        self.generation_batch_size // per if self.generation_batch_size else
        self.gradient_accumulation_steps)
    generation = self.generation_batch_size or per * spg
    if per % G or generation != per * spg:
      _fail(f"per_device_train_batch_size={per}",
            f"must hold whole groups of num_generations={G} completions, and "
            f"generation_batch_size={generation} be steps_per_generation={spg} of them "
            "(grpojax's minibatches hold whole groups)")
    ga = self.gradient_accumulation_steps
    updates = spg * self.num_iterations // ga  # optimizer steps per generation
    if (spg * self.num_iterations) % ga:
      _fail(f"gradient_accumulation_steps={ga}", f"must divide steps_per_generation x "
            f"num_iterations = {spg * self.num_iterations}")
    prompts = generation // G
    if self.max_steps > 0:
      if self.max_steps % updates:
        _fail(f"max_steps={self.max_steps}", f"must be a multiple of the {updates} optimizer "
              "steps each generation makes (steps_per_generation x num_iterations / "
              "gradient_accumulation_steps)")
      rollouts = self.max_steps // updates
    else:
      if train_rows is None:
        _fail("max_steps=-1", "needs the train dataset's length (num_train_epochs): give "
              "max_steps")
      rollouts = math.ceil(self.num_train_epochs * (train_rows // prompts))
      if rollouts < 1:
        _fail(f"num_train_epochs={self.num_train_epochs}", f"trains no step: the train "
              f"dataset's {train_rows} rows make {train_rows // prompts} batches of {prompts} "
              "prompts an epoch")
    total = rollouts * updates

    def in_steps(value) -> int:  # TRL's optimizer steps (or a fraction of them) as rollouts
      steps = math.ceil(value * total) if 0 < value < 1 else int(value)
      return max(1, steps // updates) if steps else 0

    schedules = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                 "constant_with_warmup": "constant"}
    if self.lr_scheduler_type not in schedules:
      _fail(f"lr_scheduler_type={self.lr_scheduler_type!r}", f"is not one grpojax has; "
            f"known: {list(schedules)}")
    warmup = 0 if self.lr_scheduler_type == "constant" else (
        math.ceil(self.warmup_steps * total) if 0 < self.warmup_steps < 1 else int(self.warmup_steps))
    scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
    aggregation = {"sum_then_normalize": None, "normalize_then_sum": "gdpo"}
    if self.multi_objective_aggregation not in aggregation:
      _fail(f"multi_objective_aggregation={self.multi_objective_aggregation!r}",
            f"known: {list(aggregation)}")
    loggers = _loggers(self.report_to)
    log_every = in_steps(self.logging_steps) or 1
    out = {
        "optim.learning_rate": self.learning_rate,
        "optim.schedule": schedules[self.lr_scheduler_type],
        "optim.warmup_steps": warmup, "optim.weight_decay": self.weight_decay,
        "optim.b1": self.adam_beta1, "optim.b2": self.adam_beta2, "optim.eps": self.adam_epsilon,
        "optim.max_grad_norm": self.max_grad_norm, "optim.grad_accum_steps": ga,
        "rollout.prompts_per_step": prompts, "rollout.group_size": G,
        "rollout.max_completion_length": self.max_completion_length,
        "rollout.temperature": self.temperature, "rollout.top_p": self.top_p,
        "rollout.top_k": self.top_k, "rollout.min_p": self.min_p or 0.0,
        "rollout.max_tool_calling_iterations": (-1 if self.max_tool_calling_iterations is None
                                                else self.max_tool_calling_iterations),
        "train.minibatches": spg, "train.num_iterations": self.num_iterations,
        "train.steps": rollouts, "train.seed": self.seed, "train.log_every": log_every,
        "train.save_every": (in_steps(self.save_steps)
                             if self.save_strategy == "steps" else 0),
        "train.eval_every": (in_steps(self.eval_steps or self.logging_steps)
                             if self.eval_strategy == "steps" else 0),
        "train.loggers": ",".join(loggers),
        "train.log_completions": log_every if self.log_completions else 0,
        "loss.beta": self.beta, "loss.epsilon_low": self.epsilon,
        "loss.epsilon_high": self.epsilon_high, "loss.delta": self.delta,
        "loss.loss_type": self.loss_type,
        "loss.importance_sampling_level": self.importance_sampling_level,
        "loss.mask_truncated_completions": self.mask_truncated_completions,
        "loss.top_entropy_quantile": self.top_entropy_quantile,
        "loss.entropy_coef": self.entropy_coef,
        "loss.off_policy_mask_threshold": self.off_policy_mask_threshold,
        "loss.use_bias_correction_kl": self.use_bias_correction_kl,
        "loss.sapo_tau_pos": self.sapo_temperature_pos,
        "loss.sapo_tau_neg": self.sapo_temperature_neg,
        "loss.vespo_k_pos": self.vespo_k_pos, "loss.vespo_lambda_pos": self.vespo_lambda_pos,
        "loss.vespo_k_neg": self.vespo_k_neg, "loss.vespo_lambda_neg": self.vespo_lambda_neg,
        "advantage.scale": scale,
        "rewards.weights": tuple(self.reward_weights or ()) or "",
    }
    if aggregation[self.multi_objective_aggregation]:
      out["advantage.estimator"] = aggregation[self.multi_objective_aggregation]
    if self.sync_ref_model:
      out["train.ref_sync_every"] = in_steps(self.ref_model_sync_steps)
      out["train.ref_sync_alpha"] = self.ref_model_mixup_alpha
    if self.save_total_limit is not None:
      out["train.keep_checkpoints"] = self.save_total_limit
    if self.bf16:
      out["model.dtype"] = "bfloat16"
    if self.gradient_checkpointing is not None:
      out["model.remat"] = bool(self.gradient_checkpointing)
    return config_lib.apply(config_lib.get_config(), {**out, **config_lib.dotted(self.config)})


def _fail(what: str, why: str):
  raise config_lib.ConfigError(f"GRPOConfig: {what} {why}")


def _loggers(report_to) -> list[str]:
  names = [report_to] if isinstance(report_to, str) else list(report_to or [])
  if names in (["none"], []):
    return []
  if names == ["all"]:
    return ["tensorboard", "wandb"]
  return names


def _import_path(fn) -> str | None:
  """module:name that imports `fn` itself (a module-level function, class instance or
  other callable), or None (a lambda, a closure, anything of __main__)."""
  module = getattr(fn, "__module__", None) or type(fn).__module__
  if module in (None, "__main__") or module not in sys.modules:
    return None
  name = getattr(fn, "__qualname__", None)
  candidates = [name] if name and "." not in name and "<" not in name else []
  candidates += [k for k, v in vars(sys.modules[module]).items() if v is fn]
  for name in candidates:
    try:
      if getattr(importlib.import_module(module), name) is fn:
        return f"{module}:{name}"
    except AttributeError:
      continue
  return None


def reward_paths(reward_funcs) -> list[str]:
  """The rewards.functions entries for TRL's `reward_funcs` (a callable, an import
  path, or a list of them); callables no import reaches are registered in
  resolve.IN_PROCESS_REWARDS as "__main__:<name>"."""
  paths, own = _reward_paths(reward_funcs)
  resolve.IN_PROCESS_REWARDS.update(own)
  return paths


def _reward_paths(reward_funcs) -> tuple[list[str], dict]:
  """(rewards.functions entries, {"__main__:<name>": function} of those no import reaches)."""
  funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
  out, own = [], {}
  for fn in funcs:
    if isinstance(fn, str):
      if not re.fullmatch(r"[\w.]+[:.]\w+", fn):
        raise config_lib.ConfigError(
            f"reward_funcs: {fn!r} is neither an import path (module:function) nor, given to "
            "GRPOTrainer, a reward model (an HF sequence classifier's directory or Hub id)")
      out.append(fn)
    elif callable(fn):
      path = _import_path(fn)
      if path is None:
        base = re.sub(r"\W", "_", reward_name(fn)).strip("_") or "reward"
        path, i = f"__main__:{base}", 1
        while path in out:  # two of one name in this list; a name given again later
          i += 1            # (a notebook cell run twice) is the newer function
          path = f"__main__:{base}_{i}"
        own[path] = fn
      out.append(path)
    else:
      raise config_lib.ConfigError(f"reward_funcs: {fn!r} is neither a callable nor an import "
                                   "path (module:function)")
  return out, own


def _reward_models(reward_funcs, weights, processing_classes) -> tuple[list, list[str], object]:
  """(the functions, the reward models, rewards.weights in grpojax's order) of TRL's
  `reward_funcs`: a directory holding a config.json, or a Hub id (owner/name), is a
  reward model. TRL weighs the entries in their order; grpojax puts the models after
  the functions, and the weights follow them there."""
  funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
  is_model = [isinstance(f, str) and (os.path.isfile(os.path.join(f, "config.json")) or
                                     (hf.is_hub_id(f) and not os.path.exists(f)))
              for f in funcs]
  if processing_classes is not None:
    given = (processing_classes if isinstance(processing_classes, (list, tuple))
             else [processing_classes])
    if any(p is not None for p in given):
      raise config_lib.ConfigError(
          "reward_processing_classes: grpojax reads each reward model's tokenizer from its "
          "own directory (save it there with save_pretrained); pass None")
  models = [f if not os.path.exists(f) else os.path.abspath(f)
            for f, m in zip(funcs, is_model) if m]
  w = weights
  parts = ([x.strip() for x in w.split(",") if x.strip()] if isinstance(w, str) else list(w or ()))
  if parts and len(parts) == len(funcs):  # else validate says what is wrong
    parts = [x for x, m in zip(parts, is_model) if not m] + [x for x, m in zip(parts, is_model) if m]
    w = ",".join(str(x) for x in parts)
  return [f for f, m in zip(funcs, is_model) if not m], models, w


def _tool_paths(tools) -> tuple[list[str], dict]:
  """(rollout.tools entries, {"__main__:<name>": tool} of those no import reaches) for
  TRL's `tools` (functions, sync or async; here also classes: one instance per row)."""
  out, own = [], {}
  for tool in tools if isinstance(tools, (list, tuple)) else [tools]:
    if not callable(tool):
      raise config_lib.ConfigError(f"tools: {tool!r} is neither a function nor a class")
    path = _import_path(tool)
    if path is None:
      path = f"__main__:{tool.__name__}"
      own[path] = tool
    out.append(path)
  return out, own


def _environment_paths(factory) -> tuple[list[str], dict]:
  """(rollout.environment entries, {"__main__:<name>": factory} of those no import
  reaches) for TRL's `environment_factory`: a callable, or {name: callable}."""
  named = factory.items() if isinstance(factory, Mapping) else [(None, factory)]
  out, own = [], {}
  for name, make in named:
    if not callable(make):
      raise config_lib.ConfigError(f"environment_factory: {make!r} is not callable (give a "
                                   "class, or a function that returns an environment)")
    if name is not None and not re.fullmatch(r"[\w.-]+", str(name)):
      raise config_lib.ConfigError(f"environment_factory: the name {name!r} must be a word "
                                   "(letters, digits, _ . -), as the `environment` column has it")
    path = _import_path(make)
    if path is None:
      path = "__main__:" + (re.sub(r"\W", "_", getattr(make, "__name__", "")).strip("_")
                            or "environment")
      path += f"_{name}" if name is not None and path in own else ""
      own[path] = make
    out.append(path if name is None else f"{name}={path}")
  return out, own


# Serialises the trainers' use of resolve.IN_PROCESS_REWARDS, where the run's setup
# looks "__main__:<name>" up: trainers of one process (two notebooks' cells, threads)
# may name different functions alike.
_IN_PROCESS_LOCK = threading.Lock()


@contextlib.contextmanager
def _in_process_rewards(own: Mapping):
  """resolve.IN_PROCESS_REWARDS with `own` over it meanwhile, as it was after."""
  registry, missing = resolve.IN_PROCESS_REWARDS, object()
  with _IN_PROCESS_LOCK:
    saved = {path: registry.get(path, missing) for path in own}
    registry.update(own)
    try:
      yield
    finally:
      for path, fn in saved.items():
        if fn is missing:
          registry.pop(path, None)
        else:
          registry[path] = fn


def _rows(dataset) -> list[dict]:
  if isinstance(dataset, Mapping):
    raise config_lib.ConfigError("train_dataset is a mapping: give one dataset (a "
                                 "datasets.Dataset or a list of dicts)")
  rows = [dict(row) for row in dataset]
  if not rows:
    raise config_lib.ConfigError("train_dataset/eval_dataset is empty")
  return rows


# An eval set's name is a file name (<name>.jsonl) and a metric prefix (eval/<name>/):
# ASCII letters, digits, _ and -, starting with a letter, as eval.sets takes them.
_EVAL_SET_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_RESERVED_SETS = ("train", "test")  # the files of the train rows and of the first eval set


def _check_eval_set_names(names: Sequence) -> None:
  """ConfigError unless the names of eval sets 2.. can name files and metrics: the first
  set's name is not used (it is the run's own eval/..., test.jsonl). Compared
  case-blind: on macOS and Windows "Train" is train.jsonl."""
  seen = {}
  for name in names[1:]:
    if not isinstance(name, str) or not _EVAL_SET_NAME.fullmatch(name) or name == "accuracy":
      raise config_lib.ConfigError(
          f"eval_dataset: the set name {name!r} must be a letter then ASCII letters, digits, "
          "_ or - (it names a file and the metrics eval/<name>/...), and not 'accuracy'")
    key = name.casefold()
    if key in _RESERVED_SETS or key in seen:
      clash = f"eval set {seen[key]!r}" if key in seen else f"{key}.jsonl, the " + (
          "train rows" if key == "train" else "first eval set")
      raise config_lib.ConfigError(f"eval_dataset: the set name {name!r} would be written over "
                                   f"{clash}; rename it")
    seen[key] = name


def _environment_owns_the_data(factory, cfg) -> list[dict]:
  """TRL 1.16's run without a train_dataset: the environment's reset() text is the whole
  prompt. One generation's prompts of an empty user message, read again each step;
  each reset is keyed by its place in the run (Environments.reset's `keys`), so a group
  draws one problem and each step new ones."""
  if isinstance(factory, Mapping):
    raise config_lib.ConfigError(
        "environment_factory: a dict of environments routes rows by the dataset's "
        "`environment` column: give a train_dataset with one, or a single environment")
  if cfg.train.steps <= 0:
    raise config_lib.ConfigError("without a train_dataset (the environment owns the data), "
                                 "give max_steps: there are no epochs to count")
  return [{"prompt": [{"role": "user", "content": ""}]}] * cfg.rollout.prompts_per_step


def _eval_sets(eval_dataset) -> list[tuple[str, list[dict]]]:
  """eval_dataset (rows, or a dict {name: rows}) as (name, rows), the names checked first."""
  if eval_dataset is None:
    return []
  if not isinstance(eval_dataset, Mapping):
    return [("", _rows(eval_dataset))]
  _check_eval_set_names(list(eval_dataset))
  return [(name, _rows(rows)) for name, rows in eval_dataset.items()]


def _dataset_files(train: list[dict], evals: Sequence[tuple[str, list[dict]]]
                   ) -> tuple[dict[str, str], str]:
  """({file name: JSON lines}, the hash of them all) of the rows: train.jsonl, the first
  eval set as test.jsonl, the others as <name>.jsonl."""
  def lines(rows, what):
    try:
      return rows_lib.dumps(rows, what)
    except ValueError as e:
      raise config_lib.ConfigError(f"{e} (dataset rows are stored as JSON)") from None

  _check_eval_set_names([name for name, _ in evals])
  files = {"train.jsonl": lines(train, "train_dataset")}
  for i, (name, rows) in enumerate(evals):
    what = f"eval_dataset[{name!r}]" if name else "eval_dataset"
    files["test.jsonl" if i == 0 else f"{name}.jsonl"] = lines(rows, what)
  digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
  return files, digest


def _data_dir(workdir: str, digest: str) -> str:
  return os.path.abspath(os.path.join(workdir, "data", digest))


def write_datasets(workdir: str, train: list[dict],
                   evals: Sequence[tuple[str, list[dict]]] = ()) -> str:
  """Writes the rows to WORKDIR/data/<hash>/ (train.jsonl; the first eval set as
  test.jsonl, the others as <name>.jsonl) and returns that directory: the same rows
  give the same directory, so a resumed run finds its own data, and other rows
  another one (which the resume check then names). Several processes (the hosts of
  one job, on shared storage) may write it at once (grpojax.data.rows.write)."""
  files, digest = _dataset_files(train, evals)
  out = _data_dir(workdir, digest)
  rows_lib.write(out, files)
  return out


def _lora_keys(peft_config) -> dict:
  """model.lora.* from TRL's peft_config: a peft.LoraConfig (or any object or dict with its
  r, lora_alpha, target_modules and lora_dropout)."""
  get = (peft_config.get if isinstance(peft_config, Mapping)
         else lambda k, d=None: getattr(peft_config, k, d))
  if get("lora_dropout", 0.0):
    raise config_lib.ConfigError(
        f"peft_config.lora_dropout={get('lora_dropout')}: grpojax's adapters have no dropout "
        "(it would make the update's policy differ from the sampler's); set it to 0")
  for key, off in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
    if get(key, off) != off:
      raise config_lib.ConfigError(f"peft_config.{key}={get(key)!r} is not supported "
                                   f"(only {off!r})")
  targets = get("target_modules", None) or "all"
  if not isinstance(targets, str):
    targets = ",".join(targets)
  return {"model.lora.rank": int(get("r", 8)), "model.lora.alpha": float(get("lora_alpha", 8)),
          "model.lora.targets": targets}


class GRPOTrainer:
  """GRPO in TRL's shape: `GRPOTrainer(model, reward_funcs, args, train_dataset).train()`.

  Args:
    model: an HF-format directory or Hub id (model.path), or a grpojax preset name
      (model.arch: "tiny", "qwen2.5-0.5b", ...).
    reward_funcs: a reward function or a list: callables with TRL's signature (any
      callable, async ones too), import paths "module:function", or reward models: the
      HF directory or Hub id of a sequence classifier (rewards.models; scored on the
      device, its text through its own tokenizer's chat template, as TRL's).
    reward_processing_classes: TRL's; None, or None per entry: each reward model's
      tokenizer is the one in its directory.
    args: a GRPOConfig (TRL's names and defaults); or grpojax's own config, a
      ConfigDict (e.g. grpojax.config.from_json(WORKDIR/config.json)) or a dict of
      its keys over get_config()'s defaults ({"rollout.group_size": 4}).
    train_dataset: rows in TRL's formats (a "prompt" column of text or chat
      messages, other columns for the rewards): a datasets.Dataset or a list of
      dicts, or a dataset name or path as task.dataset takes it. None: the config's.
    eval_dataset: held-out rows of the same kinds, or a dict {name: rows} (the
      first is the run's eval/..., the others eval/<name>/...). None: no eval
      where the rows were given here.
    processing_class: a tokenizer directory (model.tokenizer) when not the model's.
    peft_config: TRL's: a peft.LoraConfig (or a dict of its fields) trains LoRA adapters
      (model.lora.*: r, lora_alpha, target_modules; lora_dropout must be 0). QLoRA's
      quantised base is grpojax's own key: config={"model.lora.quantize": "nf4"}.
    output_dir: the workdir, where args is not a GRPOConfig (which has its own).
    tools: TRL's: functions (typed, Google-style docstrings; sync or async) the policy
      calls between its turns (rollout.tools); here also classes, one instance per row.
    environment_factory: TRL's: a class (or function) making an environment, or
      {name: class} routed by the dataset's `environment` column (rollout.environment):
      each completion gets an instance, reset(**example) before the rollout (its text
      joins the prompt; a group's G resets must agree), its public methods the tools,
      its get_reward() a reward of weight 1; reward functions get the instances as
      `environments`. reward_funcs may be None where the environment has get_reward;
      train_dataset may be None with one environment (it owns the data: its reset()
      text is the prompt; give max_steps).

  After `train()`: `state` (the TrainState), `model` (a grpojax.models.Transformer
  with the trained weights), `tokenizer`, and `save_model(dir)` (HF format).
  """

  def __init__(self, model: str | None = None, reward_funcs=None, args=None,
               train_dataset=None, eval_dataset=None, processing_class=None, *,
               peft_config=None, output_dir: str | None = None, tools=None,
               environment_factory=None, reward_processing_classes=None):
    trl_args = args if isinstance(args, GRPOConfig) else GRPOConfig() if args is None else None
    if trl_args is not None and trl_args.output_dir and output_dir:
      raise config_lib.ConfigError("output_dir is given twice: in GRPOConfig and to GRPOTrainer")
    workdir = output_dir or (trl_args and trl_args.output_dir) or "trainer_output"
    if isinstance(args, ml_collections.ConfigDict):
      cfg = copy.deepcopy(args)
    elif trl_args is None:
      if not isinstance(args, Mapping):
        raise config_lib.ConfigError(f"args: {type(args).__name__} is none of GRPOConfig, a "
                                     "grpojax config (ConfigDict) or a dict of its keys")
      cfg = config_lib.apply(config_lib.get_config(), args)
    train_rows = None if train_dataset is None or isinstance(train_dataset, str) else _rows(
        train_dataset)
    if trl_args is not None:
      cfg = trl_args.to_config(None if train_rows is None else len(train_rows))
    if train_dataset is None and environment_factory is not None:
      train_rows = _environment_owns_the_data(environment_factory, cfg)
    self.workdir = workdir

    updates = {}
    if model is not None:
      if os.path.isdir(model) or hf.is_hub_id(model):
        updates["model.path"] = model
      elif model in model_config_lib.PRESETS:
        updates.update({"model.path": "", "model.arch": model})
      else:
        raise config_lib.ConfigError(f"model={model!r} is neither a directory, a Hub id "
                                     f"(owner/name) nor a preset: {sorted(model_config_lib.PRESETS)}")
    if processing_class is not None:
      if not isinstance(processing_class, str):
        raise config_lib.ConfigError("processing_class: give the tokenizer's directory (a path), "
                                     "as model.tokenizer takes it")
      updates["model.tokenizer"] = processing_class
    if peft_config is not None:
      updates.update(_lora_keys(peft_config))
    if environment_factory is not None:
      entries, own = _environment_paths(environment_factory)
      resolve.IN_PROCESS_TOOLS.update(own)
      updates["rollout.environment"] = ",".join(entries)
    if tools:
      paths, own = _tool_paths(tools)
      resolve.IN_PROCESS_TOOLS.update(own)
      updates["rollout.tools"] = ",".join(paths)
    self._rewards: dict = {}  # "__main__:<name>" -> this trainer's own function
    if reward_funcs is not None:
      funcs, reward_models, weights = _reward_models(reward_funcs, cfg.rewards.weights,
                                                     reward_processing_classes)
      paths, self._rewards = _reward_paths(funcs) if funcs else ([], {})
      updates["rewards.functions"] = ",".join(paths)
      if reward_models:
        updates.update({"rewards.models": ",".join(reward_models), "rewards.weights": weights})
    given = trl_args is not None or "task.name" not in config_lib.dotted(args or {})
    files = None
    if isinstance(train_dataset, str):
      updates["task.dataset"] = train_dataset
    elif train_rows is not None:
      evals = _eval_sets(eval_dataset)
      files, digest = _dataset_files(train_rows, evals)
      data = _data_dir(workdir, digest)
      updates.update({"task.dataset": data, "task.train_split": "train",
                      "task.eval_split": "test",
                      "eval.num_prompts": max((len(r) for _, r in evals[:1]), default=0),
                      "eval.sets": ",".join(f"{n}={data}@{n}" for n, _ in evals[1:])})
      if given and not isinstance(args, ml_collections.ConfigDict):
        updates["task.name"] = "prompt"  # TRL's formats
    config = config_lib.apply(cfg, updates)
    if files is not None:
      # Validated before the rows are written, so that a refused config writes
      # nothing: with the root directory in place of the data directory, which is
      # not there yet (of a local dataset, validate asks only that it exist).
      stand_in = {"task.dataset": os.path.abspath(os.sep),
                  "eval.sets": ",".join(f"{n}={os.path.abspath(os.sep)}@{n}"
                                        for n, _ in evals[1:])}
      config_lib.validate(config_lib.apply(copy.deepcopy(config), stand_in))
      rows_lib.write(data, files)
    self.config = config_lib.validate(config)
    # Also where resolve.reward_functions finds them outside train() (the newest
    # trainer's), as before; train() looks up this trainer's own first.
    resolve.IN_PROCESS_REWARDS.update(self._rewards)
    self.state = self.tokenizer = None
    self._export = {}
    self.summary: dict | None = None

  def train(self) -> dict:
    """Runs (or resumes, from the checkpoints in the workdir) the config; returns the
    summary dict (start/end eval, last metrics, speed, the HF export's directory)."""
    from grpojax.train import loop  # pylint: disable=import-outside-toplevel

    from grpojax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
    from grpojax.parallel import peers  # pylint: disable=import-outside-toplevel
    from grpojax.train import checkpoint  # pylint: disable=import-outside-toplevel

    loop.show_info()
    mesh_lib.initialize_distributed()  # before the lock: process 0 holds it
    # A process that fails stops its peers at once (not at JAX's abort, 100 s on).
    with peers.failing_stops_peers(), checkpoint.workdir_lock(self.workdir):
      with _in_process_rewards(self._rewards):  # setup looks the functions up
        job = loop.setup(self.config, self.workdir)
      self.tokenizer = job.tokenizer
      self._export = job.export
      self.summary = loop.run(job)
    self.state = job.state
    import jax  # pylint: disable=import-outside-toplevel

    if not self.summary["preempted"] and jax.process_index() == 0:
      from grpojax import plot  # pylint: disable=import-outside-toplevel

      plot.plot_metrics(self.workdir)  # as the command line does: plots and the table
      loop.print_summary(self.summary, self.workdir)
    return self.summary

  @property
  def model(self):
    """The trained policy as a grpojax.models.Transformer (after train())."""
    if self.state is None:
      raise RuntimeError("GRPOTrainer.model: call train() first")
    from grpojax import models  # pylint: disable=import-outside-toplevel

    from grpojax.models import lora  # pylint: disable=import-outside-toplevel

    params = self.state.params
    if self.state.frozen is not None:  # LoRA: the adapters folded into the base
      params = lora.merge(self.state.model_params, self.state.model_config.lora_scale)
    return models.Transformer(self.state.model_config, params=params)

  def save_model(self, output_dir: str | None = None) -> str:
    """Writes the trained policy (and tokenizer) as an HF-format directory; returns it."""
    if self.state is None:
      raise RuntimeError("GRPOTrainer.save_model: call train() first")
    from grpojax.train import checkpoint  # pylint: disable=import-outside-toplevel

    return checkpoint.export_hf(self.state, output_dir or os.path.join(self.workdir, "hf"),
                                tokenizer=self.tokenizer, **self._export)

