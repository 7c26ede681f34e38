"""The base experiment config, and `validate(cfg)`: one clear line per mistake.

Experiments (`experiments/*.py`) start from `get_config()` and change values;
the config is locked, so a misspelt key fails where it is written, and
`validate` catches what a lock cannot (impossible values, unknown names).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import ml_collections
from ml_collections import config_dict

from grpojax.core import advantages as advantages_lib
from grpojax.core import losses as losses_lib
from grpojax.data import tasks as tasks_lib
from grpojax.errors import ConfigError  # the config's error, raised below it too
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




# Keys a resumed run may change: how long, how often it logs, evaluates and saves,
# and how it executes, none of which changes what one step computes.
SAFE_ON_RESUME = ("train.steps", "train.log_every", "train.eval_every", "train.save_every",
                  "train.keep_checkpoints", "train.on_nonfinite", "train.compilation_cache_dir",
                  "train.allow_config_change", "train.log_completions", "train.loggers",
                  "train.wandb_project", "eval.", "rewards.num_workers",
                  "rewards.timeout_s", "mesh.", "parallel.rollout_shape", "model.kernels",
                  "model.attention_block",
                  # Memory levers: the same gradient either way (to float32 round-off).
                  "train.micro_batches", "train.memory_budget", "model.remat",
                  # Another split of the same sampling distribution (not the same draws).
                  "rollout.generation_chunks",
                  # The engine draws row r's token t with its own key: the same
                  # distribution as the lockstep sampler, other draws.
                  "rollout.engine", "rollout.decode_slots", "rollout.page_size", "rollout.kv_pages",
                  "rollout.expected_lengths", "rollout.tail_slots")


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def resume_differences(previous: dict, cfg: ml_collections.ConfigDict) -> list[str]:
  """The keys, as "key (old -> new)", where `cfg` differs from the config a workdir's
  run was started with (its config.json), leaving out SAFE_ON_RESUME."""
  # Through JSON, as config.json was written: tuples are lists, odd leaves strings.
  now = _flat(json.loads(json.dumps(cfg.to_dict(), default=str)))
  before = _flat(previous)
  keys = sorted(set(now) | set(before))
  return [f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in keys
          if before.get(k) != now.get(k) and not k.startswith(SAFE_ON_RESUME)]


def reward_paths(cfg) -> list[str]:
  """rewards.functions as a list of import paths."""
  return [f.strip() for f in cfg.rewards.functions.split(",") if f.strip()]


def logger_names(loggers: str) -> list[str]:
  """train.loggers ("tensorboard,wandb") as names, in order, blanks dropped."""
  return [x.strip() for x in loggers.split(",") if x.strip()]


def tool_paths(cfg) -> list[str]:
  """rollout.tools as a list of import paths."""
  return [f.strip() for f in cfg.rollout.tools.split(",") if f.strip()]


def environment_paths(cfg) -> dict:
  """rollout.environment as {name: import path} (name None: the one environment)."""
  out = {}
  for entry in (e.strip() for e in cfg.rollout.environment.split(",")):
    if entry:
      name, _, path = entry.rpartition("=")
      out[name.strip() or None] = path.strip()
  return out


def reward_model_paths(cfg) -> list[str]:
  """rewards.models as a list of HF directories (reward models, grpojax.models.reward)."""
  return [p.strip() for p in cfg.rewards.models.split(",") if p.strip()]


def function_weights(cfg) -> tuple[float, ...] | None:
  """rewards.weights' part for rewards.functions; None when "" (each 1)."""
  w = reward_weights(cfg)
  return None if w is None else w[:len(reward_paths(cfg))]


def model_weights(cfg) -> tuple[float, ...]:
  """rewards.weights' part for rewards.models (each 1 when "")."""
  w = reward_weights(cfg)
  return (1.0,) * len(reward_model_paths(cfg)) if w is None else w[len(reward_paths(cfg)):]


def reward_weights(cfg) -> tuple[float, ...] | None:
  """rewards.weights as floats, one per rewards.functions entry then one per
  rewards.models entry; None when "" (each 1). ConfigError unless numbers, as many
  as the functions and models."""
  w, n = cfg.rewards.weights, len(reward_paths(cfg)) + len(reward_model_paths(cfg))
  parts = ([p.strip() for p in w.split(",") if p.strip()] if isinstance(w, str)
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


_EVAL_SET_NAME = re.compile(r"[A-Za-z][\w-]*")


def eval_ks(cfg) -> tuple[int, ...]:
  """eval.k as sorted distinct ks: () for 0 or "" (off). ConfigError unless ints >= 1."""
  k = cfg.eval.k
  not_ints = ConfigError(f"config: eval.k={k!r} must be an integer or comma-separated "
                         "integers, e.g. 4 or '1,4,8'")
  if isinstance(k, str):
    parts = [p.strip() for p in k.split(",") if p.strip()]
    if not all(re.fullmatch(r"-?\d+", p) for p in parts):
      raise not_ints
    k = [int(p) for p in parts]
  values = [k] if isinstance(k, int) and not isinstance(k, bool) else k
  if (not isinstance(values, (list, tuple))
      or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
    raise not_ints
  if list(values) in ([0], []):  # 0 or "": off
    return ()
  if min(values) < 1:
    raise ConfigError(f"config: eval.k={cfg.eval.k!r} must be >= 1 each (0 alone: "
                      "greedy accuracy only)")
  return tuple(sorted(set(values)))


def eval_samples(cfg) -> int:
  """eval.n as used: sampled completions per prompt (0: the largest k; 0 when k is off)."""
  ks = eval_ks(cfg)
  return cfg.eval.n or (ks[-1] if ks else 0)


def eval_sets(cfg) -> list[tuple[str, str, str]]:
  """eval.sets as (name, dataset, split); "" dataset: task.dataset's, "" split: the run's
  eval split. ConfigError on an entry that is not name=dataset[@split]."""
  out = []
  for entry in cfg.eval.sets.split(","):
    entry = entry.strip()
    if not entry:
      continue
    name, eq, spec = entry.partition("=")
    name, spec = name.strip(), spec.strip()
    # Splits never hold "@"; a path or hub name might, so the split is after the last one.
    dataset, at, split = spec.rpartition("@")
    dataset, split = (dataset, split) if at else (spec, "")
    if not eq or not _EVAL_SET_NAME.fullmatch(name) or name == "accuracy":
      raise ConfigError(f"config: eval.sets={cfg.eval.sets!r}: entry {entry!r} must be "
                        "name=dataset[@split], the name a letter then letters, digits, _ or - "
                        "(not 'accuracy'), e.g. 'hard=arithmetic:3:+' or "
                        "'gsm=openai/gsm8k:main@test'")
    if split and not _SPLIT.fullmatch(split):
      raise ConfigError(f"config: eval.sets={cfg.eval.sets!r}: entry {name!r} has split "
                        f"{split!r}, not one split with an optional slice, e.g. 'test[:200]'")
    if name in [n for n, _, _ in out]:
      raise ConfigError(f"config: eval.sets={cfg.eval.sets!r} names {name!r} twice")
    out.append((name, dataset.strip(), split))
  return out


def _missing_local(dataset: str) -> bool:
  """A dataset that reads as a local file or directory but is not here."""
  return bool(dataset) and (dataset.startswith(("/", "./", "../", "~"))
                            or dataset.endswith((".json", ".jsonl", ".parquet"))
                            ) and not os.path.exists(os.path.expanduser(dataset))


def _either(default):
  """A field that takes values of several types ("auto" or a bool or a number; an int or
  a tuple of ints), from Python and from the command line alike (ml_collections fields
  are typed; `--config.eval.k=1,4,8` parses as a tuple)."""
  return ml_collections.FieldReference(default, field_type=object)


def get_config() -> ml_collections.ConfigDict:
  """The defaults every experiment starts from (locked: no new keys)."""
  c = ml_collections.ConfigDict()

  c.model = dict(
      path="",  # HF-format dir; "" builds `arch` from scratch
      tokenizer="",  # tokenizer dir when it is not model.path's own ("": model.path's)
      arch="tiny",  # preset used when path is ""
      dtype="float32",
      # Per-layer rematerialisation in the update: the backward pass recomputes each layer
      # from its input instead of keeping its activations (less memory; the forward runs twice).
      # "auto": only if the update does not fit train.memory_budget without it. Policies:
      # "none" (= False), "full" (= True), "dots" (keeps the matmul outputs too).
      remat=_either("auto"),
      # grpojax.ops backend: "auto" (native CPU kernels on a CPU, XLA elsewhere), "xla", "cpu".
      kernels="auto",
      # Training and scoring attend blockwise over sequences longer than this (key blocks
      # of this size): memory linear in the length, not its square. 0: never.
      attention_block=1024,
      # LoRA: rank 0 trains the whole model. rank > 0 trains adapters (scale alpha / rank)
      # on `targets` ("all", "q,v", "q_proj,v_proj" or a regex over q k v o gate up down)
      # and freezes the base, stored in model.dtype or, with quantize "int8" | "nf4"
      # (QLoRA), quantised. The KL reference is then the base itself, adapters off (before
      # any SFT, whose adapters GRPO goes on training): no second copy of the weights.
      # The end of the run writes hf/ as a PEFT adapter dir; export_merged also writes
      # hf/merged, the full model with the adapters folded in.
      lora=dict(rank=0, alpha=32.0, targets="all", quantize="none", export_merged=False),
  )
  c.task = dict(
      name="arithmetic",  # registered: arithmetic | gsm8k | math | countdown | code | yours
      dataset="",  # "" means the task's default dataset
      on_long_prompt="filter",  # filter (logged count) | error
      # One split with an optional HF slice, e.g. "train[:1000]" (hub and local files);
      # "" means the task's own (task.splits).
      train_split="",
      eval_split="",
  )
  c.rollout = dict(
      prompts_per_step=8,
      group_size=8,
      # "auto": the longest rendered prompt of the run's data (its train rows and the
      # held-out rows it evaluates), rounded up to a bucket (see wiring.prompt_bucket).
      max_prompt_length=_either("auto"),
      max_completion_length=128,
      temperature=1.0,
      top_p=1.0,
      top_k=0,  # 0: off
      min_p=0.0,
      # DAPO: train only on groups whose rewards differ, generating more batches to
      # refill (at most dynamic_sampling_max_rounds per step, then zero-std groups fill in).
      # On the paged engine the batches stream through one run: groups are decoded
      # in order only until enough are accepted, and the prompts not reached go back
      # to the data.
      dynamic_sampling=False,
      dynamic_sampling_max_rounds=4,
      # How a step's rollout is drawn (grpojax.train.strategy): "auto" (streaming for
      # dynamic_sampling on the paged engine, dynamic on the lockstep sampler, else
      # plain) or a registered name (yours: strategy.register).
      strategy="auto",
      # Generate the step's prompts in this many chunks, one after another: the
      # KV cache of 1/chunks of the rows at a time (memory for time; each chunk
      # also stops at its own longest completion).
      generation_chunks=1,
      # "paged" (the decoder of rollouts, evals and streaming): the rollout engine
      # (sampling/engine/): decode_slots rows decode at once (0: all; "auto": the
      # planner's, the most rows its pool holds at full length), each taking pages of
      # page_size tokens from a pool of kv_pages (0: every slot at full length;
      # "auto": what train.memory_budget leaves) as it grows; a slot takes the next
      # row when its row ends. "lockstep": the reference sampler (sampler.generate),
      # all rows in one batch until the longest ends; for comparing against, not
      # for speed (on an H100 the engine is 2.1x it at full length, 3.1x ragged).
      engine="paged",
      decode_slots=_either(0),
      page_size=128,
      kv_pages=_either(0),  # or "auto": the planner's, from train.memory_budget
      # The completion lengths "auto" sizes the pool for: "" (any row may reach
      # max_completion_length: the most pages the budget leaves, no row ever
      # restarted) or "lognormal:MEDIAN:SIGMA" (tokens, e.g. a previous run's
      # completions/*): every row gets a slot and the pool holds the live pages'
      # peak in 99% of batches drawn so; a longer batch restarts rows (preemption).
      expected_lengths="",
      # The narrower slot counts the engine steps down to for a run's tail, once no
      # row waits and few run (EngineConfig.tail_slots: a step over fewer slots
      # costs less): "auto" (decode_slots / 4, / 16, ... while >= 16), a number or
      # numbers (64,16), or 0 (never). Each is one more compiled decode loop.
      tail_slots=_either("auto"),
      # Carried rollouts (train/strategy.py "carried"): a rollout returns the first
      # prompts_per_step groups to finish and keeps decoding the rest after the update,
      # so its slots never drain to the longest row. A carried row's tokens are at most
      # max_staleness policy versions old (older: it starts again); 0: off, every rollout
      # drains (TRL's max_staleness). Pair it with loss.decoupled.
      max_staleness=0,
      # How a carried row goes on under the new weights: "recompute" (its prompt and
      # tokens so far prefilled again, AReaL's), "keep" (in its slot, the keys and
      # values the old weights wrote kept: PipelineRL's; only the prompts are prefilled
      # again) or "restart" (from its prompt, its tokens thrown away: nothing off-policy).
      partial="recompute",
      # Batches held beside the one a rollout returns (their rows fill the slots that
      # the batch's finished rows leave).
      carried_batches=1,
      # Tools the policy may call between its turns (TRL's tools=): comma-separated
      # import paths of functions (typed, with Google-style docstrings) or classes (each
      # row gets an instance, its public methods the tools; state kept between one
      # row's calls). "grpojax.tools:PythonTool": Python in the code sandbox. The
      # tokenizer's chat template renders their schemas and its tool-call syntax
      # (Hermes': <tool_call>{json}</tool_call>, Qwen2.5's and Qwen3's) is parsed.
      tools="",
      # Tool turns a completion takes at most (TRL's max_tool_calling_iterations);
      # -1: as many as its max_completion_length holds.
      max_tool_calling_iterations=-1,
      # A tool call's time limit in seconds, and the longest tool response in tokens
      # (a longer result is cut to fit).
      tool_timeout_s=20.0,
      tool_response_tokens=512,
      # Where a function tool runs: "thread" (the trainer's process, as TRL runs it) or
      # "process" (a forked child per call, killed at its limit: a tool that hangs,
      # crashes or calls os._exit ends only its call). Classes' instances: "thread".
      tool_isolation="thread",
      # TRL's environment_factory: the import path of a class (or function) making an
      # environment, "module:Class"; or several, routed by the dataset's `environment`
      # column, "name=module:Class,other=module:Other". Each row gets an instance,
      # reset(**example) before its rollout (its text, if any, joins the prompt), its
      # public methods the row's tools; a get_reward() method is a reward of weight 1
      # named after the class. Reward functions get the instances as `environments`.
      environment="",
  )
  loss_defaults = losses_lib.LossConfig()
  c.loss = {f.name: getattr(loss_defaults, f.name) for f in dataclasses.fields(loss_defaults)
            if f.name != "options"}
  # The registered loss's own hyper-parameters, by name (losses.register_loss's options):
  # set in an experiment (c.loss.options = {"cap": 1.5}); then the command line reaches them.
  c.loss.options = ml_collections.ConfigDict()
  # Optional fields need a typed placeholder so `--config.loss.delta=4` parses.
  c.loss.epsilon_high = config_dict.placeholder(float)
  c.loss.delta = config_dict.placeholder(float)
  c.loss.max_completion_length = config_dict.placeholder(int)
  c.loss.importance_sampling_clip_min = config_dict.placeholder(float)
  c.loss.off_policy_mask_threshold = config_dict.placeholder(float)
  c.advantage = dict(
      # registered: grpo | dr_grpo | rloo | gdpo | yours; or gae: PPO with a learned
      # critic (per-token advantages; group size 1 works), see docs/ppo.md
      estimator="grpo",
      scale="group",  # group | batch | none (grpo only)
      eps=1e-4,
      # gae only: the discount and GAE's lambda (TRL's PPO: 1.0 and 0.95), TRL's
      # whiten_rewards, and where the critic starts: "policy" (the policy's decoder
      # with a fresh scalar head, as TRL and verl) or a reward model's HF directory
      # (or Hub id) of a *ForSequenceClassification.
      gamma=1.0,
      lam=0.95,
      whiten_rewards=False,
      critic="policy",
  )
  c.optim = dict(
      learning_rate=1e-6,
      schedule="constant",  # constant | cosine (to 0 at train.steps), after warmup
      warmup_steps=0,
      weight_decay=0.0,  # AdamW; never applied to norms and biases
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      max_grad_norm=1.0,  # 0: no clipping
      grad_accum_steps=1,  # minibatch gradients per step (as TRL: dapo/cispo sum, others average)
  )
  c.train = dict(
      steps=100,
      num_iterations=1,  # mu: passes over each generation batch
      minibatches=1,  # optimizer steps per pass
      # Every this many steps, a few sample completions (prompt, completion, rewards,
      # advantage) go to completions.jsonl and TensorBoard's text tab; 0: never.
      log_completions=50,
      # Where metrics go besides metrics.jsonl: "tensorboard", "wandb" (needs the
      # [wandb] extra; WANDB_MODE=offline works), comma-separated; "" for none.
      loggers="tensorboard",
      wandb_project="grpojax",
      # Micro-batches of whole groups per minibatch, run one after another and summed into
      # the minibatch's exact gradient (memory for time; not extra optimizer steps).
      # "auto": the fewest that fit train.memory_budget (see python -m grpojax.plan).
      micro_batches=_either("auto"),  # or an int
      # Device memory the update may use, in GiB per device; "auto": 90% of the device's.
      # 0: no fitting ("auto" micro_batches and remat then mean 1 and False).
      memory_budget=_either("auto"),  # or GiB
      seed=0,
      log_every=1,
      eval_every=0,  # 0: only at the start and the end
      save_every=50,  # 0: only at the end
  )
  c.train.ref_sync_every = 0  # TR-DPO: every k steps ref <- a*policy + (1-a)*ref; 0: never
  c.train.ref_sync_alpha = 0.6
  c.train.keep_checkpoints = 2  # the latest k, plus the best by eval/accuracy
  # An optimizer step whose loss, gradients or new weights are NaN/inf is always
  # dropped on device; then "stop" ends the run (the last good checkpoint stays the
  # newest), "skip" carries on and counts it in the metric nonfinite/skipped.
  c.train.on_nonfinite = "stop"
  # JAX's persistent compilation cache: a repeated or resumed run loads its compiled
  # programs instead of compiling again. "" turns it off; JAX_COMPILATION_CACHE_DIR wins.
  c.train.compilation_cache_dir = "~/.cache/grpojax/xla"
  # Resuming a workdir whose run had another config stops at startup (it would mix
  # two runs); True continues anyway. Cadence and eval keys may always change.
  c.train.allow_config_change = False
  c.model.ref_dtype = "bfloat16"  # the frozen reference (only when loss.beta > 0)
  c.sft = dict(
      steps=0,  # supervised warm-start steps before GRPO
      learning_rate=1e-4,
      batch_size=32,
  )
  c.eval = dict(
      num_prompts=128,  # held-out prompts per eval set (0: no eval)
      batch_size=64,
      # The k of eval/pass@k and eval/maj@k: an int, or several ("1,4,8" on the command
      # line, (1, 4, 8) in Python); 0: greedy accuracy only (and mean@n if eval.n is set).
      k=_either(0),
      n=0,  # sampled completions per prompt, >= every k; 0: the largest k
      temperature=1.0,  # of the n samples (eval/accuracy is always greedy)
      # More held-out sets, each reported as eval/<name>/...: comma-separated
      # name=dataset[@split] ("" dataset: task.dataset's; no split: the run's eval split).
      # The run's own held-out set keeps the plain eval/... names (and picks the best checkpoint).
      sets="",
  )
  c.rewards = dict(
      # Verifier processes. 0: in the trainer process, under a watchdog (prints and pdb
      # work; a hang or os._exit costs its row) -- use >= 1 for untrusted code, which
      # a thread cannot kill.
      num_workers=0,
      timeout_s=30.0,  # per row (a call on n rows: ceil(n/8) of them), in or out of process
      # DAPO's soft overlong punishment, added to the task's rewards at weight 1: 0 up
      # to max_completion_length - overlong_buffer tokens, then down to -1 at the max. 0: off.
      overlong_buffer=0,
      # More reward functions, after the task's own: comma-separated import paths
      # ("trl.rewards:think_format_reward,my_rewards.length"); weight 1 each. The
      # "prompt" task (TRL's dataset formats) has none of its own: it needs these.
      functions="",
      # Reward models (TRL's model ids in reward_funcs): comma-separated HF directories
      # or Hub ids of sequence classifiers (*ForSequenceClassification, their tokenizer
      # beside them), each scored on the device inside the rollout, after the functions: the
      # text is rendered through the reward model's own chat template, as TRL does.
      models="",
      # A reward model's input in tokens (prompt and completion); a longer text keeps
      # its last model_max_length, where the score is read.
      model_max_length=1024,
      # Their weights' dtype on the device ("": model.dtype).
      model_dtype="",
      # Their weights (TRL's reward_weights), one per function in rewards.functions, then
      # one per reward model in rewards.models, in order: "1,0.5" on the command line,
      # (1.0, 0.5) in Python; "" weighs each 1.
      weights=_either(""),
      # Call each reward function once at startup, on the first rows with an empty
      # completion, so that one that raises or returns the wrong type or length stops
      # the run before SFT, eval and the rollout compile. Off by default: a stateful function (a counter, a
      # curriculum) would see a call TRL never makes.
      check_at_start=False,
  )
  c.mesh = dict(shape=dict(data=1, fsdp=-1, tensor=1))
  c.parallel = dict(
      # > 0: the rollout runs on the last K devices, beside the update on the others
      # (mesh.shape splits those), one step ahead: step i trains on the rollout drawn
      # during step i - 1 by the weights before it (grpojax.train.beside). 0: the two
      # take turns on every device.
      rollout_devices=0,
      # The rollout devices' mesh (-1: the rest); tensor-parallel by default, which
      # carried rollouts need (one engine, not split by rows).
      rollout_shape=dict(data=1, fsdp=1, tensor=-1),
  )
  c.lock()
  return c


# Sections whose keys are the user's (set whole).
_FREE_FORM = ("mesh.shape", "parallel.rollout_shape", "loss.options")


def dotted(values, prefix: str = "") -> dict:
  """{"rollout": {"group_size": 4}} and {"rollout.group_size": 4} alike, as dotted keys
  (mesh.shape and loss.options stay whole)."""
  out = {}
  for key, value in values.items():
    if hasattr(value, "items") and f"{prefix}{key}" not in _FREE_FORM:
      out.update(dotted(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def apply(cfg: ml_collections.ConfigDict, values) -> ml_collections.ConfigDict:
  """cfg with `values` (nested or dotted keys) set; ConfigError in one line for a key it
  lacks or a value of the wrong type."""
  for key, value in dotted(values).items():
    *parents, name = key.split(".")
    node = cfg
    for part in parents:
      if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
        raise ConfigError(f"config: unknown key {key!r}")
      node = node[part]
    if name not in node:
      raise ConfigError(f"config: unknown key {key!r}; known here: {sorted(node)}")
    try:
      if key in _FREE_FORM:
        with node.unlocked():
          node[name] = ml_collections.ConfigDict(dict(value))
      else:
        node[name] = value
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config: {key}={value!r}: {' '.join(str(e).split())}") from None
  return cfg


def from_json(path: str) -> ml_collections.ConfigDict:
  """The config a run wrote to its workdir's config.json, as a locked ConfigDict:
  `get_config()` with every saved value applied. A workdir's config.py calls this,
  so `--config WORKDIR/config.py` gives the command line the run's own config
  (started from Python or from the command line alike).

  Raises ConfigError for a key grpojax does not have (a file of another version).
  """
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  try:
    return apply(get_config(), saved)
  except ConfigError as e:
    raise ConfigError(f"{e} (in {path})") from None


def smoke(c: ml_collections.ConfigDict, dataset: str, *,
          max_prompt_length: int) -> ml_collections.ConfigDict:
  """Shrinks an experiment in place to its `:smoke` variant: the tiny random model
  (character tokenizer) on the local rows in `dataset`, 2 prompts x 4 samples of
  8 tokens, 2 steps, eval on 4 prompts; its loss and estimator are left as they are.
  Prompts over `max_prompt_length` stop the run, so the smoke rows are all used.
  """
  c.model.path, c.model.arch, c.model.dtype = "", "tiny", "float32"
  c.task.dataset, c.task.on_long_prompt = dataset, "error"
  c.rollout.prompts_per_step, c.rollout.group_size = 2, 4
  c.rollout.max_prompt_length, c.rollout.max_completion_length = max_prompt_length, 8
  c.train.steps = 2
  c.eval.num_prompts, c.eval.batch_size = 4, 4
  return c


def loss_config(cfg: ml_collections.ConfigDict) -> losses_lib.LossConfig:
  """The `loss.*` section as the frozen LossConfig that `policy_loss` takes."""
  fields = cfg.loss.to_dict()
  options = losses_lib.Options(fields.pop("options"))
  return losses_lib.LossConfig(**fields, options=options)


def lora_config(cfg: ml_collections.ConfigDict) -> lora_lib.LoraConfig:
  """The `model.lora.*` section as the checked LoraConfig (rank 0: no adapters)."""
  fields = cfg.model.lora.to_dict()
  fields.pop("export_merged")
  return _checked("model.lora", lambda: lora_lib.LoraConfig(**fields))


def expected_lengths(cfg: ml_collections.ConfigDict) -> tuple[float, float] | None:
  """rollout.expected_lengths as (median tokens, sigma) of a lognormal; None where it
  is "" (unknown)."""
  spec = cfg.rollout.expected_lengths
  if not spec:
    return None
  kind, *args = str(spec).split(":")
  try:
    median, sigma = (float(a) for a in args)
  except ValueError:
    median = sigma = -1.0
  if kind != "lognormal" or median < 1 or sigma < 0:
    raise ConfigError(f"rollout.expected_lengths={spec!r} must be '' or "
                      "'lognormal:MEDIAN:SIGMA' (MEDIAN tokens >= 1, SIGMA >= 0)")
  return median, sigma


def sampling_params(cfg: ml_collections.ConfigDict) -> SamplingParams:
  """The rollout's sampling settings (rollout.temperature, top_k, top_p, min_p)."""
  r = cfg.rollout
  return SamplingParams(r.temperature, r.top_k, r.top_p, r.min_p)


def optim_config(cfg: ml_collections.ConfigDict) -> optim_lib.OptimConfig:
  """The `optim.*` section as the checked OptimConfig that make_optimizer takes."""
  return optim_lib.OptimConfig(**cfg.optim.to_dict())


def engine_config(cfg: ml_collections.ConfigDict, kv_pages: int = 0, decode_slots: int = 0):
  """The rollout engine's sizes (sampling.engine.EngineConfig) from rollout.*, or None
  for the lockstep sampler (rollout.engine="lockstep"). kv_pages, decode_slots: the
  pool and the slots where rollout's are "auto" (grpojax.plan.fit's)."""
  r = cfg.rollout
  if r.engine == "lockstep":
    return None
  pages = kv_pages if r.kv_pages == "auto" else r.kv_pages
  slots = decode_slots if r.decode_slots == "auto" else r.decode_slots
  return engine_lib.EngineConfig(slots=slots, page_size=r.page_size, pages=pages,
                                 tail_slots=tail_slots(cfg))


def tail_slots(cfg: ml_collections.ConfigDict) -> tuple[int, ...] | None:
  """rollout.tail_slots as EngineConfig's: None for "auto", () for 0, else a tuple."""
  value = cfg.rollout.tail_slots
  if value == "auto":
    return None
  if isinstance(value, int) and not isinstance(value, bool):
    return () if value == 0 else (value,)
  return tuple(value) if isinstance(value, (tuple, list)) else value  # else refused by EngineConfig


def _unknown_keys(cfg, ref, prefix=""):
  for key in cfg.keys():
    path = f"{prefix}{key}"
    if key not in ref:
      yield path, sorted(ref.keys())
    # mesh.shape names the mesh's axes; loss.options the registered loss's own keys (it
    # checks them: losses.LossConfig).
    elif isinstance(ref[key], ml_collections.ConfigDict) and path not in _FREE_FORM:
      if not isinstance(cfg[key], ml_collections.ConfigDict):
        yield path + " (must be a section)", sorted(ref[key].keys())
      else:
        yield from _unknown_keys(cfg[key], ref[key], path + ".")


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


def _validate_critic(cfg, fail) -> None:
  """PPO's critic (advantage.estimator=gae) and the keys that only it reads."""
  a, r = cfg.advantage, cfg.rollout
  if not advantages_lib.needs_critic(a.estimator):
    if cfg.loss.kl_in_reward:
      fail("loss.kl_in_reward", "puts the KL in per-token rewards, which only "
           "advantage.estimator=gae reads; GRPO's estimators take the KL in the loss (loss.beta)")
    return
  if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
    fail("advantage.gamma" if not 0.0 <= a.gamma <= 1.0 else "advantage.lam", "must be in [0, 1]")
  if a.critic != "policy" and not (hf_lib.is_hub_id(a.critic) and not os.path.exists(a.critic)) and (
      not os.path.isfile(os.path.join(a.critic, "config.json"))):
    fail("advantage.critic", "must be 'policy' (the policy's decoder with a fresh scalar head) "
         "or a reward model: a Hugging Face *ForSequenceClassification directory or Hub id")
  if cfg.model.lora.rank > 0 and a.critic != "policy":
    fail("advantage.critic", "with LoRA (model.lora.rank > 0): a LoRA run's critic is adapters "
         "and a score head on the policy's base, advantage.critic='policy'; a reward model's "
         "decoder as the critic needs model.lora.rank=0")
  for bad, why in ((r.dynamic_sampling, "rollout.dynamic_sampling=False (it drops groups whose "
                    "rewards are equal, which a critic's rows of one do not have)"),
                   (r.strategy in ("dynamic", "streaming"), "rollout.strategy='auto'"),
                   (cfg.parallel.rollout_devices != 0, "parallel.rollout_devices=0 (the critic "
                    "lives on the update's devices)")):
    if bad:
      fail("advantage.estimator", f"=gae (PPO with a critic) needs {why}")


def validate(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks `cfg` before anything expensive runs; returns it unchanged.

  A value that a settings type holds (SamplingParams, EngineConfig, LossConfig,
  OptimConfig) is checked by that type, once; this checks the rest: the keys,
  their types where the config allows several ("auto" or a number), and the
  rules that join sections.

  Raises:
    ConfigError: with one line naming the key, its value and what would be valid.
  """

  def fail(key, why):
    value = cfg
    for part in key.split("."):
      value = value[part]
    if isinstance(value, ml_collections.ConfigDict):  # its repr spans lines
      value = value.to_dict()
    raise ConfigError(f"config: {key}={value!r} {why}")

  for key, known in _unknown_keys(cfg, get_config()):
    raise ConfigError(f"config: unknown key {key!r}; known here: {known}")

  m, r, o, t = cfg.model, cfg.rollout, cfg.optim, cfg.train
  if m.dtype not in DTYPES:
    fail("model.dtype", f"is unknown; known: {list(DTYPES)}")
  if not (isinstance(m.remat, bool) or m.remat in ("auto", "none", "full", "dots")):
    fail("model.remat", "must be True, False or 'auto', or a policy: 'none', 'full', 'dots' "
         "(per-layer rematerialisation in the update)")
  if m.kernels not in model_config.KERNELS:
    fail("model.kernels", f"is unknown; known: {list(model_config.KERNELS)}")
  if not isinstance(m.attention_block, int) or m.attention_block < 0:
    fail("model.attention_block", f"must be an int >= 0 (0: never blockwise), got "
         f"{m.attention_block!r}")
  hub = bool(m.path) and hf_lib.is_hub_id(m.path) and not os.path.exists(m.path)
  if m.path and not hub and not os.path.isdir(m.path):
    fail("model.path", "is not a directory (an HF-format dir with config.json, or a Hub id "
         "owner/name; '' builds model.arch)")
  if m.path and not hub and not os.path.isfile(os.path.join(m.path, "config.json")):
    fail("model.path", "has no config.json: not a Hugging Face model directory (save one with "
         "save_pretrained or huggingface-cli download; '' builds model.arch)")
  if m.tokenizer and not os.path.isdir(m.tokenizer):
    fail("model.tokenizer", "is not a directory (tokenizer files; '' uses model.path's)")
  if not m.path and m.arch not in model_config.PRESETS:
    fail("model.arch", f"is unknown; known presets: {sorted(model_config.PRESETS)}")
  if _missing_local(cfg.task.dataset):
    fail("task.dataset", "is not a file or directory here (a local dataset must exist; a hub "
         "dataset is named owner/name or owner/name:subset)")
  if cfg.task.name not in tasks_lib.TASKS:
    fail("task.name", f"is unknown; known: {tasks_lib.TASKS.names()}")
  bad = [f for f in reward_paths(cfg) if not re.fullmatch(r"[\w.]+[:.]\w+", f)]
  if bad:
    fail("rewards.functions", f"has {bad}: each must be an import path, module:function")
  reward_weights(cfg)
  for path in reward_model_paths(cfg):
    if hf_lib.is_hub_id(path) and not os.path.exists(path):
      continue  # downloaded (or found in the cache) when the run starts, as model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
      fail("rewards.models", f"has {path!r}, not a Hugging Face model directory (config.json "
           "of a *ForSequenceClassification model, its tokenizer beside it) nor a Hub id")
  if reward_model_paths(cfg) and cfg.rewards.model_max_length < 2:
    fail("rewards.model_max_length", "must be >= 2 (tokens of a reward model's input)")
  if reward_model_paths(cfg) and cfg.parallel.rollout_devices:
    fail("rewards.models", "cannot run with parallel.rollout_devices > 0 yet: the reward "
         "models' weights live on the update's devices (set parallel.rollout_devices=0)")
  task = tasks_lib.TASKS.get(cfg.task.name)
  if (reward_model_paths(cfg) and not task.reward_fns and not reward_paths(cfg)
      and not environment_paths(cfg) and cfg.eval.num_prompts):
    fail("eval.num_prompts", "must be 0 when reward models are the run's only rewards: eval "
         "scores answers with a verifier (a reward function, the task's or rewards.functions')")
  if (not task.reward_fns and not reward_paths(cfg) and not environment_paths(cfg)
      and not reward_model_paths(cfg)):
    fail("rewards.functions", f"is empty, and task {task.name!r} has no reward functions of its "
         "own: name some, e.g. trl.rewards:think_format_reward, or a reward model "
         "(rewards.models)")
  if not task.default_dataset and not cfg.task.dataset:
    fail("task.dataset", f"is empty, and task {task.name!r} has no default dataset: a local "
         "file or directory, or a hub name")
  if cfg.task.on_long_prompt not in ("filter", "error"):
    fail("task.on_long_prompt", "is unknown; known: ['filter', 'error']")
  for key in ("train_split", "eval_split"):
    if cfg.task[key] and not _SPLIT.fullmatch(cfg.task[key]):
      fail(f"task.{key}", "is not one split with an optional slice, e.g. 'train' or "
           "'train[:1000]' ('' is the task's own split)")

  if r.group_size < 2 and not advantages_lib.needs_critic(cfg.advantage.estimator):
    fail("rollout.group_size", "is impossible: group advantages need >= 2 completions per prompt "
         "(advantage.estimator=gae, PPO's critic, works with 1)")
  for key in ("prompts_per_step", "max_completion_length"):
    if r[key] < 1:
      fail(f"rollout.{key}", "must be >= 1")
  if r.max_prompt_length != "auto" and (isinstance(r.max_prompt_length, bool)
                                        or not isinstance(r.max_prompt_length, int)
                                        or r.max_prompt_length < 1):
    fail("rollout.max_prompt_length", "must be 'auto' (the longest prompt of the data, "
         "bucketed) or a number of tokens >= 1")
  _checked("rollout", lambda: sampling_params(cfg))
  if r.dynamic_sampling_max_rounds < 1:
    fail("rollout.dynamic_sampling_max_rounds", "must be >= 1 (generation batches per step)")
  if r.generation_chunks < 1 or r.prompts_per_step % r.generation_chunks:
    fail("rollout.generation_chunks", f"must be >= 1 and divide rollout.prompts_per_step="
         f"{r.prompts_per_step} (each chunk holds whole prompts)")

  if r.engine not in ("lockstep", "paged"):
    fail("rollout.engine", "must be 'lockstep' or 'paged'")
  from grpojax.train import strategy as strategy_lib  # the registry imports the rollout code
  if r.strategy != "auto" and r.strategy not in strategy_lib.STRATEGIES:
    fail("rollout.strategy", f"is unknown; known: 'auto', {strategy_lib.STRATEGIES.names()}")
  if r.strategy == "streaming" and r.engine != "paged":
    fail("rollout.strategy", "'streaming' runs on the paged engine: rollout.engine='paged'")
  expected_lengths(cfg)  # its format
  if r.dynamic_sampling and r.engine == "paged" and r.generation_chunks != 1:
    # The engine streams every batch's groups in one run: its slots bound the memory.
    fail("rollout.generation_chunks", "must be 1 with rollout.dynamic_sampling on the paged "
         "engine (it streams the groups through rollout.decode_slots instead)")
  if r.max_staleness < 0 or r.carried_batches < 0:
    fail("rollout.max_staleness" if r.max_staleness < 0 else "rollout.carried_batches",
         "must be >= 0")
  if r.partial not in ("recompute", "restart", "keep"):
    fail("rollout.partial", "must be 'recompute', 'restart' or 'keep'")
  environments = environment_paths(cfg)
  if environments:
    bad = [p for p in environments.values() if not re.fullmatch(r"[\w.]+[:.]\w+", p)]
    if bad or (len(environments) > 1 and None in environments):
      fail("rollout.environment", f"is {r.environment!r}: give one import path, module:Class, "
           "or several as name=module:Class,other=module:Other")
    if cfg.rewards.num_workers:
      fail("rewards.num_workers", "must be 0 with rollout.environment: the environments are "
           "live objects of the trainer's process, which reward functions read (TRL's "
           "`environments`)")
  if tool_paths(cfg) or environments:
    key = "rollout.tools" if tool_paths(cfg) else "rollout.environment"
    bad = [f for f in tool_paths(cfg) if not re.fullmatch(r"[\w.]+[:.]\w+", f)]
    if bad:
      fail("rollout.tools", f"has {bad}: each must be an import path, module:name")
    for bad, why in ((r.engine != "paged", "rollout.engine='paged' (the turn loop is a hook "
                      "of the engine's)"),
                     (r.dynamic_sampling, "rollout.dynamic_sampling=False"),
                     (r.max_staleness > 0, "rollout.max_staleness=0"),
                     (r.generation_chunks != 1, "rollout.generation_chunks=1"),
                     (r.strategy not in ("auto", "plain"), "rollout.strategy='auto'"),
                     (cfg.parallel.rollout_devices != 0, "parallel.rollout_devices=0")):
      if bad:
        fail(key, f"runs multi-turn rollouts on the plain strategy for now: give {why}")
    if not isinstance(r.max_tool_calling_iterations, int) or r.max_tool_calling_iterations < -1:
      fail("rollout.max_tool_calling_iterations", "must be an int >= 0, or -1 (as many as "
           "rollout.max_completion_length holds)")
    if r.tool_isolation not in ("thread", "process"):
      fail("rollout.tool_isolation", "must be 'thread' or 'process'")
    if r.tool_timeout_s <= 0 or r.tool_response_tokens < 1:
      fail("rollout.tool_timeout_s" if r.tool_timeout_s <= 0 else "rollout.tool_response_tokens",
           "must be > 0")
  if r.max_staleness > 0:
    for bad, why in ((r.engine != "paged", "rollout.engine='paged'"),
                     (r.dynamic_sampling, "rollout.dynamic_sampling=False"),
                     (r.generation_chunks != 1, "rollout.generation_chunks=1"),
                     (r.strategy not in ("auto", "carried"), "rollout.strategy='auto'")):
      if bad:
        fail("rollout.max_staleness", f"> 0 carries rows between rollouts on the engine: "
             f"it needs {why}")
  for key, unit in (("decode_slots", "slots"), ("kv_pages", "pages")):
    if r[key] != "auto" and (isinstance(r[key], bool) or not isinstance(r[key], int)):
      fail(f"rollout.{key}", f"must be 'auto' or a number of {unit}")
  fixed = lambda v: 0 if v == "auto" else v  # noqa: E731  (plan.fit sizes "auto")
  engine = lambda: engine_lib.EngineConfig(fixed(r.decode_slots), r.page_size,  # noqa: E731
                                           fixed(r.kv_pages), tail_slots(cfg))
  _checked("rollout", lambda: engine().sizes(r.prompts_per_step * r.group_size,
                                             r.max_completion_length),
           {"slots": "rollout.decode_slots", "pages": "rollout.kv_pages",
            "tail_slots": "rollout.tail_slots"})

  _checked("loss", lambda: loss_config(cfg))

  a = cfg.advantage
  if a.estimator not in advantages_lib.known_estimators():
    fail("advantage.estimator", f"is unknown; known: {advantages_lib.known_estimators()}")
  _validate_critic(cfg, fail)
  if a.scale not in advantages_lib.SCALES:
    fail("advantage.scale", f"is unknown; known: {list(advantages_lib.SCALES)}")
  if a.eps < 0:
    fail("advantage.eps", "must be >= 0")
  if r.dynamic_sampling and advantages_lib.is_per_function(a.estimator):
    fail("advantage.estimator", "cannot be used with rollout.dynamic_sampling=True (it "
         "normalises over the whole batch, which would mix generation batches)")
  if r.dynamic_sampling and a.scale == "batch":
    # Kept groups come from several generation batches; each was scaled by its own.
    fail("advantage.scale", "cannot be used with rollout.dynamic_sampling=True (the batch std "
         "would mix generation batches); use 'group' or 'none'")

  _checked("optim", lambda: optim_config(cfg))
  if (t.minibatches * t.num_iterations) % o.grad_accum_steps:
    fail("optim.grad_accum_steps", f"must divide the {t.minibatches * t.num_iterations} minibatch "
         "gradients of a rollout (train.minibatches x num_iterations): an optimizer step would "
         "straddle two rollouts; to bound memory use train.micro_batches")

  if t.steps < 1:
    fail("train.steps", "must be >= 1")
  for key in ("num_iterations", "minibatches", "log_every"):
    if t[key] < 1:
      fail(f"train.{key}", "must be >= 1")
  for key in ("eval_every", "save_every"):
    if t[key] < 0:
      fail(f"train.{key}", "must be >= 0 (0: start and end only)")
  if t.micro_batches != "auto" and (isinstance(t.micro_batches, bool)
                                    or not isinstance(t.micro_batches, int) or t.micro_batches < 1):
    fail("train.micro_batches", "must be 'auto' or an integer >= 1")
  elif t.micro_batches != "auto" and (r.prompts_per_step // max(t.minibatches, 1)) % t.micro_batches:
    fail("train.micro_batches", f"must divide the {r.prompts_per_step // max(t.minibatches, 1)} "
         "groups of a minibatch (rollout.prompts_per_step / train.minibatches)")
  if t.memory_budget != "auto" and (isinstance(t.memory_budget, bool)
                                    or not isinstance(t.memory_budget, (int, float))
                                    or t.memory_budget < 0):
    fail("train.memory_budget", "must be 'auto' or GiB per device >= 0 (0: no fitting)")
  if t.log_completions < 0:
    fail("train.log_completions", "must be >= 0 (0: never)")
  unknown = [x for x in logger_names(t.loggers) if x not in metrics_lib.LOGGERS]
  if unknown:
    fail("train.loggers", f"names unknown loggers {unknown}; known: {metrics_lib.LOGGERS.names()} "
         "(grpojax.train.metrics.register_logger adds one)")
  if r.prompts_per_step % t.minibatches:
    fail(
        "train.minibatches",
        f"must divide rollout.prompts_per_step={r.prompts_per_step} (a minibatch holds whole groups)",
    )
  if cfg.sft.steps < 0:
    fail("sft.steps", "must be >= 0")
  if cfg.sft.steps and task.sft_target is None:
    fail("sft.steps", f"is a warm start on reference completions, which task {task.name!r} "
         "does not have: set sft.steps=0")
  if cfg.sft.steps and cfg.sft.learning_rate <= 0:
    fail("sft.learning_rate", "must be > 0 when sft.steps > 0")
  if cfg.sft.steps and cfg.sft.batch_size < 1:
    fail("sft.batch_size", "must be >= 1 when sft.steps > 0")
  for key in ("num_prompts", "n", "batch_size"):
    if cfg.eval[key] < 0:
      fail(f"eval.{key}", "must be >= 0")
  ks = eval_ks(cfg)
  if ks and cfg.eval.n and ks[-1] > cfg.eval.n:
    fail("eval.k", f"needs eval.n >= {ks[-1]} samples per prompt (eval.n={cfg.eval.n}; "
         "0: the largest k)")
  _checked("eval", lambda: SamplingParams(temperature=cfg.eval.temperature))
  for name, dataset, _ in eval_sets(cfg):
    if _missing_local(dataset):
      fail("eval.sets", f"names {dataset!r} for set {name!r}, which is not a file or "
           "directory here (a local dataset must exist; a hub dataset is named owner/name "
           "or owner/name:subset)")
  if m.ref_dtype not in DTYPES:
    fail("model.ref_dtype", f"is unknown; known: {list(DTYPES)}")
  if not 0 < t.ref_sync_alpha <= 1:
    fail("train.ref_sync_alpha", "must be in (0, 1]")
  if t.on_nonfinite not in ("stop", "skip"):
    fail("train.on_nonfinite", "must be 'stop' or 'skip'")
  if t.ref_sync_every < 0:
    fail("train.ref_sync_every", "must be >= 0 (0: never)")
  if lora_config(cfg).enabled and t.ref_sync_every:
    fail("train.ref_sync_every", "must be 0 with LoRA (model.lora.rank > 0): the reference is "
         "the frozen base, which never moves")
  if t.keep_checkpoints < 1:
    fail("train.keep_checkpoints", "must be >= 1")
  if cfg.rewards.num_workers < 0:
    fail("rewards.num_workers", "must be >= 0")
  if cfg.rewards.timeout_s <= 0:
    fail("rewards.timeout_s", "must be > 0 (seconds)")
  if not 0 <= cfg.rewards.overlong_buffer < r.max_completion_length:
    fail("rewards.overlong_buffer", f"must be in [0, rollout.max_completion_length="
         f"{r.max_completion_length}) (the penalised tail of the length; 0: off)")

  for key, shape in (("mesh.shape", cfg.mesh.shape),
                     ("parallel.rollout_shape", cfg.parallel.rollout_shape)):
    if sorted(shape.keys()) != sorted(mesh_lib.AXES):
      fail(key, f"must name exactly the axes {list(mesh_lib.AXES)}")
    sizes = [shape[k] for k in mesh_lib.AXES]
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
      fail(key, "needs sizes >= 1, with at most one -1 (the remaining devices)")
  p = cfg.parallel
  if p.rollout_devices < 0:
    fail("parallel.rollout_devices", "must be >= 0 (0: the rollout and the update share "
         "every device)")
  if p.rollout_devices and r.dynamic_sampling:
    fail("parallel.rollout_devices", "runs the plain or carried rollout beside the update: "
         "dynamic sampling picks its groups on the host between rounds, which would hold "
         "the update back (rollout.dynamic_sampling=False)")
  return cfg
