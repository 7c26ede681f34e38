"""Compiling for a TPU without one (grpojax.targets): the target's own counts.

The compile tests need libtpu ($TPU_LIBRARY_PATH or the `libtpu` package;
.ci/run installs it beside the venv) and skip without it. Expected figures are
worked by hand from the shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import targets

needs_libtpu = pytest.mark.skipif(not targets.available("tpu-v5e"),
                                  reason=f"no libtpu here: {targets.INSTALL}")
MiB = 2**20


def abstract(shape, dtype, mesh, spec=()):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*spec)))


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
  assert not targets.available("h100-80gb")
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


@needs_libtpu
def test_the_planner_compiles_for_the_tpu_itself():
  from grpojax import plan as plan_lib

  result = plan_lib.plan(_tiny_config(), device="tpu-v5e")
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
  measured, _, compiled = plan_lib._measure(lambda: big.lower(x))  # noqa: SLF001
  assert compiled is None and measured["at_least"]
  assert measured["peak_bytes"] >= 64 * 2**30 * 0.99


def test_without_libtpu_a_tpu_plan_says_its_figures_are_xla_cpus(monkeypatch):
  from grpojax import plan as plan_lib

  monkeypatch.setattr(targets, "available", lambda target="tpu-v5e": False)
  result = plan_lib.plan(_tiny_config(), device="tpu-v5e")
  assert result["choices"]["backend"] == "cpu"
  assert "libtpu) is not installed" in result["note"] and "jax[tpu]" in result["note"]
