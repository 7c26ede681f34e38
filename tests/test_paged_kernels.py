"""The paged pool kernels (paged_pool_attention in ops/pallas_tpu.py and ops/pallas_gpu.py):
through Pallas' interpreters on this CPU, each slot's softmax over exactly its own full
pages, worked in numpy; pages not in its list are never read (they hold NaN); the
rollout engine over them gives the XLA engine's greedy tokens; compiled for a v5e and
an H100 by their own compilers where those are installed."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models, ops, targets
from grpojax.ops import pallas_gpu, pallas_tpu, xla
from grpojax.sampling import engine, sampler, strategies

KERNELS = {
    "tpu": functools.partial(pallas_tpu.paged_pool_attention, interpret=True),
    "tpu_3_pages_a_block": functools.partial(pallas_tpu.paged_pool_attention, pages_per_block=3,
                                             interpret=True),
    "gpu": functools.partial(pallas_gpu.paged_pool_attention, interpret=True),
}


def _pool(seed, S, K, m, H, M, p, dtype):
  """A pool where slots own 0 to 5 full pages in shuffled order, some pages are free
  and some are owned but not full; every page outside the slots' lists is NaN."""
  rng = np.random.default_rng(seed)
  owner = rng.integers(-1, S, M).astype(np.int32)
  owner[owner == 1] = -1  # slot 1 has no page: an empty softmax
  full = (owner >= 0) & (rng.random(M) < 0.8)
  kp = rng.normal(size=(K, M, H, p)).astype(np.float32)
  vp = rng.normal(size=(K, M, H, p)).astype(np.float32)
  kp[:, ~full], vp[:, ~full] = np.nan, np.nan
  q = rng.normal(size=(S, K, m, H)) * H**-0.5
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  return cast(q), cast(kp), cast(vp), jnp.asarray(owner), jnp.asarray(full)


def _expected(q, kp, vp, owner, full):
  """(top, total, out) per slot from its full pages in numpy, float64."""
  q, kp, vp = (np.asarray(x, np.float64) for x in (q, kp, vp))
  S, K, m, H = q.shape
  top, total = np.full((S, K, m), xla.MASKED), np.zeros((S, K, m))
  out = np.zeros((S, K, m, H))
  for s in range(S):
    pages = np.flatnonzero((np.asarray(owner) == s) & np.asarray(full))
    if not len(pages):
      continue
    keys = np.concatenate([kp[:, i] for i in pages], axis=-1)  # [K, H, n p]
    values = np.concatenate([vp[:, i] for i in pages], axis=-1)
    scores = np.einsum("kqh,khn->kqn", q[s], keys)
    top[s] = scores.max(-1)
    e = np.exp(scores - top[s][..., None])
    total[s], out[s] = e.sum(-1), np.einsum("kqn,khn->kqh", e, values)
  return top, total, out


def test_page_lists_group_each_slots_full_pages():
  owner = jnp.array([2, -1, 0, 2, 0, 1, 2], jnp.int32)
  full = jnp.array([1, 1, 1, 0, 1, 1, 1], bool)
  order, start, count = (np.asarray(x) for x in xla.page_lists(owner, full, slots=4))
  np.testing.assert_array_equal(count, [2, 1, 2, 0])
  np.testing.assert_array_equal(start, [0, 2, 3, 5])
  for s in range(4):
    assert sorted(order[start[s]:start[s] + count[s]]) == [
        i for i in range(7) if owner[i] == s and full[i]]
  assert sorted(order) == list(range(7))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_is_each_slots_softmax_over_its_own_pages(kernel, dtype):
  S, K, m, H, M, p = 5, 2, 3, 16, 17, 16  # m = 3: padded to the kernels' query tile
  q, kp, vp, owner, full = _pool(7, S, K, m, H, M, p, dtype)
  order, start, count = xla.page_lists(owner, full, S)
  got = [np.asarray(x) for x in KERNELS[kernel](q, kp, vp, order, start, count)]
  assert all(np.all(np.isfinite(x)) for x in got), "a page outside a slot's list was read"
  top, total, out = _expected(q, kp, vp, owner, full)
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(got[0], top, **tol)
  np.testing.assert_allclose(got[1], total, **tol)
  np.testing.assert_allclose(got[2], out, **tol)
  assert np.all(got[1][1] == 0) and np.all(got[2][1] == 0)  # slot 1: no pages


def test_kernels_merge_to_the_xla_reference():
  """ops.paged_attention's kernel path: the XLA part merged with a kernel's equals the
  all-XLA op (the pool's chunks through xla.paged_pool)."""
  S, K, m, H, M, p = 4, 2, 3, 16, 9, 16
  q, kp, vp, owner, full = _pool(3, S, K, m, H, M, p, jnp.float32)
  kp, vp = jnp.nan_to_num(kp), jnp.nan_to_num(vp)  # the XLA chunks multiply dropped pages by 0
  acc = (jnp.zeros((S, K, m)), jnp.ones((S, K, m)), jnp.ones((S, K, m, H)))  # one other key
  want = xla.paged_finish(xla.paged_pool(q, (kp, vp, owner, full), acc))
  for name, kernel in KERNELS.items():
    got = xla.paged_finish(xla.paged_merge(acc, kernel(q, kp, vp,
                                                       *xla.page_lists(owner, full, S))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=name)


def test_paged_pool_kernel_by_backend():
  assert ops.paged_pool_kernel("xla", 7, 64, 128) is None
  assert ops.paged_pool_kernel("tpu", 7, 64, 128) is pallas_tpu.paged_pool_attention
  assert ops.paged_pool_kernel("gpu", 7, 64, 128) is pallas_gpu.paged_pool_attention
  assert ops.paged_pool_kernel("gpu", 7, 64, 100) is None  # Triton tiles: powers of two
  with pytest.raises(ValueError, match="powers of two"):
    pallas_gpu.paged_pool_attention(jnp.zeros((2, 1, 3, 16)), jnp.zeros((1, 2, 16, 12)),
                                    jnp.zeros((1, 2, 16, 12)), *[jnp.zeros(2, jnp.int32)] * 3)


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_engine_over_a_kernel_gives_the_xla_engines_greedy_tokens(monkeypatch, kernel):
  """The engine's decode with the pool read by the kernel: refilled slots, preemption
  and reused pages, greedy tokens and log-probs as the lockstep sampler's."""
  m = models.build_model("tiny", seed=0, head_dim=16, kernels="xla")  # Triton's least tile
  cfg, weights = m.config, m.param_dict()
  prompts = jnp.array([[0, 0, 5, 6, 7], [3, 4, 9, 5, 6]], jnp.int32)
  mask = (prompts > 0).astype(jnp.int32)
  kw = dict(rng=jax.random.key(0), num_samples=2, max_new_tokens=40,
            sampling=strategies.SamplingParams(0.0), eos_ids=127, pad_id=0)
  want = sampler.generate_from_params(cfg, weights, prompts, mask, **kw)
  monkeypatch.setattr(ops, "paged_pool_kernel", lambda *a: KERNELS[kernel])
  jax.clear_caches()  # the engine's program is keyed by its static arguments, not the patch
  try:
    out, st = engine.generate(cfg, weights, prompts, mask, with_stats=True,
                              engine=engine.EngineConfig(slots=3, page_size=16, pages=4), **kw)
  finally:
    jax.clear_caches()
  assert int(st.preempted) > 0  # 3 rows need 6 pages at token 32
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(want.logps), atol=1e-5)


QWEN = dict(S=64, K=2, m=7, H=64, M=2048, p=128)  # Qwen2.5-0.5B's heads, the 4k pool


def _abstract(S, K, m, H, M, p, sharding=None):
  bf, i32 = jnp.bfloat16, jnp.int32
  shapes = [((S, K, m, H), bf), ((K, M, H, p), bf), ((K, M, H, p), bf), ((M,), i32),
            ((S,), i32), ((S,), i32)]
  return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]


@pytest.mark.skipif(not targets.available("tpu-v5e"), reason=targets.INSTALL)
def test_tpu_kernel_compiles_for_a_v5e():
  compiled = targets.compile_pallas_tpu(pallas_tpu.paged_pool_attention, *_abstract(**QWEN))
  # The pool stays in HBM: the program's temporaries are the kernel's small outputs,
  # not a copy of the 128 MiB pool.
  assert compiled.memory_analysis().temp_size_in_bytes < 2**20


@pytest.mark.skipif(not targets.available("h100-80gb"), reason=targets.CUDA_INSTALL)
def test_gpu_kernel_compiles_for_an_h100():
  device = targets.devices("h100-80gb")[0]
  args = _abstract(**QWEN, sharding=jax.sharding.SingleDeviceSharding(device))
  with jax.default_device(device):
    compiled = jax.jit(pallas_gpu.paged_pool_attention).lower(*args).compile()
  assert "grpojax_paged_pool_attention" in compiled.as_text()
  assert compiled.memory_analysis().temp_size_in_bytes < 2**20
