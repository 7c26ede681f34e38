"""The experiment config's schema: `get_config()`, the defaults every experiment
starts from, and the ways values reach it (`apply`, `dotted`, `from_json`).

Experiments (`experiments/*.py`) start from `get_config()` and change values;
the config is locked, so a misspelt key fails where it is written. A run reads
it once, into typed settings that check every value (grpojax.run.settings.read;
`validate` here runs those checks early).
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections
from ml_collections import config_dict

from grpojax.core import losses as losses_lib
from grpojax.errors import ConfigError  # the config's error, raised below it too

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


def resume_differences(previous: dict, cfg) -> list[str]:
  """The keys, as "key (old -> new)", where `cfg` (a ConfigDict, or a dict as
  Settings.source holds it) differs from the config a workdir's run was started with
  (its config.json), leaving out SAFE_ON_RESUME."""
  given = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else cfg
  # Through JSON, as config.json was written: tuples are lists, odd leaves strings.
  now = _flat(json.loads(json.dumps(given, default=str)))
  before = _flat(previous)
  keys = sorted(set(now) | set(before))
  return [f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in keys
          if before.get(k) != now.get(k) and not k.startswith(SAFE_ON_RESUME)]


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


# Sections whose keys are the user's (set whole; settings.read checks them).
FREE_FORM = ("mesh.shape", "parallel.rollout_shape", "loss.options")


def dotted(values, prefix: str = "") -> dict:
  """{"rollout": {"group_size": 4}} and {"rollout.group_size": 4} alike, as dotted keys
  (mesh.shape and loss.options stay whole)."""
  out = {}
  for key, value in values.items():
    if hasattr(value, "items") and f"{prefix}{key}" not in FREE_FORM:
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
      if key in FREE_FORM:
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


def validate(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks `cfg` before anything expensive runs; returns it unchanged. The checks
  are the settings' own (grpojax.run.settings.read, which a run calls anyway): here
  for an experiment or a notebook that wants to know early.

  Raises:
    ConfigError: with one line naming the key, its value and what would be valid.
  """
  from grpojax.run import settings  # pylint: disable=import-outside-toplevel

  settings.read(cfg)
  return cfg
