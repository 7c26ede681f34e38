"""The paged attention kernels (pallas_tpu.paged_attention, pallas_gpu.paged_pool_attention):
through Pallas' interpreters on this CPU, each slot's softmax over exactly its own keys,
worked in numpy or by the XLA reference; pages not in a slot's list are never read (they
hold NaN); the keys each backend reads; the rollout engine over them gives the lockstep
sampler's greedy tokens; compiled for a v5e and an H100 by their own compilers where
those are installed."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models, ops, targets
from grpojax.ops import pallas_gpu, pallas_tpu, xla
from grpojax.sampling import engine, sampler, strategies

KERNELS = {
    "tpu": functools.partial(pallas_tpu.paged_attention, interpret=True),
    "tpu_3_pages_a_block": functools.partial(pallas_tpu.paged_attention, pages_per_block=3,
                                             interpret=True),
    "gpu": functools.partial(pallas_gpu.paged_attention, interpret=True),
}


def _case(seed, dtype, S=6, K=2, m=3, H=16, M=17, p=16, B=3, g=2, P=128):
  """ops.paged_attention's arguments (q scaled): B prompts of P, left-padded; S slots,
  two idle and two of one group side by side; slots own 0 to 5 full pages in shuffled
  order, some pages are free and some owned but not full; every page outside the
  slots' lists is NaN. m = 3 query heads: padded to the kernels' query tile."""
  rng = np.random.default_rng(seed)
  slot_row = np.array([0, 1, -1, 5, -1, 2], np.int32)  # rows 0, 1: prompt 0; 5: 2; 2: 1
  owner = rng.integers(-1, S, M).astype(np.int32)
  owner[(owner >= 0) & (slot_row[np.maximum(owner, 0)] < 0)] = -1  # idle slots own none
  owner[owner == 1] = -1  # slot 1 has no full page
  full = (owner >= 0) & (rng.random(M) < 0.8)
  kp = rng.normal(size=(K, M, H, p))
  vp = rng.normal(size=(K, M, H, p))
  kp[:, ~full], vp[:, ~full] = np.nan, np.nan
  visible = np.arange(P)[None, :] >= np.array([[0], [7], [P - 1]])
  position = rng.integers(0, p, S)
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  q = cast(rng.normal(size=(S, K, m, H)) * H**-0.5)
  prompt = (cast(rng.normal(size=(B, K, H, P))), cast(rng.normal(size=(B, K, P, H))),
            jnp.asarray(visible), g)
  own = (cast(rng.normal(size=(S, K, H, p))), cast(rng.normal(size=(S, K, H, p))),
         jnp.asarray(np.arange(p)[None, :] <= position[:, None]))
  pool = (cast(kp), cast(vp), jnp.asarray(owner), jnp.asarray(full))
  return q, prompt, pool, own, jnp.asarray(slot_row)


def _expected(q, prompt, pool, own, slot_row):
  """[S, K, m, H] in numpy, float64: each running slot's softmax over its prompt's
  visible keys, its page in progress up to its position and its full pages."""
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
  q, pk, pv, kp, vp, ok, ov = map(f64, (q, prompt[0], prompt[1], pool[0], pool[1], own[0], own[1]))
  p_visible, g = np.asarray(prompt[2]), prompt[3]
  owner, full, o_visible = np.asarray(pool[2]), np.asarray(pool[3]), np.asarray(own[2])
  out = np.full(q.shape, np.nan)
  for s, r in enumerate(np.asarray(slot_row)):
    if r < 0:
      continue
    b = r // g
    pages = np.flatnonzero((owner == s) & full)
    keys = np.concatenate([pk[b][..., p_visible[b]], ok[s][..., o_visible[s]],
                           *[kp[:, i] for i in pages]], axis=-1)  # [K, H, n]
    values = np.concatenate([pv[b][:, p_visible[b]].transpose(0, 2, 1), ov[s][..., o_visible[s]],
                             *[vp[:, i] for i in pages]], axis=-1)
    scores = np.einsum("kqh,khn->kqn", q[s], keys)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out[s] = np.einsum("kqn,khn->kqh", w / w.sum(-1, keepdims=True), values)
  return out


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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel", [*KERNELS, "xla"])
def test_each_slots_softmax_over_its_own_keys(kernel, dtype):
  """Against numpy; pages outside a slot's list hold NaN (XLA's chunks take only the
  full pages, the kernels only the listed ones)."""
  q, prompt, pool, own, slot_row = _case(11, dtype)
  impl = KERNELS.get(kernel, xla.paged_attention)
  got = np.asarray(impl(q, prompt, pool, own, slot_row))
  running = np.asarray(slot_row) >= 0
  assert np.all(np.isfinite(got[running])), "a page outside a slot's list was read"
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(got[running], _expected(q, prompt, pool, own, slot_row)[running],
                             **tol)


def test_keys_read_by_backend():
  """ops.paged_keys_read, counted by hand: slots [row 0, row 1, idle, row 5, idle,
  row 2], g = 2 (prompts 0, 0, -, 2, -, 1), 7 full pages of 16, prompts of 20."""
  kw = dict(slot_row=jnp.array([0, 1, -1, 5, -1, 2]),
            slot_position=jnp.array([3, 40, 9, 70, 0, 129]), group=2, full_pages=jnp.int32(7),
            prompt_length=20, num_prompts=3, page_size=16, num_pages=8)
  # TPU (pages of 128): a prompt each time the slots' prompt changes (idle slots repeat
  # the last): 0, 2, 1. Pages of 16 go through XLA there.
  assert [int(x) for x in ops.paged_keys_read("tpu", 7, 64, **dict(kw, page_size=128))] == [
      6 * 128 + 7 * 128, 3 * 20]
  assert ops.paged_backend("tpu", 7, 64, 16) == "xla"
  # GPU: each running slot its row's prompt, and of its page in progress the tokens
  # through the fed one in chunks of 16: pages of 64, offsets 3, 40, 6, 1 -> 16, 48, 16, 16.
  assert [int(x) for x in ops.paged_keys_read("gpu", 7, 64, **dict(kw, page_size=64))] == [
      96 + 7 * 64, 4 * 20]
  # XLA: pages in whole chunks of PAGED_CHUNK_TOKENS // 16 = 128 (capped at the pool's 8).
  assert [int(x) for x in ops.paged_keys_read("xla", 7, 64, **kw)] == [6 * 16 + 8 * 16, 3 * 20]
  assert ops.paged_keys_read("gpu", 7, 64, **dict(kw, page_size=12))[0] == 6 * 12 + 8 * 12


# TPU: pages of 8 (its interpreter is slow: a short run); GPU: 16, Triton's least tile.
# Either way the 3 slots need 6 pages of the 4 at token page_size: preemption.
@pytest.mark.slow
@pytest.mark.parametrize("kernel,steps,page_size", [("tpu", 12, 8), ("gpu", 20, 16)])
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
  monkeypatch.setattr(pallas_tpu, "paged_attention", KERNELS["tpu"])
  monkeypatch.setattr(pallas_gpu, "paged_attention", KERNELS["gpu"])
  jax.clear_caches()  # the engine's program is keyed by its static arguments, not the patch
  try:
    out, st = engine.generate(cfg, weights, prompts, mask, with_stats=True,
                              engine=engine.EngineConfig(slots=3, page_size=page_size,
                                                         pages=4), **kw)
  finally:
    jax.clear_caches()
  assert int(st.preempted) > 0
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(want.logps), atol=1e-5)


def _qwen(pages, sharding=None):
  """(attend, its abstract arguments) at Qwen2.5-0.5B's heads (K = 2, m = 7, H = 64):
  64 slots, 8 prompts of 512, a pool of `pages` pages of 128 in bf16."""
  S, K, m, H, p, B, P, g = 64, 2, 7, 64, 128, 8, 512, 8
  bf, i32 = jnp.bfloat16, jnp.int32
  shapes = [((S, K, m, H), bf), ((B, K, H, P), bf), ((B, K, P, H), bf), ((B, P), bool),
            ((K, pages, H, p), bf), ((K, pages, H, p), bf), ((pages,), i32), ((pages,), bool),
            ((S, K, H, p), bf), ((S, K, H, p), bf), ((S, p), bool), ((S,), i32)]

  def attend(kernel, q, pk, pv, pvis, kp, vp, owner, full, ok, ov, ovis, slot_row):
    return kernel(q, (pk, pv, pvis, g), (kp, vp, owner, full), (ok, ov, ovis), slot_row)

  return attend, [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]


@pytest.mark.skipif(not targets.available("tpu-v5e"), reason=targets.INSTALL)
@pytest.mark.parametrize("pages", [1024, 2048])  # 1024: a layer's pool (32 MiB) fits VMEM
def test_tpu_kernel_compiles_for_a_v5e_and_reads_the_pool_in_place(pages):
  attend, args = _qwen(pages)
  compiled = targets.compile_pallas_tpu(
      functools.partial(attend, pallas_tpu.paged_attention), *args)
  # The pool stays in HBM: no copy of it (to VMEM or elsewhere), and the program's
  # temporaries are small beside a layer's pool.
  pool = f"bf16[2,{pages},64,128]"
  assert not [line for line in compiled.as_text().splitlines()
              if pool in line and re.search(r" copy(-start)?\(", line)]
  assert compiled.memory_analysis().temp_size_in_bytes < 2**22


@pytest.mark.skipif(not targets.available("h100-80gb"), reason=targets.CUDA_INSTALL)
def test_gpu_kernel_compiles_for_an_h100():
  device = targets.devices("h100-80gb")[0]
  attend, args = _qwen(2048, sharding=jax.sharding.SingleDeviceSharding(device))
  with jax.default_device(device):
    compiled = jax.jit(functools.partial(attend, pallas_gpu.paged_attention)).lower(
        *args).compile()
  assert "grpojax_paged_attention" in compiled.as_text()
  pool = "bf16[2,2048,64,128]"
  assert not [line for line in compiled.as_text().splitlines()
              if pool in line and re.search(r" copy(-start)?\(", line)]
  assert compiled.memory_analysis().temp_size_in_bytes < 2**22


@pytest.mark.skipif(not targets.available("h100-80gb"), reason=targets.CUDA_INSTALL)
def test_gpu_kernel_writes_the_step_in_place_on_an_h100():
  """ops.paged_decode_attention on "gpu", donated as the engine's step donates its
  cache: one kernel, the pools and pages in progress written where they are (aliased,
  no copy), no scatter left."""
  device = targets.devices("h100-80gb")[0]
  _, args = _qwen(2048, sharding=jax.sharding.SingleDeviceSharding(device))
  q, pk, pv, pvis, kp, vp, owner, full, ok, ov, ovis, slot_row = args
  S, K, m, H = q.shape
  vec = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=q.sharding)  # noqa: E731

  def step(q, new_k, new_v, offset, flush, kp, vp, ok, ov, pk, pv, pvis, owner, full, ovis, rows):
    out, own, pool = ops.paged_decode_attention(
        q, (new_k, new_v), offset, flush, (pk, pv, pvis, 8), (kp, vp, owner, full),
        (ok, ov, ovis), rows, 1.0, "gpu")
    return out, own, pool

  with jax.default_device(device):
    compiled = jax.jit(step, donate_argnums=(5, 6, 7, 8)).lower(
        vec(S, K * m, H, dtype=jnp.bfloat16), vec(S, K, H, dtype=jnp.bfloat16),
        vec(S, K, H, dtype=jnp.bfloat16), vec(S), vec(S), kp, vp, ok, ov, pk, pv, pvis, owner,
        full, ovis, slot_row).compile()
  text = compiled.as_text()
  assert "grpojax_paged_attention" in text
  buffers = ("[2,2048,64,128]", f"[{S},{K},{H},128]")  # the pools, the pages in progress
  assert not [line for line in text.splitlines() if any(b in line for b in buffers)
              and re.search(r" (copy|copy-start|scatter|fusion)\(", line)]
  pools = 2 * math.prod(kp.shape) * 2
  assert compiled.memory_analysis().alias_size_in_bytes >= pools
  assert compiled.memory_analysis().temp_size_in_bytes < 2**22


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gpu_kernel_writes_the_step_as_xla_does(monkeypatch, dtype):
  """ops.paged_decode_attention through the Triton kernel's `write` (interpreted)
  against XLA's scatters around the reference: the new token put in each page in
  progress, the pages that fill copied to their pool pages (every other page left
  as it was, NaN ones too), and the attention over the new token."""
  q, prompt, pool, own, slot_row = _case(5, dtype)
  S, K, m, H = q.shape
  M, p = pool[0].shape[1], pool[0].shape[3]
  rng = np.random.default_rng(6)
  new = tuple(jnp.asarray(rng.normal(size=(S, K, H)), dtype) for _ in range(2))
  offset = jnp.asarray(rng.integers(0, p, S), jnp.int32)
  free = np.flatnonzero(np.asarray(pool[2]) < 0)
  # Two running slots fill their pages (into free pool pages), the rest do not.
  flush = jnp.asarray(np.where(np.arange(S) == 0, free[0], np.where(np.arange(S) == 3, free[1],
                                                                    M)), jnp.int32)
  own = (own[0], own[1], jnp.arange(p)[None, :] <= offset[:, None])
  args = (q.reshape(S, K * m, H), new, offset, flush, prompt, pool, own, slot_row, 1.0)
  want = ops.paged_decode_attention(*args, kernels="xla")
  monkeypatch.setattr(ops, "paged_backend", lambda *a: "gpu")
  monkeypatch.setattr(pallas_gpu, "paged_attention", KERNELS["gpu"])
  got = ops.paged_decode_attention(*args, kernels="gpu")
  running = np.asarray(slot_row) >= 0
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(np.asarray(got[0], np.float32)[running],
                             np.asarray(want[0], np.float32)[running], **tol)
  for g, w in zip([*got[1], *got[2]], [*want[1], *want[2]]):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  # The XLA path is the independent check of what moved: the flushed pages hold the
  # slots' pages with the new token at its offset.
  kp = np.asarray(got[2][0], np.float32)
  np.testing.assert_array_equal(kp[:, free[0], :, offset[0]], np.asarray(new[0][0], np.float32))
