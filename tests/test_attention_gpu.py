"""The GPU backend of ops.attention (grpojax.ops.pallas_gpu): its Pallas Triton
kernels run through Pallas' interpreter on this CPU and give the reference's
(ops.xla.blockwise_attention) outputs and gradients; and, where the CUDA PJRT
plugin is installed, they compile for an H100 through XLA's own GPU compiler,
in memory linear in the sequence."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import targets
from grpojax.ops import pallas_gpu, xla

needs_cuda = pytest.mark.skipif(not targets.available("h100-80gb"),
                                reason=f"no CUDA plugin here: {targets.CUDA_INSTALL}")


def _inputs(rng, B, T, P, Nq, K, H, dtype=jnp.float32):
  S = P + T
  q = jnp.asarray(rng.normal(size=(B, T, Nq, H)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), dtype) for _ in range(2))
  kv_valid = np.ones((B, S), bool)
  kv_valid[0, :5] = False  # a left-padded prompt
  kv_valid[-1, P + T // 2:] = False  # a completion that ended
  return q, k, v, jnp.asarray(kv_valid)


@pytest.mark.slow
@pytest.mark.parametrize("layout, P, T, Nq, K, H", [
    ("causal", 0, 37, 4, 2, 8),  # 37: two 16-tiles and a padded third; 2 query heads per kv head
    ("shared_prompt", 11, 21, 6, 2, 12),  # completions over their prompt's keys; H padded to 16
    ("one_kv_head_each", 0, 23, 2, 2, 16),
])
def test_outputs_and_gradients_equal_the_reference(layout, P, T, Nq, K, H):
  rng = np.random.default_rng(T)
  B, block = 2, 16  # the kernels' tiles capped at 16: several of them at these lengths
  q, k, v, kv_valid = _inputs(rng, B, T, P, Nq, K, H)
  scale = H**-0.5
  # Only valid positions' outputs matter to callers (the others are masked).
  w = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32) * kv_valid[:, P:, None, None]
  kernel = lambda q, k, v: pallas_gpu.attention(q, k, v, kv_valid, scale, block=block,  # noqa: E731
                                                interpret=True)
  reference = lambda q, k, v: xla.blockwise_attention(q, k, v, kv_valid, scale, block)  # noqa: E731

  @jax.jit
  def outputs_and_grads(q, k, v):
    def both(f):
      return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
    return both(kernel), both(reference)

  (out, grads), (want, want_grads) = outputs_and_grads(q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert bool(jnp.isfinite(out).all())  # invalid positions too
  valid_q = np.asarray(kv_valid[:, P:])
  np.testing.assert_allclose(out[valid_q], want[valid_q], atol=1e-5)
  for name, g, r in zip(("dq", "dk", "dv"), grads, want_grads):
    np.testing.assert_allclose(g, r, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_a_sharded_call_runs_each_shards_rows_and_heads():
  """Over a mesh (rows x kv heads) each device runs the kernels on its own rows
  and head groups (custom_partitioning): the reference's outputs and gradients."""
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "heads"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "heads"))
  rng = np.random.default_rng(1)
  P, T, H, block = 5, 27, 8, 16
  q, k, v, kv_valid = _inputs(rng, 2, T, P, 4, 2, H)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * kv_valid[:, P:, None, None]

  def outputs_and_grads(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v, kv_valid, H**-0.5, block) * w)  # noqa: E731
    return jax.jit(lambda *a: (f(*a, kv_valid, H**-0.5, block),
                               jax.grad(loss, argnums=(0, 1, 2))(*a)))

  kernel = lambda *a: pallas_gpu.attention(*a[:5], block=a[5], interpret=True)  # noqa: E731
  out, grads = outputs_and_grads(kernel)(*(jax.device_put(x, rows) for x in (q, k, v)))
  want, want_grads = outputs_and_grads(xla.blockwise_attention)(q, k, v)
  assert out.sharding.spec[:3] == ("data", None, "heads")
  np.testing.assert_allclose(out, want, atol=1e-5)
  for name, g, r in zip(("dq", "dk", "dv"), grads, want_grads):
    np.testing.assert_allclose(g, r, atol=1e-5, err_msg=name)


def test_bfloat16_outputs_follow_the_reference():
  rng = np.random.default_rng(0)
  P, T, H = 11, 21, 16
  q, k, v, kv_valid = _inputs(rng, 2, T, P, 4, 2, H, jnp.bfloat16)
  out = pallas_gpu.attention(q, k, v, kv_valid, H**-0.5, block=16, interpret=True)
  want = xla.blockwise_attention(q, k, v, kv_valid, H**-0.5, 16)
  assert out.dtype == jnp.bfloat16
  valid_q = np.asarray(kv_valid[:, P:])
  np.testing.assert_allclose(np.asarray(out[valid_q], np.float32),
                             np.asarray(want[valid_q], np.float32), atol=2e-2)


def _compile_for_h100(S, H, dtype, Nq=14, K=2):
  """Forward and backward of one attention layer, compiled for an H100."""
  device = targets.devices("h100-80gb", chips=1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  q = jax.ShapeDtypeStruct((1, S, Nq, H), dtype, sharding=sharding)
  kv = jax.ShapeDtypeStruct((1, S, K, H), dtype, sharding=sharding)
  valid = jax.ShapeDtypeStruct((1, S), jnp.bool_, sharding=sharding)

  def loss(q, k, v, kv_valid):
    out = pallas_gpu.attention(q, k, v, kv_valid, H**-0.5, block=1024)
    return jnp.sum(out.astype(jnp.float32))

  # jax 0.11's Pallas Triton lowering reads the GPU it targets from the default
  # device (0.10 assumed compute capability 9.0), as it lowers and as a
  # partitioned call's shards lower while XLA compiles: the H100, for both.
  with jax.default_device(device), targets.quiet_stderr():
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile()


def _triton_kernels(compiled) -> set[str]:
  """Names of the Pallas Triton kernels the compiled program launches."""
  return {name for line in compiled.as_text().splitlines()
          if re.search(r"custom-call\(.*custom_call_target=\"(__gpu\$xla\.gpu\.triton|"
                       r"triton_kernel_call_ffi)\"", line)
          for name in re.findall(r"grpojax_attention_\w+", line)}


@needs_cuda
@pytest.mark.parametrize("H, dtype", [(64, jnp.bfloat16), (128, jnp.float32)])
def test_the_kernels_compile_for_the_h100_in_linear_memory(H, dtype):
  S = 4096
  compiled = _compile_for_h100(S, H, dtype)
  assert _triton_kernels(compiled) == {"grpojax_attention_forward", "grpojax_attention_dq",
                                       "grpojax_attention_dkv"}
  temp = compiled.memory_analysis().temp_size_in_bytes
  scores = 14 * S * S * 4  # [Nq, S, S] float32: 896 MiB
  q_bytes = S * 14 * H * jnp.dtype(dtype).itemsize
  # What is held: about one [S, Nq, H] array (the output's cotangent as the
  # kernels take it) and [Nq, S] softmax statistics: 7.5 MiB at bf16, H=64.
  assert temp < scores / 16
  assert temp < 2 * q_bytes
