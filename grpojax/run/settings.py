"""A run's settings: the config read once, into frozen sections that check themselves.

`read(cfg)` is the only function that reads an ml_collections config (the
schema, grpojax.config); everything below the entry points (the loop's
`setup`, the planner's `plan`) takes the `Settings` it returns. Each section
is a frozen dataclass whose fields are the config keys of the same names, the
string mini-languages parsed (rewards.functions as a tuple of import paths,
eval.k as sorted ints, ...); its `__post_init__` refuses a bad value in one
line naming the key. `Settings.__post_init__` holds the rules that join
sections. The loss and the optimizer sections are the library's own
settings types (core.losses.LossConfig, train.optim.OptimConfig), which check
themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import ml_collections

from grpojax.core import advantages as advantages_lib
from grpojax.core import losses as losses_lib
from grpojax.data import tasks as tasks_lib
from grpojax.errors import ConfigError
from grpojax.models import config as model_config
from grpojax.models import hf as hf_lib
from grpojax.models import lora as lora_lib
from grpojax.parallel import mesh as mesh_lib
from grpojax.sampling import engine as engine_lib
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import metrics as metrics_lib
from grpojax.train import optim as optim_lib

DTYPES = ("float32", "bfloat16")
# A split as datasets.load_dataset takes it: a name and an optional slice ("train[10:20%]").
_SPLIT = re.compile(r"[\w.-]+(\[[^\[\]]*\])?")
_IMPORT_PATH = re.compile(r"[\w.]+[:.]\w+")
_EVAL_SET_NAME = re.compile(r"[A-Za-z][\w-]*")


def _refuse(key: str, value, why: str):
  """The one-line ConfigError for `key`=`value`."""
  raise ConfigError(f"config: {key}={value!r} {why}")


_FIELD_ERROR = re.compile(r"(?:\w+\.)*(\w+)=(.*)", re.DOTALL)


def _checked(section: str, build, keys: dict | None = None):
  """build(): a settings type made from `section`'s keys, which checks its own values.
  Its ValueError ("[Type.]field=value why") becomes a ConfigError naming the key:
  `section.field`, or keys[field] where a field is named otherwise in the config."""
  try:
    return build()
  except ValueError as e:
    match = _FIELD_ERROR.fullmatch(str(e))
    if not match:
      raise ConfigError(f"config: {e}") from None
    field, rest = match.groups()
    raise ConfigError(f"config: {(keys or {}).get(field, f'{section}.{field}')}={rest}") from None


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _missing_local(dataset: str) -> bool:
  """A dataset that reads as a local file or directory but is not here."""
  return bool(dataset) and (dataset.startswith(("/", "./", "../", "~"))
                            or dataset.endswith((".json", ".jsonl", ".parquet"))
                            ) and not os.path.exists(os.path.expanduser(dataset))


def _is_hub(path: str) -> bool:
  """A Hub id (owner/name) that is not a local path: downloaded when the run starts."""
  return hf_lib.is_hub_id(path) and not os.path.exists(path)


# The mini-languages of the command line, each parsed beside the section that holds it.

def parse_list(spec: str) -> tuple[str, ...]:
  """A comma-separated list ("a:f, b.g") as its entries, in order, blanks dropped."""
  return tuple(p.strip() for p in str(spec).split(",") if p.strip())


def parse_environments(spec: str) -> dict:
  """rollout.environment as {name: import path} (name None: the one environment)."""
  out = {}
  for entry in parse_list(spec):
    name, _, path = entry.rpartition("=")
    out[name.strip() or None] = path.strip()
  bad = [p for p in out.values() if not _IMPORT_PATH.fullmatch(p)]
  if bad or (len(out) > 1 and None in out):
    _refuse("rollout.environment", spec, "must be one import path, module:Class, or several "
            "as name=module:Class,other=module:Other")
  return out


def parse_weights(w, n: int) -> tuple[float, ...] | None:
  """rewards.weights as `n` floats (rewards.functions' then rewards.models'); None when
  "" (each 1). ConfigError unless numbers, as many as the functions and models."""
  parts = (list(parse_list(w)) if isinstance(w, str)
           else list(w) if isinstance(w, (list, tuple)) else [w])
  if not parts:
    return None
  try:
    values = tuple(float(p) for p in parts if not isinstance(p, bool))
  except (TypeError, ValueError):
    values = ()
  if len(values) != len(parts) or len(values) != n:
    raise ConfigError(f"config: rewards.weights={w!r} must be {n} number(s), one per function "
                      f"of rewards.functions then one per reward model of rewards.models "
                      f"({n} given), e.g. '1,0.5'; '' weighs each 1")
  return values


def parse_ks(k) -> tuple[int, ...]:
  """eval.k as sorted distinct ks: () for 0 or "" (off). ConfigError unless ints >= 1."""
  given = k
  not_ints = ConfigError(f"config: eval.k={k!r} must be an integer or comma-separated "
                         "integers, e.g. 4 or '1,4,8'")
  if isinstance(k, str):
    parts = parse_list(k)
    if not all(re.fullmatch(r"-?\d+", p) for p in parts):
      raise not_ints
    k = [int(p) for p in parts]
  values = [k] if _is_int(k) else k
  if not isinstance(values, (list, tuple)) or not all(_is_int(v) for v in values):
    raise not_ints
  if list(values) in ([0], []):  # 0 or "": off
    return ()
  if min(values) < 1:
    raise ConfigError(f"config: eval.k={given!r} must be >= 1 each (0 alone: "
                      "greedy accuracy only)")
  return tuple(sorted(set(values)))


def parse_eval_sets(spec: str) -> tuple[tuple[str, str, str], ...]:
  """eval.sets as (name, dataset, split); "" dataset: task.dataset's, "" split: the run's
  eval split. ConfigError on an entry that is not name=dataset[@split]."""
  out = []
  for entry in parse_list(spec):
    name, eq, rest = entry.partition("=")
    name, rest = name.strip(), rest.strip()
    # Splits never hold "@"; a path or hub name might, so the split is after the last one.
    dataset, at, split = rest.rpartition("@")
    dataset, split = (dataset, split) if at else (rest, "")
    if not eq or not _EVAL_SET_NAME.fullmatch(name) or name == "accuracy":
      raise ConfigError(f"config: eval.sets={spec!r}: entry {entry!r} must be "
                        "name=dataset[@split], the name a letter then letters, digits, _ or - "
                        "(not 'accuracy'), e.g. 'hard=arithmetic:3:+' or "
                        "'gsm=openai/gsm8k:main@test'")
    if split and not _SPLIT.fullmatch(split):
      raise ConfigError(f"config: eval.sets={spec!r}: entry {name!r} has split "
                        f"{split!r}, not one split with an optional slice, e.g. 'test[:200]'")
    if name in [n for n, _, _ in out]:
      raise ConfigError(f"config: eval.sets={spec!r} names {name!r} twice")
    if _missing_local(dataset.strip()):
      raise ConfigError(f"config: eval.sets={spec!r} names {dataset.strip()!r} for set {name!r}, "
                        "which is not a file or directory here (a local dataset must exist; a "
                        "hub dataset is named owner/name or owner/name:subset)")
    out.append((name, dataset.strip(), split))
  return tuple(out)


def parse_expected_lengths(spec) -> tuple[float, float] | None:
  """rollout.expected_lengths as (median tokens, sigma) of a lognormal; None where it
  is "" (unknown)."""
  if not spec:
    return None
  kind, *args = str(spec).split(":")
  try:
    median, sigma = (float(a) for a in args)
  except ValueError:
    median = sigma = -1.0
  if kind != "lognormal" or median < 1 or sigma < 0:
    raise ConfigError(f"config: rollout.expected_lengths={spec!r} must be '' or "
                      "'lognormal:MEDIAN:SIGMA' (MEDIAN tokens >= 1, SIGMA >= 0)")
  return median, sigma


def parse_tail_slots(value):
  """rollout.tail_slots as EngineConfig's: None for "auto", () for 0, else a tuple
  (EngineConfig checks its numbers)."""
  if value == "auto":
    return None
  if _is_int(value):
    return () if value == 0 else (value,)
  return tuple(value) if isinstance(value, (tuple, list)) else value


@dataclasses.dataclass(frozen=True)
class Model:
  """model.*: what the policy is and how it computes. lora: model.lora's rank, alpha,
  targets and quantize (export_merged beside it)."""

  path: str
  tokenizer: str
  arch: str
  dtype: str
  remat: Any  # bool | "auto" | "none" | "full" | "dots"
  kernels: str
  attention_block: int
  ref_dtype: str
  lora: lora_lib.LoraConfig
  export_merged: bool

  def __post_init__(self):
    for key in ("dtype", "ref_dtype"):
      if getattr(self, key) not in DTYPES:
        _refuse(f"model.{key}", getattr(self, key), f"is unknown; known: {list(DTYPES)}")
    if not (isinstance(self.remat, bool) or self.remat in ("auto", "none", "full", "dots")):
      _refuse("model.remat", self.remat, "must be True, False or 'auto', or a policy: 'none', "
              "'full', 'dots' (per-layer rematerialisation in the update)")
    if self.kernels not in model_config.KERNELS:
      _refuse("model.kernels", self.kernels, f"is unknown; known: {list(model_config.KERNELS)}")
    if not _is_int(self.attention_block) or self.attention_block < 0:
      _refuse("model.attention_block", self.attention_block, "must be an int >= 0 (0: never "
              f"blockwise), got {self.attention_block!r}")
    if self.path and not self.hub and not os.path.isdir(self.path):
      _refuse("model.path", self.path, "is not a directory (an HF-format dir with config.json, "
              "or a Hub id owner/name; '' builds model.arch)")
    if self.path and not self.hub and not os.path.isfile(os.path.join(self.path, "config.json")):
      _refuse("model.path", self.path, "has no config.json: not a Hugging Face model directory "
              "(save one with save_pretrained or huggingface-cli download; '' builds model.arch)")
    if self.tokenizer and not os.path.isdir(self.tokenizer):
      _refuse("model.tokenizer", self.tokenizer, "is not a directory (tokenizer files; '' uses "
              "model.path's)")
    if not self.path and self.arch not in model_config.PRESETS:
      _refuse("model.arch", self.arch, f"is unknown; known presets: "
              f"{sorted(model_config.PRESETS)}")

  @property
  def hub(self) -> bool:
    """model.path names a Hub model (downloaded, or found in the cache, at start)."""
    return bool(self.path) and _is_hub(self.path)

  @property
  def remat_choices(self) -> list:
    """model.remat's candidates, fastest first: no remat, the matmul outputs saved, only
    each layer's input saved ([False, "dots", True]) where "auto", else the one given."""
    return [False, "dots", True] if self.remat == "auto" else [self.remat]


@dataclasses.dataclass(frozen=True)
class Task:
  """task.*: the registered task and its data."""

  name: str
  dataset: str
  on_long_prompt: str
  train_split: str
  eval_split: str

  def __post_init__(self):
    if _missing_local(self.dataset):
      _refuse("task.dataset", self.dataset, "is not a file or directory here (a local dataset "
              "must exist; a hub dataset is named owner/name or owner/name:subset)")
    if self.name not in tasks_lib.TASKS:
      _refuse("task.name", self.name, f"is unknown; known: {tasks_lib.TASKS.names()}")
    if not self.spec.default_dataset and not self.dataset:
      _refuse("task.dataset", self.dataset, f"is empty, and task {self.name!r} has no default "
              "dataset: a local file or directory, or a hub name")
    if self.on_long_prompt not in ("filter", "error"):
      _refuse("task.on_long_prompt", self.on_long_prompt, "is unknown; known: ['filter', 'error']")
    for key in ("train_split", "eval_split"):
      if getattr(self, key) and not _SPLIT.fullmatch(getattr(self, key)):
        _refuse(f"task.{key}", getattr(self, key), "is not one split with an optional slice, "
                "e.g. 'train' or 'train[:1000]' ('' is the task's own split)")

  @property
  def spec(self) -> tasks_lib.Task:
    """The registered task."""
    return tasks_lib.TASKS.get(self.name)


@dataclasses.dataclass(frozen=True)
class Rollout:
  """rollout.*: how a step's completions are drawn. tools: import paths; environment:
  {name: import path} (None: the one environment); expected_lengths: (median, sigma) or
  None; tail_slots: EngineConfig's (None: "auto")."""

  prompts_per_step: int
  group_size: int
  max_prompt_length: Any  # int | "auto"
  max_completion_length: int
  temperature: float
  top_p: float
  top_k: int
  min_p: float
  dynamic_sampling: bool
  dynamic_sampling_max_rounds: int
  strategy: str
  generation_chunks: int
  engine: str
  decode_slots: Any  # int | "auto"
  page_size: int
  kv_pages: Any  # int | "auto"
  expected_lengths: tuple[float, float] | None
  tail_slots: Any
  max_staleness: int
  partial: str
  carried_batches: int
  tools: tuple[str, ...]
  max_tool_calling_iterations: int
  tool_timeout_s: float
  tool_response_tokens: int
  tool_isolation: str
  environment: dict

  def __post_init__(self):
    for key in ("prompts_per_step", "max_completion_length"):
      if getattr(self, key) < 1:
        _refuse(f"rollout.{key}", getattr(self, key), "must be >= 1")
    if self.max_prompt_length != "auto" and (not _is_int(self.max_prompt_length)
                                             or self.max_prompt_length < 1):
      _refuse("rollout.max_prompt_length", self.max_prompt_length, "must be 'auto' (the longest "
              "prompt of the data, bucketed) or a number of tokens >= 1")
    _checked("rollout", lambda: self.sampling)
    if self.dynamic_sampling_max_rounds < 1:
      _refuse("rollout.dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds,
              "must be >= 1 (generation batches per step)")
    if self.generation_chunks < 1 or self.prompts_per_step % self.generation_chunks:
      _refuse("rollout.generation_chunks", self.generation_chunks, f"must be >= 1 and divide "
              f"rollout.prompts_per_step={self.prompts_per_step} (each chunk holds whole prompts)")
    if self.engine not in ("lockstep", "paged"):
      _refuse("rollout.engine", self.engine, "must be 'lockstep' or 'paged'")
    from grpojax.train import strategy as strategy_lib  # the registry imports the rollout code
    if self.strategy != "auto" and self.strategy not in strategy_lib.STRATEGIES:
      _refuse("rollout.strategy", self.strategy, f"is unknown; known: 'auto', "
              f"{strategy_lib.STRATEGIES.names()}")
    if self.strategy == "streaming" and self.engine != "paged":
      _refuse("rollout.strategy", self.strategy, "'streaming' runs on the paged engine: "
              "rollout.engine='paged'")
    if self.dynamic_sampling and self.engine == "paged" and self.generation_chunks != 1:
      # The engine streams every batch's groups in one run: its slots bound the memory.
      _refuse("rollout.generation_chunks", self.generation_chunks, "must be 1 with "
              "rollout.dynamic_sampling on the paged engine (it streams the groups through "
              "rollout.decode_slots instead)")
    for key in ("max_staleness", "carried_batches"):
      if getattr(self, key) < 0:
        _refuse(f"rollout.{key}", getattr(self, key), "must be >= 0")
    if self.partial not in ("recompute", "restart", "keep"):
      _refuse("rollout.partial", self.partial, "must be 'recompute', 'restart' or 'keep'")
    bad = [f for f in self.tools if not _IMPORT_PATH.fullmatch(f)]
    if bad:
      _refuse("rollout.tools", ",".join(self.tools), f"has {bad}: each must be an import "
              "path, module:name")
    if self.multi_turn:
      key = "rollout.tools" if self.tools else "rollout.environment"
      for wrong, why in ((self.engine != "paged", "rollout.engine='paged' (the turn loop is a "
                          "hook of the engine's)"),
                         (self.dynamic_sampling, "rollout.dynamic_sampling=False"),
                         (self.max_staleness > 0, "rollout.max_staleness=0"),
                         (self.generation_chunks != 1, "rollout.generation_chunks=1"),
                         (self.strategy not in ("auto", "plain"), "rollout.strategy='auto'")):
        if wrong:
          raise ConfigError(f"config: {key} runs multi-turn rollouts on the plain strategy "
                            f"for now: give {why}")
      if (not _is_int(self.max_tool_calling_iterations)
          or self.max_tool_calling_iterations < -1):
        _refuse("rollout.max_tool_calling_iterations", self.max_tool_calling_iterations,
                "must be an int >= 0, or -1 (as many as rollout.max_completion_length holds)")
      if self.tool_isolation not in ("thread", "process"):
        _refuse("rollout.tool_isolation", self.tool_isolation, "must be 'thread' or 'process'")
      for key in ("tool_timeout_s", "tool_response_tokens"):
        if getattr(self, key) <= 0:
          _refuse(f"rollout.{key}", getattr(self, key), "must be > 0")
    if self.max_staleness > 0:
      for wrong, why in ((self.engine != "paged", "rollout.engine='paged'"),
                         (self.dynamic_sampling, "rollout.dynamic_sampling=False"),
                         (self.generation_chunks != 1, "rollout.generation_chunks=1"),
                         (self.strategy not in ("auto", "carried"), "rollout.strategy='auto'")):
        if wrong:
          _refuse("rollout.max_staleness", self.max_staleness, "> 0 carries rows between "
                  f"rollouts on the engine: it needs {why}")
    for key, unit in (("decode_slots", "slots"), ("kv_pages", "pages")):
      if getattr(self, key) != "auto" and not _is_int(getattr(self, key)):
        _refuse(f"rollout.{key}", getattr(self, key), f"must be 'auto' or a number of {unit}")
    fixed = lambda v: 0 if v == "auto" else v  # noqa: E731  (fit sizes "auto")
    _checked("rollout", lambda: engine_lib.EngineConfig(
        fixed(self.decode_slots), self.page_size, fixed(self.kv_pages), self.tail_slots).sizes(
            self.prompts_per_step * self.group_size, self.max_completion_length),
             {"slots": "rollout.decode_slots", "pages": "rollout.kv_pages",
              "tail_slots": "rollout.tail_slots"})

  @property
  def sampling(self) -> SamplingParams:
    """The sampling settings (temperature, top_k, top_p, min_p)."""
    return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)

  @property
  def multi_turn(self) -> bool:
    """Tool turns between the policy's (rollout.tools or rollout.environment)."""
    return bool(self.tools or self.environment)

  def engine_config(self, kv_pages: int = 0, decode_slots: int = 0):
    """The rollout engine's sizes (sampling.engine.EngineConfig), or None for the
    lockstep sampler. kv_pages, decode_slots: the pool and the slots where rollout's
    are "auto" (the fitted ones, grpojax.run.fit)."""
    if self.engine == "lockstep":
      return None
    pages = kv_pages if self.kv_pages == "auto" else self.kv_pages
    slots = decode_slots if self.decode_slots == "auto" else self.decode_slots
    return engine_lib.EngineConfig(slots=slots, page_size=self.page_size, pages=pages,
                                   tail_slots=self.tail_slots)


@dataclasses.dataclass(frozen=True)
class Advantage:
  """advantage.*: the estimator (a registered GRPO one, or gae: PPO's critic)."""

  estimator: str
  scale: str
  eps: float
  gamma: float
  lam: float
  whiten_rewards: bool
  critic: str

  def __post_init__(self):
    if self.estimator not in advantages_lib.known_estimators():
      _refuse("advantage.estimator", self.estimator, f"is unknown; known: "
              f"{advantages_lib.known_estimators()}")
    if self.scale not in advantages_lib.SCALES:
      _refuse("advantage.scale", self.scale, f"is unknown; known: {list(advantages_lib.SCALES)}")
    if self.eps < 0:
      _refuse("advantage.eps", self.eps, "must be >= 0")
    if not self.needs_critic:
      return
    for key in ("gamma", "lam"):
      if not 0.0 <= getattr(self, key) <= 1.0:
        _refuse(f"advantage.{key}", getattr(self, key), "must be in [0, 1]")
    if self.critic != "policy" and not _is_hub(self.critic) and (
        not os.path.isfile(os.path.join(self.critic, "config.json"))):
      _refuse("advantage.critic", self.critic, "must be 'policy' (the policy's decoder with a "
              "fresh scalar head) or a reward model: a Hugging Face "
              "*ForSequenceClassification directory or Hub id")

  @property
  def needs_critic(self) -> bool:
    """PPO with a learned critic (advantage.estimator=gae)."""
    return advantages_lib.needs_critic(self.estimator)


@dataclasses.dataclass(frozen=True)
class Train:
  """train.*: the schedule, the update's memory levers, checkpoints and outputs.
  loggers: names, in order."""

  steps: int
  num_iterations: int
  minibatches: int
  log_completions: int
  loggers: tuple[str, ...]
  wandb_project: str
  micro_batches: Any  # int | "auto"
  memory_budget: Any  # GiB | "auto"
  seed: int
  log_every: int
  eval_every: int
  save_every: int
  ref_sync_every: int
  ref_sync_alpha: float
  keep_checkpoints: int
  on_nonfinite: str
  compilation_cache_dir: str
  allow_config_change: bool

  def __post_init__(self):
    for key in ("steps", "num_iterations", "minibatches", "log_every", "keep_checkpoints"):
      if getattr(self, key) < 1:
        _refuse(f"train.{key}", getattr(self, key), "must be >= 1")
    for key in ("eval_every", "save_every"):
      if getattr(self, key) < 0:
        _refuse(f"train.{key}", getattr(self, key), "must be >= 0 (0: start and end only)")
    if self.micro_batches != "auto" and (not _is_int(self.micro_batches)
                                         or self.micro_batches < 1):
      _refuse("train.micro_batches", self.micro_batches, "must be 'auto' or an integer >= 1")
    if self.memory_budget != "auto" and (isinstance(self.memory_budget, bool)
                                         or not isinstance(self.memory_budget, (int, float))
                                         or self.memory_budget < 0):
      _refuse("train.memory_budget", self.memory_budget, "must be 'auto' or GiB per device "
              ">= 0 (0: no fitting)")
    if self.log_completions < 0:
      _refuse("train.log_completions", self.log_completions, "must be >= 0 (0: never)")
    unknown = [x for x in self.loggers if x not in metrics_lib.LOGGERS]
    if unknown:
      _refuse("train.loggers", ",".join(self.loggers), f"names unknown loggers {unknown}; "
              f"known: {metrics_lib.LOGGERS.names()} (grpojax.train.metrics.register_logger "
              "adds one)")
    if not 0 < self.ref_sync_alpha <= 1:
      _refuse("train.ref_sync_alpha", self.ref_sync_alpha, "must be in (0, 1]")
    if self.on_nonfinite not in ("stop", "skip"):
      _refuse("train.on_nonfinite", self.on_nonfinite, "must be 'stop' or 'skip'")
    if self.ref_sync_every < 0:
      _refuse("train.ref_sync_every", self.ref_sync_every, "must be >= 0 (0: never)")


@dataclasses.dataclass(frozen=True)
class Sft:
  """sft.*: the supervised warm start (0 steps: none)."""

  steps: int
  learning_rate: float
  batch_size: int

  def __post_init__(self):
    if self.steps < 0:
      _refuse("sft.steps", self.steps, "must be >= 0")
    if self.steps and self.learning_rate <= 0:
      _refuse("sft.learning_rate", self.learning_rate, "must be > 0 when sft.steps > 0")
    if self.steps and self.batch_size < 1:
      _refuse("sft.batch_size", self.batch_size, "must be >= 1 when sft.steps > 0")


@dataclasses.dataclass(frozen=True)
class Eval:
  """eval.*: k: the ks of pass@k and maj@k, sorted (() off); sets: (name, dataset,
  split) of each further held-out set."""

  num_prompts: int
  batch_size: int
  k: tuple[int, ...]
  n: int
  temperature: float
  sets: tuple[tuple[str, str, str], ...]

  def __post_init__(self):
    for key in ("num_prompts", "n", "batch_size"):
      if getattr(self, key) < 0:
        _refuse(f"eval.{key}", getattr(self, key), "must be >= 0")
    if self.k and self.n and self.k[-1] > self.n:
      _refuse("eval.k", self.k if len(self.k) > 1 else self.k[0], f"needs eval.n >= {self.k[-1]} samples "
              f"per prompt (eval.n={self.n}; 0: the largest k)")
    _checked("eval", lambda: SamplingParams(temperature=self.temperature))

  @property
  def samples(self) -> int:
    """eval.n as used: sampled completions per prompt (0: the largest k; 0 when k is off)."""
    return self.n or (self.k[-1] if self.k else 0)


@dataclasses.dataclass(frozen=True)
class Rewards:
  """rewards.*: functions: import paths; models: HF directories or Hub ids of reward
  models; weights: one per function then one per model (None: each 1)."""

  num_workers: int
  timeout_s: float
  overlong_buffer: int
  functions: tuple[str, ...]
  models: tuple[str, ...]
  model_max_length: int
  model_dtype: str
  weights: tuple[float, ...] | None
  check_at_start: bool

  def __post_init__(self):
    bad = [f for f in self.functions if not _IMPORT_PATH.fullmatch(f)]
    if bad:
      _refuse("rewards.functions", ",".join(self.functions), f"has {bad}: each must be an "
              "import path, module:function")
    for path in self.models:
      if not _is_hub(path) and not os.path.isfile(os.path.join(path, "config.json")):
        _refuse("rewards.models", ",".join(self.models), f"has {path!r}, not a Hugging Face "
                "model directory (config.json of a *ForSequenceClassification model, its "
                "tokenizer beside it) nor a Hub id")
    if self.models and self.model_max_length < 2:
      _refuse("rewards.model_max_length", self.model_max_length, "must be >= 2 (tokens of a "
              "reward model's input)")
    if self.num_workers < 0:
      _refuse("rewards.num_workers", self.num_workers, "must be >= 0")
    if self.timeout_s <= 0:
      _refuse("rewards.timeout_s", self.timeout_s, "must be > 0 (seconds)")

  @property
  def function_weights(self) -> tuple[float, ...] | None:
    """rewards.weights' part for rewards.functions; None when "" (each 1)."""
    return None if self.weights is None else self.weights[:len(self.functions)]

  @property
  def model_weights(self) -> tuple[float, ...]:
    """rewards.weights' part for rewards.models (each 1 when "")."""
    return ((1.0,) * len(self.models) if self.weights is None
            else self.weights[len(self.functions):])


def _check_shape(key: str, shape: dict) -> dict:
  if sorted(shape) != sorted(mesh_lib.AXES):
    _refuse(key, shape, f"must name exactly the axes {list(mesh_lib.AXES)}")
  sizes = [shape[k] for k in mesh_lib.AXES]
  if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
    _refuse(key, shape, "needs sizes >= 1, with at most one -1 (the remaining devices)")
  return shape


@dataclasses.dataclass(frozen=True)
class Parallel:
  """mesh.shape (the update's mesh) and parallel.* (the rollout's own devices)."""

  mesh_shape: dict
  rollout_devices: int
  rollout_shape: dict

  def __post_init__(self):
    _check_shape("mesh.shape", self.mesh_shape)
    _check_shape("parallel.rollout_shape", self.rollout_shape)
    if self.rollout_devices < 0:
      _refuse("parallel.rollout_devices", self.rollout_devices, "must be >= 0 (0: the rollout "
              "and the update share every device)")


@dataclasses.dataclass(frozen=True)
class Settings:
  """A run's settings, one section per config section (`read` makes them). source: the
  config as given, a plain dict (what the run writes to config.json; "auto" kept)."""

  model: Model
  task: Task
  rollout: Rollout
  loss: losses_lib.LossConfig
  advantage: Advantage
  optim: optim_lib.OptimConfig
  train: Train
  sft: Sft
  eval: Eval
  rewards: Rewards
  parallel: Parallel
  source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    m, r, t, a, w = self.model, self.rollout, self.train, self.advantage, self.rewards
    p, e = self.parallel, self.eval
    task = self.task.spec
    if r.group_size < 2 and not a.needs_critic:
      _refuse("rollout.group_size", r.group_size, "is impossible: group advantages need >= 2 "
              "completions per prompt (advantage.estimator=gae, PPO's critic, works with 1)")
    if r.environment and w.num_workers:
      _refuse("rewards.num_workers", w.num_workers, "must be 0 with rollout.environment: the "
              "environments are live objects of the trainer's process, which reward functions "
              "read (TRL's `environments`)")
    if r.multi_turn and p.rollout_devices:
      raise ConfigError(f"config: {'rollout.tools' if r.tools else 'rollout.environment'} runs "
                        "multi-turn rollouts on the plain strategy for now: give "
                        "parallel.rollout_devices=0")
    if w.models and p.rollout_devices:
      _refuse("rewards.models", ",".join(w.models), "cannot run with parallel.rollout_devices "
              "> 0 yet: the reward models' weights live on the update's devices (set "
              "parallel.rollout_devices=0)")
    if w.models and not task.reward_fns and not w.functions and not r.environment and (
        e.num_prompts):
      _refuse("eval.num_prompts", e.num_prompts, "must be 0 when reward models are the run's "
              "only rewards: eval scores answers with a verifier (a reward function, the "
              "task's or rewards.functions')")
    if not task.reward_fns and not w.functions and not r.environment and not w.models:
      _refuse("rewards.functions", "", f"is empty, and task {task.name!r} has no reward "
              "functions of its own: name some, e.g. trl.rewards:think_format_reward, or a "
              "reward model (rewards.models)")
    if not 0 <= w.overlong_buffer < r.max_completion_length:
      _refuse("rewards.overlong_buffer", w.overlong_buffer, "must be in [0, rollout."
              f"max_completion_length={r.max_completion_length}) (the penalised tail of the "
              "length; 0: off)")
    self._check_critic()
    if r.dynamic_sampling and advantages_lib.is_per_function(a.estimator):
      _refuse("advantage.estimator", a.estimator, "cannot be used with rollout.dynamic_sampling"
              "=True (it normalises over the whole batch, which would mix generation batches)")
    if r.dynamic_sampling and a.scale == "batch":
      # Kept groups come from several generation batches; each was scaled by its own.
      _refuse("advantage.scale", a.scale, "cannot be used with rollout.dynamic_sampling=True "
              "(the batch std would mix generation batches); use 'group' or 'none'")
    gradients = t.minibatches * t.num_iterations
    if gradients % self.optim.grad_accum_steps:
      _refuse("optim.grad_accum_steps", self.optim.grad_accum_steps, f"must divide the "
              f"{gradients} minibatch gradients of a rollout (train.minibatches x "
              "num_iterations): an optimizer step would straddle two rollouts; to bound "
              "memory use train.micro_batches")
    if r.prompts_per_step % t.minibatches:
      _refuse("train.minibatches", t.minibatches, f"must divide rollout.prompts_per_step="
              f"{r.prompts_per_step} (a minibatch holds whole groups)")
    groups = r.prompts_per_step // t.minibatches
    if t.micro_batches != "auto" and groups % t.micro_batches:
      _refuse("train.micro_batches", t.micro_batches, f"must divide the {groups} groups of a "
              "minibatch (rollout.prompts_per_step / train.minibatches)")
    if self.sft.steps and task.sft_target is None:
      _refuse("sft.steps", self.sft.steps, f"is a warm start on reference completions, which "
              f"task {task.name!r} does not have: set sft.steps=0")
    if m.lora.enabled and t.ref_sync_every:
      _refuse("train.ref_sync_every", t.ref_sync_every, "must be 0 with LoRA (model.lora.rank "
              "> 0): the reference is the frozen base, which never moves")
    if p.rollout_devices and r.dynamic_sampling:
      _refuse("parallel.rollout_devices", p.rollout_devices, "runs the plain or carried "
              "rollout beside the update: dynamic sampling picks its groups on the host "
              "between rounds, which would hold the update back (rollout.dynamic_sampling="
              "False)")

  def _check_critic(self) -> None:
    """PPO's critic (advantage.estimator=gae) and the keys that only it reads."""
    a, r = self.advantage, self.rollout
    if not a.needs_critic:
      if self.loss.kl_in_reward:
        _refuse("loss.kl_in_reward", True, "puts the KL in per-token rewards, which only "
                "advantage.estimator=gae reads; GRPO's estimators take the KL in the loss "
                "(loss.beta)")
      return
    if self.model.lora.enabled and a.critic != "policy":
      _refuse("advantage.critic", a.critic, "with LoRA (model.lora.rank > 0): a LoRA run's "
              "critic is adapters and a score head on the policy's base, advantage.critic="
              "'policy'; a reward model's decoder as the critic needs model.lora.rank=0")
    for wrong, why in ((r.dynamic_sampling, "rollout.dynamic_sampling=False (it drops groups "
                        "whose rewards are equal, which a critic's rows of one do not have)"),
                       (r.strategy in ("dynamic", "streaming"), "rollout.strategy='auto'"),
                       (self.parallel.rollout_devices != 0, "parallel.rollout_devices=0 (the "
                        "critic lives on the update's devices)")):
      if wrong:
        _refuse("advantage.estimator", a.estimator, f"(PPO with a critic) needs {why}")

  # What the run does, derived from several sections: each rule stated once.

  @property
  def uses_reference(self) -> bool:
    """Whether the run keeps a frozen reference model: the KL penalty is on (loss.beta >
    0). At beta = 0 no reference weights are held and no reference forward runs."""
    return self.loss.beta > 0

  @property
  def uses_old_logps(self) -> bool:
    """Whether the rollout scores its rows under the sampling policy first: the update
    is off-policy, with several updates per rollout (train.num_iterations > 1) or
    several minibatches (train.minibatches > 1); or PPO's per-token rewards hold the KL
    of those log-probs to the reference (loss.kl_in_reward)."""
    t = self.train
    return t.num_iterations > 1 or t.minibatches > 1 or bool(self.loss.kl_in_reward)

  @property
  def updates_per_step(self) -> int:
    """Optimizer steps per train step (a rollout): num_iterations x minibatches
    gradients, grad_accum_steps of them to an optimizer step."""
    t = self.train
    return t.num_iterations * t.minibatches // self.optim.grad_accum_steps

  @property
  def micro_batch_choices(self) -> list[int]:
    """train.micro_batches' candidates, fastest (fewest) first: the divisors of a
    minibatch's groups where "auto", else the one given."""
    if self.train.micro_batches != "auto":
      return [int(self.train.micro_batches)]
    groups = self.rollout.prompts_per_step // self.train.minibatches
    return [m for m in range(1, groups + 1) if groups % m == 0]


# The config's sections and the fields each reads its keys into; under "mesh" and the
# parallel section's rollout_shape the keys are the user's (axis names, checked below).
_SECTIONS = {"model": Model, "task": Task, "rollout": Rollout, "loss": losses_lib.LossConfig,
             "advantage": Advantage, "optim": optim_lib.OptimConfig, "train": Train,
             "sft": Sft, "eval": Eval, "rewards": Rewards, "mesh": ("shape",),
             "parallel": ("rollout_devices", "rollout_shape")}
_SUBSECTIONS = {"model.lora": ("rank", "alpha", "targets", "quantize", "export_merged")}
_FREE_FORM = ("mesh.shape", "parallel.rollout_shape", "loss.options")


def _known(path: str) -> set[str]:
  if path in _SUBSECTIONS:
    return set(_SUBSECTIONS[path])
  ref = _SECTIONS[path]
  names = set(ref) if isinstance(ref, tuple) else {f.name for f in dataclasses.fields(ref)}
  return names - {"export_merged"}  # Model's field, the config's model.lora.export_merged


def _section(cfg: ml_collections.ConfigDict, path: str) -> dict:
  """The keys of section `path` ("model", "model.lora"), each checked to be known: a
  dict of their values (item access resolves the "auto"-or-number FieldReferences)."""
  node = cfg
  for part in path.split("."):
    node = node[part]
  known = _known(path)
  if not isinstance(node, ml_collections.ConfigDict):
    raise ConfigError(f"config: {path} must be a section of keys {sorted(known)}")
  for key in node.keys():
    if key not in known:
      raise ConfigError(f"config: unknown key {f'{path}.{key}'!r}; known here: {sorted(known)}")
  missing = known - set(node.keys())
  if missing:
    raise ConfigError(f"config: section {path!r} lacks {sorted(missing)} (a config must start "
                      "from grpojax.config.get_config())")
  out = {k: node[k] for k in node.keys()}
  for key, value in out.items():
    if f"{path}.{key}" in _FREE_FORM or f"{path}.{key}" in _SUBSECTIONS:
      if not isinstance(value, ml_collections.ConfigDict):
        raise ConfigError(f"config: {path}.{key} must be a section")
    elif isinstance(value, ml_collections.ConfigDict):
      raise ConfigError(f"config: {path}.{key} is a section; it must be a value")
  return out


def read(cfg: ml_collections.ConfigDict) -> Settings:
  """The run's Settings from `cfg` (an experiment's config: grpojax.config.get_config
  with values set): the one reader of the config.

  Raises:
    ConfigError: with one line naming the key, its value and what would be valid.
  """
  for key in cfg.keys():
    if key not in _SECTIONS:
      raise ConfigError(f"config: unknown key {key!r}; known here: {sorted(_SECTIONS)}")
  model = _section(cfg, "model")
  del model["lora"]
  lora = _section(cfg, "model.lora")
  export_merged = lora.pop("export_merged")
  lora = _checked("model.lora", lambda: lora_lib.LoraConfig(**lora))
  model = Model(**model, lora=lora, export_merged=export_merged)
  task = Task(**_section(cfg, "task"))

  r = _section(cfg, "rollout")
  r.update(tools=parse_list(r["tools"]), environment=parse_environments(r["environment"]),
           expected_lengths=parse_expected_lengths(r["expected_lengths"]),
           tail_slots=parse_tail_slots(r["tail_slots"]))
  rollout = Rollout(**r)

  loss = _section(cfg, "loss")
  options = losses_lib.Options(loss.pop("options").to_dict())
  loss = _checked("loss", lambda: losses_lib.LossConfig(**loss, options=options))
  advantage = Advantage(**_section(cfg, "advantage"))
  optim = _checked("optim", lambda: optim_lib.OptimConfig(**_section(cfg, "optim")))
  t = _section(cfg, "train")
  train = Train(**{**t, "loggers": parse_list(t["loggers"])})
  sft = Sft(**_section(cfg, "sft"))
  e = _section(cfg, "eval")
  evaluation = Eval(**{**e, "k": parse_ks(e["k"]), "sets": parse_eval_sets(e["sets"])})
  w = _section(cfg, "rewards")
  functions, models = parse_list(w["functions"]), parse_list(w["models"])
  rewards = Rewards(**{**w, "functions": functions, "models": models,
                       "weights": parse_weights(w["weights"], len(functions) + len(models))})
  p = _section(cfg, "parallel")
  parallel = Parallel(mesh_shape=_section(cfg, "mesh")["shape"].to_dict(),
                      rollout_devices=p["rollout_devices"],
                      rollout_shape=p["rollout_shape"].to_dict())
  # Through JSON, as config.json is written: tuples are lists, odd leaves strings.
  source = json.loads(json.dumps(cfg.to_dict(), default=str))
  return Settings(model=model, task=task, rollout=rollout, loss=loss, advantage=advantage,
                  optim=optim, train=train, sft=sft, eval=evaluation, rewards=rewards,
                  parallel=parallel, source=source)
