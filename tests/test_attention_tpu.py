"""The TPU backend of grpojax.ops.attention (ops/pallas_tpu.py, splash attention):
through Pallas' interpreter on this CPU, the reference's outputs and gradients at
valid positions; compiled for a v5e by its own compiler (libtpu), a Mosaic kernel
whose forward and backward hold nothing of [S, S]."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import targets
from grpojax.ops import pallas_tpu, xla


def _case(B, T, P, Nq, K, H, seed):
  rng = np.random.default_rng(seed)
  S = P + T
  q = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32)
  return q, k, v, w


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # T == S == 200 (not a multiple of 128) in blocks of 128: a 2 x 2 grid, one
    # block skipped; row 0 left-padded, row 1's completion ended at 150. Under a
    # mesh of 2 x 2 CPU devices: each runs one row and one kv head's 2 query heads.
    {"T": 200, "P": 0, "block": 128, "pad": 5, "end": 150, "mesh": True},
    # Completions of 100 over a prompt of 156 (S = 256): queries in a block of
    # 128, keys in one of 256; row 1 all valid, so the padded queries see no key.
    {"T": 100, "P": 156, "block": 1024, "pad": 40, "end": None, "mesh": False},
], ids=["causal_sharded", "shared_prompt"])
def test_values_and_gradients_equal_the_reference(layout):
  T, P, block = layout["T"], layout["P"], layout["block"]
  B, Nq, K, H = 2, 4, 2, 64  # grouped-query: 2 query heads per kv head
  q, k, v, w = _case(B, T, P, Nq, K, H, seed=T)
  S = P + T
  kv_valid = np.ones((B, S), bool)
  kv_valid[0, :layout["pad"]] = False
  if layout["end"] is not None:
    kv_valid[1, layout["end"]:] = False
  kv_valid = jnp.asarray(kv_valid)
  q_valid = kv_valid[:, P:, None, None]
  w = w * q_valid  # gradients from valid positions only
  scale = H**-0.5

  @jax.jit
  def tpu(q, k, v):  # outputs, and the gradients of sum(outputs * w): one compile
    out, pullback = jax.vjp(lambda *a: pallas_tpu.attention(*a, kv_valid, scale, block=block,
                                                            interpret=True), q, k, v)
    return out, pullback(w)

  @jax.jit
  def ref(q, k, v):
    out, pullback = jax.vjp(lambda *a: xla.blockwise_attention(*a, kv_valid, scale, 64), q, k, v)
    return out, pullback(w)

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
  with jax.set_mesh(mesh) if layout["mesh"] else contextlib.nullcontext():
    out, grads = tpu(q, k, v)
  if layout["mesh"]:  # run by shard_map: each device its row and kv head
    assert out.sharding.spec[:3] == grads[1].sharding.spec[:3] == ("data", None, "tensor")
  want, want_grads = ref(q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out * q_valid, want * q_valid, atol=1e-5)
  for g, r, name in zip(grads, want_grads, ("dq", "dk", "dv")):
    assert np.isfinite(np.asarray(g)).all(), name
    np.testing.assert_allclose(g, r, atol=1e-5, err_msg=name)


def test_block_sizes_are_lane_multiples_that_pad_little():
  assert pallas_tpu.block_size(4096, 1024) == 512  # capped at 512
  assert pallas_tpu.block_size(4096, 256) == 256  # the hint, rounded to 128
  assert pallas_tpu.block_size(200, 1024) == 256  # one block of the 128-rounded length
  assert pallas_tpu.block_size(1100, 1024) == 384  # 1152: 512 would pad to 1536
  assert pallas_tpu.block_size(1408, 1024) == 512  # 1536 pads by 128 <= 1408 / 8
  assert pallas_tpu.block_size(5, 64) == 128
  assert all(pallas_tpu.block_size(n, 1024) % 128 == 0 for n in range(1, 3000, 37))


needs_libtpu = pytest.mark.skipif(not targets.available("tpu-v5e"),
                                  reason=f"no libtpu here: {targets.INSTALL}")


@pytest.mark.slow
@needs_libtpu
def test_forward_and_backward_compile_for_a_v5e_in_linear_memory():
  """Qwen2.5-0.5B's attention (14 query heads over 2 kv heads, H = 64) at S = 4096,
  bf16: a Mosaic kernel, temporaries far below the [S, S] scores."""
  B, S, Nq, K, H = 1, 4096, 14, 2, 64
  bf16 = jnp.bfloat16

  def loss(q, k, v, kv_valid):
    out = pallas_tpu.attention(q, k, v, kv_valid, H**-0.5, block=1024)
    return jnp.sum(out.astype(jnp.float32))

  fn = jax.grad(loss, argnums=(0, 1, 2))
  args = (jax.ShapeDtypeStruct((B, S, Nq, H), bf16), jax.ShapeDtypeStruct((B, S, K, H), bf16),
          jax.ShapeDtypeStruct((B, S, K, H), bf16), jax.ShapeDtypeStruct((B, S), jnp.bool_))
  with targets.quiet_stderr():
    compiled = targets.compile_pallas_tpu(fn, *args, target="tpu-v5e")
  assert targets.mosaic_kernels(compiled) >= 3  # forward, dK/dV, dQ
  scores = B * Nq * S * S * 4
  assert compiled.memory_analysis().temp_size_in_bytes < scores / 4


@needs_libtpu
def test_under_a_mesh_each_v5e_chip_runs_the_kernel_on_its_rows():
  """XLA cannot partition a Mosaic kernel: under jax.set_mesh the rows (and kv
  heads) are split by shard_map, with no collective in forward or backward."""
  mesh = jax.sharding.Mesh(np.array(targets.devices("tpu-v5e", chips=4)).reshape(2, 1, 2),
                           ("data", "fsdp", "tensor"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  B, S, Nq, K, H = 4, 512, 14, 2, 64
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for shape, dtype in
          (((B, S, Nq, H), jnp.bfloat16), ((B, S, K, H), jnp.bfloat16),
           ((B, S, K, H), jnp.bfloat16), ((B, S), jnp.bool_))]
  loss = lambda q, k, v, m: jnp.sum(  # noqa: E731
      pallas_tpu.attention(q, k, v, m, H**-0.5, block=1024).astype(jnp.float32))
  with targets.quiet_stderr(), jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  assert targets.mosaic_kernels(compiled) >= 3
  text = compiled.as_text()
  assert not any(f" {op}(" in text for op in ("all-gather", "all-reduce", "all-to-all"))
