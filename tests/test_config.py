"""Config defaults, locking and validate()'s one-line errors."""

import re

import pytest

from grpojax import config
from grpojax.core import losses
from grpojax.run.settings import read as read_settings



def test_defaults_validate_and_build_a_loss_config():
  cfg = config.validate(config.get_config())
  assert read_settings(cfg).loss == losses.LossConfig()


def test_every_design_key_exists():
  # The keys DESIGN.md §3 promises users can override on the command line.
  cfg = config.get_config()
  keys = """model.path model.dtype task.name task.dataset rollout.prompts_per_step
  rollout.group_size rollout.max_prompt_length rollout.max_completion_length
  rollout.temperature rollout.top_p rollout.top_k rollout.min_p loss.loss_type
  loss.epsilon_low loss.epsilon_high loss.delta loss.beta loss.kl_estimator
  loss.importance_sampling_level loss.max_completion_length loss.sapo_tau_pos
  loss.sapo_tau_neg optim.learning_rate optim.warmup_steps optim.weight_decay
  optim.max_grad_norm train.steps train.num_iterations train.minibatches train.seed
  train.log_every train.eval_every train.save_every sft.steps mesh.shape""".split()
  for key in keys:
    node = cfg
    for part in key.split("."):
      assert part in node, key
      node = node[part]


def test_locked_config_rejects_new_keys():
  cfg = config.get_config()
  with pytest.raises(AttributeError):
    cfg.rollout.group_sise = 4
  with pytest.raises(AttributeError):
    cfg.nonsense = 1


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("rollout.group_size", 1, ">= 2"),
        ("rollout.temperature", -0.5, ">= 0"),
        ("rollout.top_p", 0.0, "(0, 1]"),
        ("rollout.top_k", -1, ">= 0"),
        ("rollout.min_p", 1.0, "[0, 1)"),
        ("rollout.prompts_per_step", 0, ">= 1"),
        ("rollout.dynamic_sampling_max_rounds", 0, ">= 1"),
        ("rollout.expected_lengths", "lognormal:512", "lognormal:MEDIAN:SIGMA"),
        ("loss.loss_type", "dapoo", "known: ['bnpo', 'cispo', 'dapo'"),
        ("loss.epsilon_low", -0.1, ">= 0"),
        ("loss.kl_estimator", "k4", "k3"),
        ("loss.importance_sampling_level", "token_level", "sequence"),
        ("loss.beta", -1.0, ">= 0"),
        ("loss.importance_sampling_clip_max", -3.0, "> 0"),
        ("loss.importance_sampling_mode", "seq_mask", "sequence_mask"),
        ("loss.top_entropy_quantile", 1.5, "[0, 1]"),
        ("loss.entropy_coef", -0.1, ">= 0"),
        ("advantage.estimator", "ppo", "rloo"),
        ("advantage.scale", "grp", "batch"),
        ("model.dtype", "float16", "bfloat16"),
        ("model.path", "/nonexistent/dir", "not a directory"),
        ("optim.learning_rate", 0.0, "> 0"),
        ("train.steps", 0, ">= 1"),
        ("train.num_iterations", 0, ">= 1"),
        ("train.minibatches", 3, "divide rollout.prompts_per_step=8"),
        ("sft.steps", -1, ">= 0"),
        ("task.name", "gsm9k", "known: ['arithmetic'"),
        ("model.arch", "huge", "known presets"),
        ("optim.schedule", "step", "'cosine', 'linear'"),
        ("rollout.max_prompt_length", 0, "'auto' (the longest prompt of the data"),
        ("rollout.max_prompt_length", "long", "or a number of tokens >= 1"),
        ("rewards.weights", "1,x", "must be 0 number(s), one per function"),
        ("model.remat", None, "True, False or 'auto'"),
        ("model.remat", "half", "a policy: 'none', 'full', 'dots'"),
        ("train.micro_batches", 0, "'auto' or an integer >= 1"),
        ("train.micro_batches", 3, "must divide the 8 groups of a minibatch"),
        ("train.memory_budget", -1, "'auto' or GiB per device >= 0"),
        ("model.kernels", "fast", "known: ['auto', 'xla', 'cpu', 'tpu', 'gpu']"),
        ("task.dataset", "data/no_such_file.jsonl", "is not a file or directory here"),
        ("task.dataset", "./no_such_dir", "is not a file or directory here"),
        ("optim.grad_accum_steps", 3, "must divide the 1 minibatch gradients"),
        ("task.train_split", "train+test", "one split with an optional slice"),
        ("task.eval_split", "test[:10", "e.g. 'train' or 'train[:1000]'"),
        ("rewards.overlong_buffer", 128, "[0, rollout.max_completion_length=128)"),
        ("rewards.overlong_buffer", -1, "[0, rollout.max_completion_length=128)"),
        # Checked by the settings types (EngineConfig, OptimConfig, SamplingParams), named
        # here by their keys.
        ("rollout.page_size", 0, "must be >= 1 (tokens per KV page)"),
        ("rollout.decode_slots", -1, "must be >= 0"),
        ("rollout.kv_pages", "many", "'auto' or a number of pages"),
        ("rollout.tail_slots", "many", "slot counts >= 1"),
        ("rollout.tail_slots", -4, "slot counts >= 1"),
        ("optim.b2", 1.0, "[0, 1)"),
        ("eval.temperature", -1.0, ">= 0 (0 is greedy)"),
    ],
)
def test_impossible_values_fail_with_one_line_naming_the_key(key, value, words):
  cfg = config.get_config()
  section, name = key.split(".")
  cfg[section][name] = value
  with pytest.raises(config.ConfigError) as e:
    config.validate(cfg)
  msg = str(e.value)
  assert "\n" not in msg
  assert key in msg and words in msg, msg


def test_a_pool_must_hold_one_full_completion():
  cfg = config.get_config()
  cfg.rollout.page_size, cfg.rollout.kv_pages = 16, 7  # 128 tokens need 8 pages of 16
  with pytest.raises(config.ConfigError, match=r"^config: rollout\.kv_pages=7 cannot hold one "
                     r"completion of 128 tokens in pages of 16: give 0 .* or at least 8$"):
    config.validate(cfg)
  cfg.rollout.kv_pages = 8
  config.validate(cfg)


def test_tail_slots_reach_the_engine():
  cfg = config.get_config()
  cfg.rollout.engine = "paged"
  for value, want in (("auto", None), (0, ()), (16, (16,)), ((64, 16), (64, 16))):
    cfg.rollout.tail_slots = value
    assert read_settings(config.validate(cfg)).rollout.engine_config().tail_slots == want


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("train.ref_sync_every", -1, ">= 0"),
        ("train.keep_checkpoints", 0, ">= 1"),
        ("rewards.num_workers", -1, ">= 0"),
        ("rewards.timeout_s", 0.0, "> 0"),
        ("sft.learning_rate", 0.0, "> 0"),
        ("sft.batch_size", 0, ">= 1"),
    ],
)
def test_each_key_of_a_former_combined_check_is_named_itself(key, value, words):
  cfg = config.get_config()
  cfg.sft.steps = 1
  section, name = key.split(".")
  cfg[section][name] = value
  with pytest.raises(config.ConfigError) as e:
    config.validate(cfg)
  # The message opens with the offending key and its value, not a sibling's.
  assert str(e.value).startswith(f"config: {key}={value!r} must be {words}"), str(e.value)


def test_cispo_needs_an_explicit_ratio_cap():
  cfg = config.get_config()
  cfg.loss.loss_type = "cispo"
  with pytest.raises(config.ConfigError, match=r"loss\.epsilon_high"):
    config.validate(cfg)
  cfg.loss.epsilon_high = 5.0
  config.validate(cfg)


def test_dynamic_sampling_refuses_batch_scaled_advantages():
  cfg = config.get_config()
  cfg.advantage.scale = "batch"
  config.validate(cfg)
  cfg.rollout.dynamic_sampling = True
  with pytest.raises(config.ConfigError, match=r"advantage\.scale='batch' .*dynamic_sampling"):
    config.validate(cfg)
  cfg.advantage.scale = "group"
  config.validate(cfg)
  cfg.advantage.estimator = "gdpo"  # normalises over the batch too
  with pytest.raises(config.ConfigError, match=r"advantage\.estimator='gdpo' .*dynamic_sampling"):
    config.validate(cfg)
  cfg.advantage.estimator = "grpo"
  cfg.rollout.prompts_per_step, cfg.rollout.generation_chunks = 4, 2
  cfg.rollout.engine = "lockstep"
  config.validate(cfg)  # rounds, each in two chunks
  cfg.rollout.engine = "paged"  # streams through the engine's slots instead
  with pytest.raises(config.ConfigError, match=r"rollout\.generation_chunks=2 .*paged engine"):
    config.validate(cfg)


def test_new_options_take_their_valid_values():
  cfg = config.get_config()
  cfg.model.remat = True
  cfg.rewards.overlong_buffer = cfg.rollout.max_completion_length - 1
  for split in ("train", "validation", "train[:100]", "train[327680:328704]", "test[-10%:]"):
    cfg.task.train_split = cfg.task.eval_split = split
    config.validate(cfg)


def test_optional_loss_fields_take_values_and_none():
  cfg = config.get_config()
  cfg.loss.epsilon_high = 0.28
  cfg.loss.delta = 4.0
  cfg.loss.max_completion_length = 256
  lc = read_settings(config.validate(cfg)).loss
  assert (lc.eps_high, lc.delta, lc.max_completion_length) == (0.28, 4.0, 256)
  cfg.loss.delta = 0.5
  with pytest.raises(config.ConfigError, match=r"loss\.delta=0\.5"):
    config.validate(cfg)
  cfg.loss.delta = None
  cfg.loss.importance_sampling_clip_min = 0.5
  cfg.loss.off_policy_mask_threshold = 0.5
  cfg.loss.importance_sampling_clip_max = None
  lc = read_settings(config.validate(cfg)).loss
  assert (lc.importance_sampling_clip_min, lc.importance_sampling_clip_max) == (0.5, None)
  assert lc.off_policy_mask_threshold == 0.5


@pytest.mark.parametrize(
    "shape", [dict(data=1, fsdp=-1, tensor=-1), dict(data=0, fsdp=-1, tensor=1), dict(data=1, fsdp=-1)]
)
def test_bad_mesh_shapes(shape):
  cfg = config.get_config()
  with cfg.unlocked():
    cfg.mesh.shape = shape
  with pytest.raises(config.ConfigError, match=r"mesh\.shape"):
    config.validate(cfg)


def test_unknown_keys_in_an_unlocked_config_are_caught():
  cfg = config.get_config()
  with cfg.unlocked():
    cfg.optim.lr = 1e-5
  with pytest.raises(config.ConfigError, match=re.escape("unknown key 'optim.lr'")):
    config.validate(cfg)


def test_command_line_overrides_parse_with_types():
  from absl import flags
  from ml_collections import config_flags

  def parse(argv):
    fv = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", config.get_config(), flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config

  cfg = config.validate(parse([
      "prog",
      "--config.loss.loss_type=grpo",
      "--config.loss.epsilon_high=0.28",
      "--config.rollout.group_size=16",
      "--config.optim.learning_rate=3e-6",
  ]))
  assert (cfg.loss.loss_type, cfg.loss.epsilon_high, cfg.rollout.group_size) == ("grpo", 0.28, 16)
  assert cfg.optim.learning_rate == pytest.approx(3e-6)
  with pytest.raises(Exception, match="group_sise"):
    parse(["prog", "--config.rollout.group_sise=16"])
