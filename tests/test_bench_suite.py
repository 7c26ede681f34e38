"""bench/ as a suite: every grpojax name bench/ reads exists and is public; every workload
of bench/run.py runs at --quick, its --json record holding its figures, finite and
positive, with their provenance, or, where even that compiles for too long, at
--dry-run (its programs traced, its trainers built, its rows' configs checked);
bench/device.sh parses, and its --quick run leaves the records and the table a device
run would. A refactor that breaks a benchmark fails here.

device_programs runs at --quick in tests/test_device_programs.py, and plan_figures'
H100 row is planned in tests/test_plan_figures.py, beside the properties they check."""

import ast
import importlib
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import run as bench_run  # noqa: E402  bench/run.py


def positive(figures: dict, *keys) -> None:
  for key in keys:
    value = figures[key]
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)


def quick(name: str, *flags: str, capsys=None) -> dict:
  """bench/run.py NAME --quick --json in this process: its record, checked against the
  line --json printed last."""
  record = bench_run.main([name, "--quick", "--json", *flags])
  if capsys is not None:
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(json.dumps(record))
  assert record["workload"] == name
  assert record["command"] == " ".join(["python bench/run.py", name, "--quick", "--json", *flags])
  assert record["device"].startswith("cpu") and record["jax"]
  assert record["commit"] is None or len(record["commit"]) >= 7
  return record["figures"]


def test_list_names_every_workload_with_its_line(capsys):
  bench_run.main(["--list"])
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in lines] == list(bench_run.WORKLOADS)
  assert all(len(line.split()) > 3 for line in lines)
  for name in bench_run.WORKLOADS:  # each module has the runner's two functions
    module = bench_run.load(name)
    assert callable(module.add_arguments) and callable(module.run), name


def test_an_unknown_workload_names_the_known_ones():
  with pytest.raises(SystemExit, match="known: sampler, step"):
    bench_run.main(["samplr"])


def grpojax_names(tree) -> tuple[list, dict]:
  """([(module, name)] a file imports from grpojax, {local name: grpojax module})."""
  imported, modules = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpojax"):
      parent = importlib.import_module(node.module)
      for a in node.names:
        imported.append((node.module, a.name))
        obj = getattr(parent, a.name, None)
        if obj is None and importlib.util.find_spec(f"{node.module}.{a.name}"):
          obj = importlib.import_module(f"{node.module}.{a.name}")
        if inspect.ismodule(obj):
          modules[a.asname or a.name] = obj
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("grpojax"):
          imported.append((a.name, ""))
          modules[a.asname or "grpojax"] = importlib.import_module(a.asname and a.name
                                                                  or "grpojax")
  return imported, modules


def test_the_bench_reads_only_public_grpojax_names_that_exist():
  """Every grpojax name bench/ imports or reads off a grpojax module exists and is
  public: a rename breaks this test, not a benchmark nobody runs."""
  for folder in (BENCH, os.path.join(BENCH, "workloads")):
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
      tree = ast.parse(open(os.path.join(folder, file), encoding="utf-8").read())
      imported, modules = grpojax_names(tree)
      for module, name in imported:
        assert not any(part.startswith("_") for part in (*module.split("."), name)), (
            file, module, name)
        if name:
          parent = importlib.import_module(module)
          assert hasattr(parent, name) or importlib.util.find_spec(f"{module}.{name}"), (
              file, module, name)
      for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in modules):
          where = f"{file}: {node.value.id}.{node.attr}"
          assert not node.attr.startswith("_"), where
          assert hasattr(modules[node.value.id], node.attr), where


@pytest.mark.slow
def test_a_checkpoint_both_frameworks_load(tmp_path):
  import common
  from grpojax import models
  from grpojax.models.tokenizers import load_tokenizer

  tokenizer = common.write_checkpoint(str(tmp_path), common.TINY, words=["Ann", "has", "apples"])
  model = models.from_pretrained(str(tmp_path), dtype="float32")
  assert model.config.vocab_size == common.TINY["vocab_size"]
  tok = load_tokenizer(tokenizer)
  text = tok.apply_chat_template([{"role": "user", "content": "Ann has w20 apples"}])
  assert tok.hf.convert_ids_to_tokens(tok.encode(text)) == text.split()  # every word one token
  assert tok.eos_ids == (common.EOS,) and tok.pad_id == common.PAD


@pytest.mark.slow
def test_sampler_against_transformers(capsys):
  f = quick("sampler", capsys=capsys)
  (r,) = f["runs"]
  assert r["rows"] == 8 and f["model"] == "tiny"
  positive(r, "grpojax_tok_s", "transformers_tok_s", "ratio", "grpojax_hbm_roofline")
  assert r["ratio"] == pytest.approx(r["transformers_s"] / r["grpojax_s"])


@pytest.mark.slow
def test_step_against_trl():
  f = quick("step")
  positive(f, "grpojax_step_s", "grpojax_rollout_s", "grpojax_update_s", "trl_step_s",
           "step_ratio", "rollout_ratio", "update_ratio", "grpojax_update_mfu")
  assert f["step_ratio"] == pytest.approx(f["grpojax_step_s"] / f["trl_step_s"])


def dry(name: str, *flags: str) -> dict:
  """bench/run.py NAME --dry-run in this process: its figures (what it set up)."""
  record = bench_run.main([name, "--dry-run", "--json", *flags])
  assert record["workload"] == name
  assert record["command"] == " ".join(["python bench/run.py", name, "--dry-run", "--json", *flags])
  return record["figures"]


@pytest.mark.slow
def test_stream_traces_its_three_rollouts():
  assert dry("stream", "--quick") == {"traced": ["overlap", "stream", "rounds"]}


@pytest.mark.slow
def test_lora_traces_each_modes_programs():
  assert dry("lora", "--quick") == {"traced": ["none", "lora", "qlora"]}


@pytest.mark.slow
def test_trl_side_by_side_builds_its_trainers():
  assert dry("trl_side_by_side") == {"built": ["api", "carried", "trl"]}


def test_long_plans_and_plan_figures_rows_are_valid_configs():
  commands = dry("long_plans")["commands"]
  assert len(commands) == 36 and all(c.startswith("python -m grpojax.plan ") for c in
                                     commands.values())
  proxy = dry("plan_proxy")["commands"]
  rows = dry("plan_figures")["commands"]
  assert set(proxy) == set(rows) - {"gsm8k-tiny-cpu"}  # the rows with a device to compare
  assert all(proxy[k][0] == rows[k] for k in proxy)
  assert set(rows) == {"gsm8k-tiny-cpu", "gsm8k-0.5b-v5e", "gsm8k-0.5b-h100", "gsm8k-7b-8xh100"}


def test_the_planners_proxy_note_quotes_the_measured_range():
  """plan.py's PROXY_ERROR, which a plan without the device's compiler quotes, is the
  range of the table plan_proxy wrote in docs/devices.md."""
  from grpojax import plan as plan_lib

  proxy = bench_run.load("plan_proxy")
  with open(proxy.DOC, encoding="utf-8") as f:
    assert proxy.documented_range(f.read()) == plan_lib.PROXY_ERROR
  assert plan_lib.PROXY_ERROR[0] < plan_lib.PROXY_ERROR[1]


@pytest.mark.slow
def test_rewards_math_and_sandboxed_code():
  f = quick("rewards")
  positive(f, "math_in_process_per_s", "math_pool_per_s", "code_pool_1_per_s",
           "code_run_wall_ms", "code_run_cpu_ms")
  assert 0.3 < f["math_accuracy"] < 0.7  # about half right by construction
  assert f["code_passed"] == 5  # 8 programs, 5 of them right


def test_math_agreement():
  f = quick("math_agreement")
  assert f["cases"] == 40 and f["false_negatives"] == 0
  # The two cases MathAccuracy differs on on purpose (tests/test_math_verify_suite.py).
  assert f["disagreements"] == ["test_all.py::test_latex_notation[5]",
                                "test_all.py::test_latex_notation[6]"]
  positive(f, "median_ms", "total_s")


def test_startup_times_each_command_against_import_jax():
  f = quick("startup")
  positive(f, "import_jax_s", "import_grpojax_s", "main_help_s", "config_error_s",
           "main_help_vs_jax")
  assert f["main_help_vs_jax"] == f["main_help_s"] / f["import_jax_s"]


@pytest.mark.slow
def test_scale_out_runs_both_layouts_and_compares_their_first_steps():
  f = quick("scale_out")
  assert (f["steps"], f["devices"], f["processes"]) == (2, 2, 2)
  positive(f, "1x2_step_s", "2x1_step_s", "1x2_wall_s", "2x1_wall_s")
  assert f["step_ratio"] == f["2x1_step_s"] / f["1x2_step_s"]
  assert 0 <= f["first_step_max_rel_diff"] < 1e-3  # the same samples, reduced in another order


@pytest.mark.slow
def test_reward_model_times_the_step_with_and_without_a_reward_model():
  f = quick("reward_model")
  assert f["steps"] == 3 and f["rm_scored"]
  positive(f, "verifier_step_s", "verifier+rm_step_s", "verifier_reward_s")
  assert f["step_ratio"] == f["verifier+rm_step_s"] / f["verifier_step_s"]


def test_arithmetic_by_size_reads_a_runs_workdir():
  f = quick("arithmetic_by_size")
  assert f["problems"] == 16 == sum(s["n"] for s in f["by_size"].values())
  assert all(0 <= s["accuracy"] <= 1 for s in f["by_size"].values())


@pytest.mark.slow
def test_async_replays_the_carried_program():
  """The carried engine's schedule replayed in numpy equals the real program's, rollout
  for rollout (the workload raises otherwise), and carrying rows takes fewer decode
  steps per trained token than draining every rollout, with no token older than allowed."""
  f = quick("async")
  sync, *carried = f["settings"]
  assert sync["staleness"] == 0 and sync["vs_sync"] == 1.0 and sync["staleness_max"] == 0
  assert [(s["staleness"], s["partial"]) for s in carried] == [
      (s, p) for p in ("recompute", "keep", "restart") for s in (1, 2, 4)]
  for s in carried:
    positive(s, "steps_per_token", "vs_sync", "occupancy")
    assert s["staleness_max"] <= (0 if s["partial"] == "restart" else s["staleness"])
  assert max(s["vs_sync"] for s in carried) > 1.5


@pytest.mark.slow
def test_async_end_to_end_trains_both_ways():
  f = quick("async", "--e2e", "--steps", "1")
  positive(f, "sync_tokens_per_s", "carried_tokens_per_s", "vs_sync")
  assert 0 <= f["carried_occupancy"] <= 1 and f["carried_staleness_mean"] >= 0


def test_tools_runs_the_same_rows_with_instant_slow_and_blocking_tools():
  """The workload raises unless the tools' latency leaves the rows' tokens as they are."""
  f = quick("tools")
  for run in ("plain", "instant", "latency", "blocking"):
    positive(f, f"{run}_s", f"{run}_steps", f"{run}_tokens_per_s")
    assert 0 < f[f"{run}_slot_use"] <= 1
  assert f["plain_calls"] == 0
  assert f["instant_calls"] == f["latency_calls"] == f["blocking_calls"] > 0


def test_device_script_parses():
  subprocess.run(["bash", "-n", os.path.join(BENCH, "device.sh")], check=True)


@pytest.mark.slow
def test_device_script_quick_leaves_the_records_and_the_table(tmp_path):
  """bench/device.sh --quick: the roofline and engine workloads at --quick on this CPU
  (their tests) and the table; the GSM8K repro (a training run, minutes here) is
  left out (REPRO=none)."""
  out = subprocess.run(["bash", "bench/device.sh", "--quick"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600,
                       env=dict(os.environ, OUT=str(tmp_path), REPRO="none"))
  assert out.returncode == 0, out.stderr[-3000:]
  roofline = json.loads((tmp_path / "roofline.json").read_text())
  assert roofline["command"] == "python bench/run.py roofline --quick --device cpu --remat --json"
  f = roofline["figures"]
  positive(f, "update_s", "update_mfu", "planned_peak_bytes", "matmul_peak_flops",
           "bandwidth_bytes_per_s")
  assert f["measured_peak_bytes"] is None  # a CPU keeps no allocator count
  (g,) = f["generate"]
  positive(g, "tok_s", "hbm_roofline", "floor_bytes_per_step")

  engine = json.loads((tmp_path / "engine.json").read_text())["figures"]
  (t,) = engine["by_T"]
  positive(t, "ragged_vs_full", "ragged_vs_generate", "full_vs_generate", "kv_bytes_vs_live")
  runs = t["runs"]
  assert set(runs) == {"engine ragged", "engine full", "generate ragged", "generate full"}
  assert runs["engine ragged"]["tokens"] < runs["engine full"]["tokens"] == 16 * 32
  for r in runs.values():
    positive(r, "tokens_per_s", "seconds", "steps", "kv_peak_bytes")
  assert np.isclose(t["ragged_vs_full"], runs["engine ragged"]["tokens_per_s"]
                    / runs["engine full"]["tokens_per_s"])

  table = (tmp_path / "table.md").read_text()
  assert "| update MFU (8 rows) |" in table and "| T=32 engine ragged / full |" in table
  assert "| gsm8k_nan_repro | skipped" in table
