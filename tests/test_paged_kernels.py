"""The paged attention kernels (pallas_tpu.paged_attention, pallas_gpu.paged_pool_attention):
through Pallas' interpreters on this CPU, each slot's softmax over exactly its own keys,
worked in numpy or by the XLA reference; pages not in a slot's list are never read (they
hold NaN); the keys each backend reads; the rollout engine over them gives the lockstep
sampler's greedy tokens; compiled for a v5e and an H100 by their own compilers where
those are installed."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models, ops, targets
from grpojax.ops import pallas_gpu, pallas_tpu, xla
from grpojax.sampling import engine, sampler, strategies

GPU_POOL = functools.partial(pallas_gpu.paged_pool_attention, interpret=True)
TPU = {"tpu": functools.partial(pallas_tpu.paged_attention, interpret=True),
       "tpu_3_pages_a_block": functools.partial(pallas_tpu.paged_attention, pages_per_block=3,
                                                interpret=True)}


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
def test_gpu_pool_kernel_is_each_slots_softmax_over_its_own_pages(dtype):
  S, K, m, H, M, p = 5, 2, 3, 16, 17, 16  # m = 3: padded to the kernel's query tile
  q, kp, vp, owner, full = _pool(7, S, K, m, H, M, p, dtype)
  got = [np.asarray(x) for x in GPU_POOL(q, kp, vp, *xla.page_lists(owner, full, S))]
  assert all(np.all(np.isfinite(x)) for x in got), "a page outside a slot's list was read"
  top, total, out = _expected(q, kp, vp, owner, full)
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(got[0], top, **tol)
  np.testing.assert_allclose(got[1], total, **tol)
  np.testing.assert_allclose(got[2], out, **tol)
  assert np.all(got[1][1] == 0) and np.all(got[2][1] == 0)  # slot 1: no pages


def _case(seed, dtype, S=6, K=2, m=3, H=16, M=17, p=16, B=3, g=2, P=20):
  """ops.paged_attention's arguments (q scaled): B prompts of P, left-padded; S slots,
  two idle, two of one group side by side; the pool as `_pool` makes it."""
  rng = np.random.default_rng(seed)
  q, kp, vp, owner, full = _pool(seed, S, K, m, H, M, p, dtype)
  slot_row = jnp.array([0, 1, -1, 5, -1, 2], jnp.int32)  # rows 0, 1: prompt 0; 5: 2; 2: 1
  owner = jnp.where(slot_row[jnp.maximum(owner, 0)] >= 0, owner, -1)  # idle slots own none
  full = full & (owner >= 0)
  kp, vp = (jnp.where(full[None, :, None, None], x, jnp.nan) for x in (kp, vp))
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  visible = np.arange(P)[None, :] >= np.array([[0], [7], [19]])
  prompt = (cast(rng.normal(size=(B, K, H, P))), cast(rng.normal(size=(B, K, P, H))),
            jnp.asarray(visible), g)
  position = rng.integers(0, p, S)
  own = (cast(rng.normal(size=(S, K, H, p))), cast(rng.normal(size=(S, K, H, p))),
         jnp.asarray(np.arange(p)[None, :] <= position[:, None]))
  return q, prompt, (kp, vp, owner, full), own, slot_row


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel", list(TPU))
def test_tpu_kernel_equals_the_xla_reference(kernel, dtype):
  q, prompt, pool, own, slot_row = _case(11, dtype)
  got = np.asarray(TPU[kernel](q, prompt, pool, own, slot_row))
  running = np.asarray(slot_row) >= 0
  assert np.all(np.isfinite(got[running])), "a page outside a slot's list was read"
  clean = (jnp.nan_to_num(pool[0]), jnp.nan_to_num(pool[1]), *pool[2:])
  want = np.asarray(xla.paged_attention(q, prompt, clean, own, slot_row))
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(got[running], want[running], **tol)


def test_gpu_path_merges_to_the_xla_reference(monkeypatch):
  """ops.paged_attention on "gpu": XLA's prompts and pages in progress merged with the
  pool kernel's equals the all-XLA op."""
  q, prompt, pool, own, slot_row = _case(5, jnp.float32)
  clean = (jnp.nan_to_num(pool[0]), jnp.nan_to_num(pool[1]), *pool[2:])
  S, K, m, H = q.shape
  want = ops.paged_attention(q.reshape(S, K * m, H), prompt, clean, own, slot_row, 1.0)
  monkeypatch.setattr(pallas_gpu, "paged_pool_attention", GPU_POOL)
  got = ops.paged_attention(q.reshape(S, K * m, H), prompt, pool, own, slot_row, 1.0,
                            kernels="gpu")
  running = np.asarray(slot_row) >= 0
  np.testing.assert_allclose(np.asarray(got)[running], np.asarray(want)[running], rtol=1e-5,
                             atol=1e-5)


def test_keys_read_by_backend():
  """ops.paged_keys_read, counted by hand: slots [row 0, row 1, idle, row 5, idle,
  row 2], g = 2 (prompts 0, 0, -, 2, -, 1), 7 full pages of 16, prompts of 20."""
  kw = dict(slot_row=jnp.array([0, 1, -1, 5, -1, 2]), group=2, full_pages=jnp.int32(7),
            prompt_length=20, num_prompts=3, page_size=16, num_pages=8)
  pages = 6 * 16 + 7 * 16  # every slot's page in progress, each full page once
  # TPU: a prompt each time the slots' prompt changes (idle slots repeat the last): 0, 2, 1.
  assert [int(x) for x in ops.paged_keys_read("tpu", 7, 64, **kw)] == [pages, 3 * 20]
  assert [int(x) for x in ops.paged_keys_read("gpu", 7, 64, **kw)] == [pages, 3 * 20]
  # XLA: pages in whole chunks of PAGED_CHUNK_TOKENS // 16 = 128 (capped at the pool's 8).
  assert [int(x) for x in ops.paged_keys_read("xla", 7, 64, **kw)] == [6 * 16 + 8 * 16, 3 * 20]
  assert ops.paged_keys_read("gpu", 7, 64, **dict(kw, page_size=12))[0] == 6 * 12 + 8 * 12


# TPU: pages of 8 (its interpreter is slow: a short run); GPU: 16, Triton's least tile.
@pytest.mark.parametrize("kernel,steps,page_size", [("tpu", 20, 8), ("gpu", 40, 16)])
def test_engine_over_a_kernel_gives_the_lockstep_greedy_tokens(monkeypatch, kernel, steps,
                                                                page_size):
  """The engine's decode with its attention through the kernel (interpreted): refilled
  slots, preemption and reused pages, greedy tokens and log-probs as the lockstep
  sampler's."""
  m = models.build_model("tiny", seed=0, head_dim=16, kernels="xla")  # Triton's least tile
  cfg, weights = m.config, m.param_dict()
  prompts = jnp.array([[0, 0, 5, 6, 7], [3, 4, 9, 5, 6]], jnp.int32)
  mask = (prompts > 0).astype(jnp.int32)
  kw = dict(rng=jax.random.key(0), num_samples=2, max_new_tokens=steps,
            sampling=strategies.SamplingParams(0.0), eos_ids=127, pad_id=0)
  want = sampler.generate_from_params(cfg, weights, prompts, mask, **kw)
  monkeypatch.setattr(ops, "paged_backend", lambda *a: kernel)
  monkeypatch.setattr(pallas_tpu, "paged_attention", TPU["tpu"])
  monkeypatch.setattr(pallas_gpu, "paged_pool_attention", GPU_POOL)
  jax.clear_caches()  # the engine's program is keyed by its static arguments, not the patch
  try:
    out, st = engine.generate(cfg, weights, prompts, mask, with_stats=True,
                              engine=engine.EngineConfig(slots=3, page_size=page_size,
                                                         pages=4), **kw)
  finally:
    jax.clear_caches()
  assert int(st.preempted) > 0  # 3 rows need 6 pages at token 2 * page_size
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(want.logps), atol=1e-5)


QWEN = dict(S=64, K=2, m=7, H=64, M=2048, p=128)  # Qwen2.5-0.5B's heads, the 4k pool


def _abstract(S, K, m, H, M, p, sharding=None):
  bf, i32 = jnp.bfloat16, jnp.int32
  shapes = [((S, K, m, H), bf), ((K, M, H, p), bf), ((K, M, H, p), bf), ((M,), i32),
            ((S,), i32), ((S,), i32)]
  return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]


@pytest.mark.skipif(not targets.available("tpu-v5e"), reason=targets.INSTALL)
@pytest.mark.parametrize("pages", [1024, 2048])  # 1024: a layer's pool (32 MiB) fits VMEM
def test_tpu_kernel_compiles_for_a_v5e_and_reads_the_pool_in_place(pages):
  S, K, m, H, p, B, P, g = 64, 2, 7, 64, 128, 8, 512, 8
  bf = jnp.bfloat16
  arg = jax.ShapeDtypeStruct

  def attend(q, pk, pv, pvis, kp, vp, owner, full, ok, ov, ovis, slot_row):
    return pallas_tpu.paged_attention(q, (pk, pv, pvis, g), (kp, vp, owner, full),
                                      (ok, ov, ovis), slot_row)

  compiled = targets.compile_pallas_tpu(
      attend, arg((S, K, m, H), bf), arg((B, K, H, P), bf), arg((B, K, P, H), bf),
      arg((B, P), bool), arg((K, pages, H, p), bf), arg((K, pages, H, p), bf),
      arg((pages,), jnp.int32), arg((pages,), bool), arg((S, K, H, p), bf),
      arg((S, K, H, p), bf), arg((S, p), bool), arg((S,), jnp.int32))
  # The pool stays in HBM: no copy of it (to VMEM or elsewhere), and the program's
  # temporaries are small beside a layer's pool.
  text = compiled.as_text()
  pool = f"bf16[{K},{pages},{H},{p}]"
  assert not [line for line in text.splitlines()
              if pool in line and re.search(r" copy(-start)?\(", line)]
  assert compiled.memory_analysis().temp_size_in_bytes < 2**22


@pytest.mark.skipif(not targets.available("h100-80gb"), reason=targets.CUDA_INSTALL)
def test_gpu_kernel_compiles_for_an_h100():
  device = targets.devices("h100-80gb")[0]
  args = _abstract(**QWEN, sharding=jax.sharding.SingleDeviceSharding(device))
  with jax.default_device(device):
    compiled = jax.jit(pallas_gpu.paged_pool_attention).lower(*args).compile()
  assert "grpojax_paged_pool_attention" in compiled.as_text()
  assert compiled.memory_analysis().temp_size_in_bytes < 2**20
