"""Compiling for a TPU or a GPU without one (grpojax.targets): the target's own counts.

The compile tests need libtpu or the CUDA plugin: `python -m grpojax.plan
--install-compilers` (as .ci/run does) puts both beside the venv, and the tests
skip without them. Expected figures are worked
by hand from the shapes.
"""

import pathlib

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from grpojax import targets
from grpojax.run.settings import read as read_settings


needs_libtpu = pytest.mark.skipif(not targets.available("tpu-v5e"),
                                  reason=f"no libtpu here: {targets.INSTALL}")
needs_cuda = pytest.mark.skipif(not targets.available("h100-80gb"),
                                reason=f"no CUDA plugin here: {targets.CUDA_INSTALL}")
MiB = 2**20


def abstract(shape, dtype, mesh, spec=()):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*spec)))


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e"])
def test_a_matmul_compiles_for_the_tpu_with_its_own_counts(target):
  devs = targets.devices(target)
  assert len(devs) == 1 and devs[0].platform == "tpu"
  mesh = jax.sharding.Mesh(np.array(devs), ("d",))
  x = abstract((4096, 4096), jnp.bfloat16, mesh)
  compiled = jax.jit(lambda a, b: jax.nn.relu(a @ b) + 1).lower(x, x).compile()
  mem = compiled.memory_analysis()
  assert mem.argument_size_in_bytes == 2 * 4096 * 4096 * 2  # two bf16 operands: 64 MiB
  assert mem.output_size_in_bytes == 4096 * 4096 * 2
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["flops"] == pytest.approx(2 * 4096**3, rel=1e-3)  # the dot; relu and +1 are noise
  assert cost["optimal_seconds"] > 0
  assert targets.kernels(compiled) == 1  # dot, relu and add: one fusion on the TPU


@needs_libtpu
def test_a_program_sharded_over_a_slice_compiles_per_chip():
  devs = targets.devices("tpu-v5e", chips=4)
  assert len(devs) == 4 and len({d.id for d in devs}) == 4
  mesh = jax.sharding.Mesh(np.array(devs), ("data",))
  x = abstract((4096, 4096), jnp.bfloat16, mesh, ("data", None))  # rows split 4 ways
  w = abstract((4096, 4096), jnp.bfloat16, mesh)  # replicated
  compiled = jax.jit(lambda a, b: a @ b).lower(x, w).compile()
  assert compiled.memory_analysis().argument_size_in_bytes == (4096 // 4 + 4096) * 4096 * 2


@pytest.mark.slow
@needs_libtpu
def test_a_pallas_tpu_kernel_compiles_without_a_tpu():
  from jax.experimental.pallas.ops.tpu import flash_attention as fa

  q = jax.ShapeDtypeStruct((1, 8, 1024, 128), jnp.bfloat16)
  compiled = targets.compile_pallas_tpu(
      lambda q, k, v: fa.flash_attention(q, k, v, causal=True), q, q, q)
  assert targets.mosaic_kernels(compiled) >= 1
  assert compiled.memory_analysis().argument_size_in_bytes == 3 * 8 * 1024 * 128 * 2
  with pytest.raises(ValueError, match="no Pallas"):
    targets.compile_pallas_tpu(jnp.sin, q)


def test_without_libtpu_the_error_says_how_to_get_it(monkeypatch):
  monkeypatch.setattr(targets, "available", lambda target="tpu-v5e": False)
  with pytest.raises(targets.TargetUnavailable, match=r"jax\[tpu\]"):
    targets.devices("tpu-v5e")


def test_bad_targets_and_slices_are_refused():
  assert not targets.available("b300")
  with pytest.raises(ValueError, match="unknown"):
    targets.devices("tpu-v9")
  with pytest.raises(ValueError, match="chips=3"):
    targets.devices("tpu-v5e", chips=3)


def _tiny_config():
  from grpojax import config as config_lib

  cfg = config_lib.get_config()
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = 2, 4
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = 16, 8
  cfg.eval.num_prompts, cfg.eval.batch_size = 4, 8
  cfg.sft.steps, cfg.sft.batch_size = 2, 8
  return cfg


@pytest.mark.slow
@needs_libtpu
def test_the_planner_compiles_for_the_tpu_itself():
  from grpojax import plan as plan_lib

  cfg = _tiny_config()
  # Planned at the config's choice rather than fitted: fit's search compiles the update
  # once more (its measure on a target's compiler is checked to the byte on the H100 below).
  cfg.train.memory_budget = 0
  result = plan_lib.plan(cfg, device="tpu-v5e")
  # The test session's 8 fake CPU devices plan a v5e slice of 8 chips.
  assert result["choices"]["backend"] == "tpu" and result["choices"]["devices"] == 8
  assert result["note"] is None and result["fits"] is True
  assert {"rollout", "update", "eval_greedy", "sft"} <= set(result["programs"])
  assert all(p["peak_bytes"] > 0 and not p.get("at_least") for p in result["programs"].values())


@needs_libtpu
def test_a_program_over_the_tpus_memory_is_a_lower_bound():
  from grpojax import plan as plan_lib

  mesh = jax.sharding.Mesh(np.array(targets.devices("tpu-v5e")), ("d",))
  x = abstract((2**17,), jnp.float32, mesh)
  # A running sum down the outer product's rows holds all of it: 64 GiB and more.
  big = jax.jit(lambda a: jnp.cumsum(jnp.outer(a, a), axis=0)[-1, :8])
  measured, _, compiled = plan_lib.measure(lambda: big.lower(x))
  assert compiled is None and measured["at_least"]
  assert measured["peak_bytes"] >= 64 * 2**30 * 0.99


@pytest.mark.slow
def test_without_libtpu_a_tpu_plan_says_its_figures_are_xla_cpus(monkeypatch):
  from grpojax import plan as plan_lib

  monkeypatch.setattr(targets, "available", lambda target="tpu-v5e": False)
  cfg = _tiny_config()
  # The note is the plan's whatever it compiles: the rollout and the update only, unfitted.
  cfg.eval.num_prompts, cfg.sft.steps, cfg.train.memory_budget = 0, 0, 0
  result = plan_lib.plan(cfg, device="tpu-v5e")
  assert set(result["programs"]) == {"rollout", "update"}
  assert result["choices"]["backend"] == "cpu"
  assert "compiler is not installed" in result["note"] and "jax[tpu]" in result["note"]
  assert "XLA:CPU" in result["note"]


@needs_cuda
@pytest.mark.parametrize("target", sorted(targets.GPUS))
def test_a_matmul_compiles_for_each_gpu_with_its_memory(target):
  devs = targets.devices(target, chips=2)
  assert [d.platform for d in devs] == ["gpu", "gpu"]
  assert devs[0].device_kind == targets.GPUS[target].name
  mesh = jax.sharding.Mesh(np.array(devs), ("d",))
  x = abstract((4096, 4096), jnp.bfloat16, mesh, ("d", None))  # rows split 2 ways
  w = abstract((4096, 4096), jnp.bfloat16, mesh)
  compiled = jax.jit(lambda a, b: jax.nn.relu(a @ b)).lower(x, w).compile()
  mem = compiled.memory_analysis()
  assert mem.argument_size_in_bytes == (4096 // 2 + 4096) * 4096 * 2
  assert mem.output_size_in_bytes == 4096 // 2 * 4096 * 2
  assert targets.read_program(compiled).matmul_flops == 2 * 2048 * 4096 * 4096  # per GPU


def _eight_layers(target):
  """A scan of 8 matmul layers of 1024², compiled for `target`."""
  mesh = jax.sharding.Mesh(np.array(targets.devices(target)), ("d",))
  ws = abstract((8, 1024, 1024), jnp.bfloat16, mesh)
  layers = lambda ws: jax.lax.scan(lambda c, w: (jnp.tanh(c @ w) * 2, None), ws[0], ws)[0]  # noqa: E731
  return jax.jit(layers).lower(ws).compile()


@needs_cuda
def test_loops_count_their_trips_in_kernels_and_flops():
  """A scan of 8 matmul layers: cost_analysis would count one layer; read_program all 8."""
  program = targets.read_program(_eight_layers("h100-80gb"))
  assert program.matmul_flops == 8 * 2 * 1024**3
  [(trips, per_trip)] = program.loops
  assert trips == 8 and per_trip >= 1
  assert program.kernels >= 8 * per_trip


@needs_libtpu
def test_a_tpu_loops_trips_come_from_its_bound():
  compiled = _eight_layers("tpu-v5e")
  program = targets.read_program(compiled)
  assert program.matmul_flops == 8 * 2 * 1024**3  # the TPU's dots are convolutions
  assert [trips for trips, _ in program.loops] == [8]
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["flops"] < 2 * 2 * 1024**3  # XLA's own count: one trip


@pytest.mark.slow
@needs_cuda
def test_the_planner_compiles_for_the_h100_itself_to_the_byte():
  """The tiny run planned for an H100 on this CPU: the update's bytes are the H100
  compiler's, to the byte. Its rollout runs tool turns (TRL's multiply tool): the host
  callbacks give way to a traceable stand-in (JAX lowers a callback only against a
  running backend of the target's platform)."""
  from grpojax import plan as plan_lib
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.train import step

  cfg = _tiny_config()
  cfg.eval.num_prompts, cfg.sft.steps = 0, 0  # the rollout and the update are what is compared
  cfg.rollout.tools = "test_tools:multiply"
  cfg.model.tokenizer = str(pathlib.Path(__file__).parent.parent / "experiments" / "data"
                            / "tool_tokenizer")
  # Planned at the config's choice rather than fitted (a search compiles the update
  # again per candidate; tests/test_plan.py covers the search).
  cfg.train.memory_budget = 0
  result = plan_lib.plan(cfg, device="h100-80gb")
  assert set(result["programs"]) == {"rollout", "update"}
  assert result["choices"]["backend"] == "gpu" and result["choices"]["devices"] == 8
  assert result["note"] is None and result["fits"] is True
  assert result["programs"]["rollout"]["peak_bytes"] > 0
  assert result["device_memory_bytes"] == targets.GPUS["h100-80gb"].memory_bytes
  # The update as the test builds it, on the H100's own devices: the same bytes.
  c = result["choices"]
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict(), devices=targets.devices("h100-80gb", 8))
  from grpojax.train import wiring

  run = read_settings(cfg)
  tok = wiring.run_tokenizer(run)
  model_cfg = wiring.model_config(run, tok).replace(kernels="xla", remat=c["remat"])
  weighed = plan_lib.update_bytes(run, model_cfg, mesh, micro_batches=c["micro_batches"])
  state = plan_lib.abstract_state(run, model_cfg, mesh)
  lowered = step.update.lower(
      state, plan_lib.abstract_rollout(run, mesh), jax.eval_shape(lambda: jax.random.key(0)),
      loss_config=run.loss, group_size=cfg.rollout.group_size,
      num_iterations=cfg.train.num_iterations, minibatches=cfg.train.minibatches,
      temperature=cfg.rollout.temperature or 1.0, grad_accum_steps=cfg.optim.grad_accum_steps,
      micro_batches=c["micro_batches"])
  # The program update_bytes compiled, when the lowering is the same text (it is: the
  # same arguments by hand); compiled anew otherwise. Its bytes are summed here.
  _, _, compiled = plan_lib.measure(lambda: lowered, mesh=mesh)
  mem = compiled.memory_analysis()
  direct = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
  # What fit weighs is the H100 compiler's count, to the byte.
  assert weighed == direct
  # The plan's update takes the rollout's outputs as laid out by the compiled rollout.
  assert result["programs"]["update"]["peak_bytes"] == pytest.approx(direct, rel=1e-3)


def test_without_the_cuda_plugin_a_gpu_plan_says_how_to_get_it(monkeypatch):
  monkeypatch.delenv("GRPOJAX_CUDA_PLUGIN", raising=False)
  monkeypatch.setattr(targets, "_cuda_plugin", lambda: None)
  assert not targets.available("h100-80gb")
  with pytest.raises(targets.TargetUnavailable, match="--install-compilers"):
    targets.devices("h100-80gb")
  with pytest.raises(ValueError, match="chips=9"):
    targets.devices("h100-80gb", chips=9)


@needs_cuda
def test_kernel_bytes_count_slices_and_in_place_updates_by_their_size():
  mesh = jax.sharding.Mesh(np.array(targets.devices("h100-80gb")), ("d",))
  cache = abstract((1024, 4096), jnp.float32, mesh)
  new = abstract((1, 4096), jnp.float32, mesh)
  i = abstract((), jnp.int32, mesh)
  write = jax.jit(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (i, 0)), donate_argnums=0)
  program = targets.read_program(write.lower(cache, new, i).compile())
  # In place: the row read and written, and the index; never the 16 MiB cache.
  assert program.kernels == 1
  assert program.kernel_bytes == 2 * 4096 * 4 + 4
  read = jax.jit(lambda c, i: jax.lax.dynamic_slice(c, (i, 0), (1, 4096)) * 2)
  program = targets.read_program(read.lower(cache, i).compile())
  assert program.kernel_bytes == 2 * 4096 * 4 + 4  # the row in, the row out


@needs_cuda
def test_the_heaviest_kernel_of_a_matmul_is_its_gemm():
  mesh = jax.sharding.Mesh(np.array(targets.devices("h100-80gb")), ("d",))
  x = abstract((4096, 4096), jnp.bfloat16, mesh)
  program = targets.read_program(jax.jit(lambda a, b: a @ b).lower(x, x).compile())
  (name, moved), = program.heaviest
  assert "gemm" in name and moved == program.kernel_bytes == 3 * 4096 * 4096 * 2


def test_kernel_bytes_charge_an_output_aliased_to_an_operand_once():
  """A kernel writing a buffer in place (the engine's pool): its aliased output is
  the operand's bytes, charged once, with the operand (read from HLO text alone)."""
  text = """HloModule m, entry_computation_layout={(f32[1024,4096]{1,0}, f32[4]{0})->(f32[4]{0}, f32[1024,4096]{1,0})}

ENTRY %main (p0: f32[1024,4096], p1: f32[4]) -> (f32[4], f32[1024,4096]) {
  %p0 = f32[1024,4096]{1,0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  ROOT %k = (f32[4]{0}, f32[1024,4096]{1,0}) custom-call(%p0, %p1), custom_call_target="kernel", output_to_operand_aliasing={{1}: (0, {})}, api_version=API_VERSION_TYPED_FFI
}
"""

  class Compiled:
    def as_text(self):
      return text

  program = targets.read_program(Compiled())
  assert program.kernels == 1
  assert program.kernel_bytes == 1024 * 4096 * 4 + 4 * 4 + 4 * 4  # operands, the small output
  unaliased = targets.read_program(type("C", (), {"as_text": lambda self: text.replace(
      ", output_to_operand_aliasing={{1}: (0, {})}", "")})())
  assert unaliased.kernel_bytes == program.kernel_bytes + 1024 * 4096 * 4


def test_install_compilers_puts_each_beside_the_venv_where_it_is_found(monkeypatch, tmp_path):
  """--install-compilers: pip, without dependencies, into compilers_dir()'s folders (pip
  itself faked here: it writes the library its package holds); the libraries are then
  found with no variable set, and a failed install says pip's last line."""
  import subprocess

  for key in ("TPU_LIBRARY_PATH", "GRPOJAX_CUDA_PLUGIN"):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setenv("GRPOJAX_COMPILERS", str(tmp_path))
  monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)  # no jax[...]
  assert not targets.available("tpu-v5e") and not targets.available("h100-80gb")
  calls, said = [], []

  def pip(argv, **kw):
    calls.append(argv)
    folder, requirement = argv[argv.index("--target") + 1], argv[-1]
    if requirement.startswith("jax-cuda12-pjrt"):
      return subprocess.CompletedProcess(argv, 1, "", "ERROR: No matching distribution\n")
    library = pathlib.Path(folder, "libtpu", "libtpu.so")
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    return subprocess.CompletedProcess(argv, 0, "", "")

  monkeypatch.setattr(subprocess, "run", pip)
  found = targets.install_compilers(say=said.append)
  packages = targets.compiler_packages()
  assert [c[c.index("--target") + 1:] for c in calls] == [
      [str(tmp_path / "tpu"), packages["tpu"]], [str(tmp_path / "cuda"), packages["cuda"]]]
  assert all("--no-deps" in c for c in calls)
  assert packages["cuda"] == f"jax-cuda12-pjrt=={jaxlib.__version__}"
  assert packages["tpu"].startswith("libtpu")
  assert found == {"tpu": str(tmp_path / "tpu" / "libtpu" / "libtpu.so"), "cuda": None}
  assert said[-1] == "cuda: not installed: ERROR: No matching distribution"
  assert targets.available("tpu-v5e") and not targets.available("h100-80gb")
  # Installed once: kept, pip not run again for it.
  calls.clear()
  targets.install_compilers(say=said.append)
  assert [c[-1] for c in calls] == [packages["cuda"]]
  assert said[-3].startswith("tpu: " + packages["tpu"] + " already in ")
  # The CUDA plugin found there too, and preferred to jax[cuda12]'s.
  plugin = tmp_path / "cuda" / "jax_plugins" / "xla_cuda12" / "xla_cuda_plugin.so"
  plugin.parent.mkdir(parents=True)
  plugin.write_bytes(b"")
  assert targets.available("h100-80gb") and targets._cuda_plugin() == str(plugin)


def test_the_compilers_folder_is_per_jaxlib_and_outside_the_venv(monkeypatch):
  import sys

  monkeypatch.delenv("GRPOJAX_COMPILERS", raising=False)
  folder = targets.compilers_dir()
  assert folder.endswith(f"jaxlib-{jaxlib.__version__}") and not folder.startswith(sys.prefix)
