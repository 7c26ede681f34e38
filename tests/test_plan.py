"""The planner (`python -m grpojax.plan`): its programs are the run's own, so its
numbers equal the real programs' compiled on real arrays; the CLI's JSON and its
verdict; and the loop's persistent compilation cache."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from grpojax import config as config_lib
from grpojax import models
from grpojax import plan as plan_lib
from grpojax.data import PromptIterator, get_task, load_rows
from grpojax.models.tokenizers import CharTokenizer
from grpojax.parallel import mesh as mesh_lib
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling import engine as engine_lib
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import loop, sft, step, wiring
from grpojax.train.optim import make_optimizer
from grpojax.train import strategy as strategy_lib
from grpojax.train.rollout import RolloutConfig
from grpojax.train.state import create_train_state, init_optimizer
from grpojax.run import assemble as assemble_lib
from grpojax.run.settings import read as read_settings


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config():
  cfg = config_lib.get_config()
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 2, 4
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = 16, 8
  cfg.loss.beta = 0.04  # a reference copy in the state and a reference pass in the rollout
  cfg.train.minibatches = 2
  cfg.eval.num_prompts, cfg.eval.batch_size = 4, 8
  cfg.sft.steps, cfg.sft.batch_size = 2, 8
  return cfg


def _compiled_bytes(compiled) -> int:
  return plan_lib.peak_bytes(compiled)


@pytest.mark.slow
def test_planned_programs_equal_the_real_runs_compiled_programs():
  cfg = _tiny_config()
  planned = plan_lib.plan(cfg, device="cpu")

  # The run's own set-up (train.loop), on real arrays: 8 fake devices, rows sharded.
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  tokenizer = CharTokenizer()
  run = read_settings(cfg)
  model_cfg, params = assemble_lib.load_model(run, wiring.model_config(run, tokenizer), mesh)
  tx = make_optimizer(cfg.optim, cfg.train.steps * cfg.train.minibatches)
  state = create_train_state(model_cfg, params, tx, with_reference=True)
  task = get_task(cfg.task.name)
  fns, weights = wiring.run_rewards(read_settings(cfg), task)
  rows = load_rows(task, cfg.task.dataset, task.splits[0])
  it = PromptIterator(rows, task, tokenizer, batch_size=2, max_prompt_length=16, seed=0)
  host = HostRewards(fns, decode=lambda r: [tokenizer.decode(x) for x in r], lookup=it.lookup,
                     weights=weights, num_workers=0)
  r = cfg.rollout
  engine = read_settings(cfg).rollout.engine_config()  # the paged engine, every row in a slot
  rollout_config = RolloutConfig(
      group_size=4, max_new_tokens=8, sampling=SamplingParams(r.temperature, r.top_k, r.top_p, r.min_p),
      eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id, with_reference=True,
      with_old_logps=True, logprob_chunks=2,  # minibatches x micro-batches: the log-prob row chunks
      engine=engine)
  rollout_fn = strategy_lib.make("plain", rollout_config, host, num_prompts=2,
                                 reward_weights=weights, mesh=mesh)
  batch = mesh_lib.global_batch(it.next(), mesh)
  key = jax.random.key(0)
  try:
    real_rollout = _compiled_bytes(rollout_fn.lower(
        state, key, prompt_length=batch["prompt_tokens"].shape[1]).compile())
    # Done before the host closes: the program's reward callback finds the host by its slot.
    rollout, _ = jax.block_until_ready(rollout_fn(state, batch, key))
  finally:
    host.close()
  real_update = _compiled_bytes(step.update.lower(
      state, rollout, key, loss_config=read_settings(cfg).loss, group_size=4, minibatches=2,
      temperature=rollout_config.logp_temperature).compile())

  # Eval's greedy generate, as Evaluator calls it on the state's float32 weights.
  eval_rows = mesh_lib.row_sharding(mesh, 8)
  tokens = jax.device_put(np.zeros((8, 16), np.int32), eval_rows)
  generate, more = engine_lib.program_for(engine, mesh, 8)
  real_eval = _compiled_bytes(generate.lower(
      state.model_config, state.params, tokens, tokens, key, sampling=SamplingParams(temperature=0.0),
      num_samples=1, max_new_tokens=8, eos=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id,
      **more).compile())

  # The SFT step, on a copy of the weights and a batch of reference answers.
  sft_tx = sft.sft_optimizer(cfg.sft.learning_rate, cfg.sft.steps)
  sft_params = {k: jax.numpy.array(v, copy=True) for k, v in state.params.items()}
  sft_it = PromptIterator(rows, task, tokenizer, batch_size=8, max_prompt_length=16, seed=1)
  sft_batch = mesh_lib.global_batch(sft.target_batch(sft_it, task, tokenizer, 8), mesh)
  real_sft = _compiled_bytes(sft.sft_step.lower(
      state.model_config, sft_params, init_optimizer(sft_tx, sft_params), sft_batch,
      tx=sft_tx).compile())

  assert planned["programs"]["sft"]["peak_bytes"] == real_sft
  assert planned["programs"]["eval_greedy"]["peak_bytes"] == real_eval
  assert planned["programs"]["rollout"]["peak_bytes"] == real_rollout
  assert planned["programs"]["update"]["peak_bytes"] == real_update
  assert planned["choices"]["devices"] == 8 and planned["fits"] is True
  assert planned["programs"]["update"]["flops"] > 0
  assert planned["choices"]["state_bytes"] == sum(
      x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))


@pytest.mark.slow
def test_cli_json_names_the_program_that_does_not_fit(tmp_path):
  # Without the H100's compiler here: XLA:CPU's proxy, and the line that says so. One
  # host device, the fit pinned (one compile): the update fits 3 MB, the SFT step not.
  # Eval greedy only (eval.k=0): pass@k's sampled generate would be one compile more.
  env = {k: v for k, v in os.environ.items() if k != "GRPOJAX_CUDA_PLUGIN"}
  env["GRPOJAX_COMPILERS"] = str(tmp_path)  # nothing installed there
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()  # compile
                              if not f.startswith("--xla_force_host_platform_device_count"))
  env["PYTHONPATH"] = ROOT
  out = subprocess.run(
      [sys.executable, "-m", "grpojax.plan", "--config", "experiments/arithmetic_tiny.py:smoke",
       "--config.train.micro_batches=8", "--config.model.remat=true", "--config.eval.k=0",
       "--device", "h100-80gb", "--memory_gb", "0.003", "--json"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert {"device", "device_memory_bytes", "programs", "choices", "fits"} <= set(result)
  assert {"rollout", "update", "eval_greedy"} <= set(result["programs"])
  for p in result["programs"].values():
    assert {"peak_bytes", "flops", "compile_s"} <= set(p)
  assert result["fits"] is False and result["device"] == "h100-80gb"
  line = next(l for l in out.stdout.splitlines() if l.startswith("does not fit: "))
  worst = max(result["programs"], key=lambda k: result["programs"][k]["total_bytes"])
  assert line.startswith(f"does not fit: {worst} needs ") and "GiB" in line and "0.00 GiB" in line
  assert "XLA:CPU" in out.stdout  # off-device numbers say what they are
  assert "--install-compilers" in out.stdout
  # Each compile said on stderr as it starts, for which device and by which compiler.
  said = [line for line in out.stderr.splitlines() if line.startswith("plan: ")]
  where = "for 1 x h100-80gb (XLA:CPU as a proxy: h100-80gb's compiler is not here)"
  assert said == [f"plan: compiling {p} {where}" for p in result["programs"]], out.stderr


def test_published_presets_keep_their_vocabulary_tiny_ones_take_the_tokenizers():
  cfg = config_lib.get_config()
  tok = CharTokenizer()
  assert wiring.model_config(read_settings(cfg), tok).vocab_size == tok.vocab_size
  cfg.model.arch = "qwen2.5-7b"
  big = wiring.model_config(read_settings(cfg), tok)
  assert (big.vocab_size, big.hidden_size, big.num_layers, big.tie_embeddings) == (
      152064, 3584, 28, False)
  assert tok.vocab_size <= big.vocab_size
  counts = {name: sum(int(jax.numpy.prod(jax.numpy.array(s))) for s, _ in
                      models.param_specs(models.PRESETS[name]).values())
            for name in ("qwen2.5-0.5b", "qwen2.5-7b", "llama-3.2-1b")}
  # The published parameter counts.
  assert counts == {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512,
                    "llama-3.2-1b": 1_235_814_400}


def test_loop_turns_the_persistent_compilation_cache_on(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  try:
    # A cache already chosen (conftest's JAX_COMPILATION_CACHE_DIR) is kept.
    assert loop.set_compilation_cache(str(tmp_path / "mine")) == (before or str(tmp_path / "mine"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert loop.set_compilation_cache("") == ""
    assert loop.set_compilation_cache(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert os.path.isdir(tmp_path / "mine")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  assert config_lib.get_config().train.compilation_cache_dir == "~/.cache/grpojax/xla"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow
def test_fit_picks_the_fewest_micro_batches_that_fit_the_budget():
  cfg = config_lib.get_config()
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 8, 4
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = 16, 48
  cfg.model.remat = False
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  model_cfg = wiring.model_config(read_settings(cfg), CharTokenizer())
  # "auto" on a CPU (host RAM, not a device's memory): no fitting, nothing compiled.
  fitted = plan_lib.fit(read_settings(cfg), model_cfg, mesh)
  assert (fitted.micro_batches, fitted.remat, fitted.update_bytes) == (1, False, None)
  run = read_settings(cfg)
  need = {m: plan_lib.update_bytes(run, model_cfg, mesh, micro_batches=m) for m in (1, 2, 4, 8)}
  assert need[1] > need[2] > need[4] > need[8]  # activations for fewer rows at a time
  GiB = plan_lib.GiB
  cfg.train.memory_budget = (need[2] + need[4]) / 2 / GiB  # 2 does not fit, 4 does
  fitted = plan_lib.fit(read_settings(cfg), model_cfg, mesh)
  assert (fitted.micro_batches, fitted.remat, fitted.update_bytes) == (4, False, need[4])
  assert "micro_batches=4" in fitted.how
  cfg.train.micro_batches = 8  # the user's value is kept, when it fits
  assert plan_lib.fit(read_settings(cfg), model_cfg, mesh).micro_batches == 8
  cfg.train.micro_batches = 2  # and refused in one line when it does not
  with pytest.raises(config_lib.ConfigError, match="micro_batches=2"):
    plan_lib.fit(read_settings(cfg), model_cfg, mesh)
  cfg.train.micro_batches = "auto"
  cfg.train.memory_budget = need[8] * 0.9 / GiB
  with pytest.raises(config_lib.ConfigError) as e:
    plan_lib.fit(read_settings(cfg), model_cfg, mesh)
  assert "\n" not in str(e.value) and "micro_batches=8" in str(e.value)
  assert "train.memory_budget" in str(e.value)


@pytest.mark.slow
def test_fit_pages_gives_the_engine_what_the_budget_leaves():
  cfg = config_lib.get_config()
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = 16, 64
  cfg.rollout.engine, cfg.rollout.page_size, cfg.rollout.kv_pages = "paged", 16, "auto"
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  model_cfg = wiring.model_config(read_settings(cfg), CharTokenizer())
  per_row, full = 4, 16 * 4  # 64 tokens in pages of 16; 16 slots (every row)
  run = read_settings(cfg)
  assert plan_lib.fit_pages(run, model_cfg, mesh)[0] == 0  # a CPU: no budget, every slot
  each = plan_lib.page_bytes(read_settings(cfg), model_cfg)
  cfg.train.memory_budget = 100.0  # GiB: more than every slot at full length needs
  assert plan_lib.fit_pages(read_settings(cfg), model_cfg, mesh)[0] == full
  cfg.train.memory_budget = 1e-6  # less than the weights
  with pytest.raises(config_lib.ConfigError, match="kv_pages='auto'") as e:
    plan_lib.fit_pages(read_settings(cfg), model_cfg, mesh)
  assert "\n" not in str(e.value)
  # Between: each page more of budget is one page more of pool, up to every slot.
  floor = float(str(e.value).split("needs ")[1].split(" GiB")[0]) * plan_lib.GiB
  got = []
  for extra in (5, 9):
    cfg.train.memory_budget = (floor + extra * each) / plan_lib.GiB
    got.append(plan_lib.fit_pages(read_settings(cfg), model_cfg, mesh)[0])
  assert per_row < got[0] < got[1] <= full and abs((got[1] - got[0]) - 4) <= 1
  # DAPO's streaming prefills every batch's prompts beside the pool: it needs more.
  cfg.rollout.dynamic_sampling = True
  with pytest.raises(config_lib.ConfigError, match="kv_pages='auto'") as e:
    plan_lib.fit_pages(read_settings(cfg), model_cfg, mesh)
  assert float(str(e.value).split("needs ")[1].split(" GiB")[0]) * plan_lib.GiB > floor
  cfg.rollout.dynamic_sampling = False
  cfg.rollout.kv_pages = 8  # a number is kept as given
  assert plan_lib.fit_pages(read_settings(cfg), model_cfg, mesh) == (8, "kv_pages=8")


def _pages_peak_by_steps(lengths, T, slots, page_size):
  """The engine's schedule step by step: slots take the lowest pending rows, a running row
  takes a page when the position it feeds starts one, and frees them all when it ends."""
  pending = [int(x) for x in lengths if min(x, T) > 1]
  running = []  # [length, position, pages]
  peak = 0
  while pending or running:
    while pending and len(running) < slots:
      running.append([min(pending.pop(0), T), 0, 0])
    for r in running:
      r[2] += r[1] % page_size == 0
    peak = max(peak, sum(r[2] for r in running))
    for r in running:
      r[1] += 1
    running = [r for r in running if r[1] + 1 < r[0]]
  return peak


def test_live_pages_peak_replays_the_engines_schedule():
  assert plan_lib.live_pages_peak([5, 3, 9], 10, slots=2, page_size=2) == 4  # worked by hand
  rng = np.random.default_rng(1)
  for slots, page_size in ((1, 1), (3, 2), (8, 4), (40, 3)):
    lengths = np.clip(rng.lognormal(np.log(12), 1.0, 40).round(), 1, 64).astype(int)
    assert (plan_lib.live_pages_peak(lengths, 64, slots=slots, page_size=page_size)
            == _pages_peak_by_steps(lengths, 64, slots, page_size)), (slots, page_size)


@pytest.mark.slow
def test_fit_engine_chooses_the_slots_the_pool_holds_at_full_length():
  cfg = config_lib.get_config()
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = 16, 64
  cfg.rollout.engine, cfg.rollout.page_size = "paged", 16
  cfg.rollout.decode_slots, cfg.rollout.kv_pages = "auto", "auto"
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  model_cfg = wiring.model_config(read_settings(cfg), CharTokenizer())
  N, per_row = 16, 4
  run = read_settings(cfg)
  assert plan_lib.fit_engine(run, model_cfg, mesh)[:2] == (N, 0)  # a CPU: every row, every slot
  cfg.train.memory_budget = 100.0
  assert plan_lib.fit_engine(read_settings(cfg), model_cfg, mesh)[:2] == (N, N * per_row)
  # Lengths to expect: every row, and a pool for their live pages, not the budget's.
  cfg.rollout.expected_lengths = "lognormal:8:1.0"
  slots, pages, how = plan_lib.fit_engine(read_settings(cfg), model_cfg, mesh)
  median = plan_lib.live_pages_peak(np.full(N, 8), 64, slots=N, page_size=16)
  assert slots == N and per_row <= pages < N * per_row and pages >= median, (slots, pages)
  assert "expected_lengths" in how
  cfg.rollout.expected_lengths = ""
  # A budget for about 6 rows at full length beside the generation of 6 slots: the
  # pool fitted for 16 slots holds fewer rows, so it is fitted again for those.
  cfg.train.memory_budget = 1e-6
  cfg.rollout.decode_slots = 6
  with pytest.raises(config_lib.ConfigError) as e:
    plan_lib.fit_pages(read_settings(cfg), model_cfg, mesh)
  floor = float(str(e.value).split("needs ")[1].split(" GiB")[0]) * plan_lib.GiB
  each = plan_lib.page_bytes(read_settings(cfg), model_cfg)
  cfg.train.memory_budget = (floor + 2.5 * per_row * each) / plan_lib.GiB
  cfg.rollout.decode_slots = "auto"
  slots, pages, how = plan_lib.fit_engine(read_settings(cfg), model_cfg, mesh)
  assert 1 <= slots < N and slots * per_row <= pages < (slots + 1) * per_row, (slots, pages)
  assert f"decode_slots={slots}" in how
  # The pool given: as many slots as it holds rows at full length; 0 holds every row.
  cfg.rollout.kv_pages = 10
  assert plan_lib.fit_engine(read_settings(cfg), model_cfg, mesh)[:2] == (2, 10)
  cfg.rollout.kv_pages = 0
  assert plan_lib.fit_engine(read_settings(cfg), model_cfg, mesh)[:2] == (N, 0)
  cfg.rollout.decode_slots = 3  # slots given: the pool alone is fitted
  assert plan_lib.fit_engine(read_settings(cfg), model_cfg, mesh)[:2] == (3, 0)
  engine = read_settings(cfg).rollout.engine_config(kv_pages=7, decode_slots=5)
  assert (engine.slots, engine.pages) == (3, 0)  # numbers in the config win over fitted ones


@pytest.mark.slow
def test_a_run_that_cannot_fit_stops_at_startup_in_one_line(tmp_path):
  # The layout pinned: fit compiles the update once and refuses it (its search of
  # micro-batches and remat, and the line it ends with, are test_fit_picks_...'s).
  proc = subprocess.run(
      [sys.executable, "-m", "grpojax.main", "--config=experiments/arithmetic_tiny.py:smoke",
       f"--workdir={tmp_path}", "--config.train.memory_budget=0.0002",
       "--config.train.micro_batches=1", "--config.model.remat=false"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 1, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: the update needs") and "train.memory_budget" in last
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_train_state_over_the_budget_fits_nothing_and_compiles_nothing():
  cfg = _tiny_config()
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  model_cfg = wiring.model_config(read_settings(cfg), wiring.run_tokenizer(read_settings(cfg)))
  state = plan_lib.bytes_per_device(plan_lib.abstract_state(read_settings(cfg), model_cfg, mesh))
  compiles = []
  real = plan_lib.measure
  plan_lib.measure = lambda *a, **k: compiles.append(1) or real(*a, **k)
  try:
    with pytest.raises(config_lib.ConfigError, match=r"^the train state alone .* the reference"):
      plan_lib.fit(read_settings(cfg), model_cfg, mesh, device_bytes=int(state / 0.9) - 1024)
  finally:
    plan_lib.measure = real
  assert not compiles
