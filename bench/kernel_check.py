"""The platform's Pallas kernels, compiled, against the XLA reference on the same device.

Run on a GPU or TPU before timing anything (bench/device_engine.sh does): the tests
run the kernels through Pallas' interpreters on a CPU; this compiles them for the
device and checks, on fresh random inputs each run:

  paged     ops.paged_attention (the engine's decode attention) at the test's sizes and
            at Qwen2.5-0.5B's (m = 7, H = 64, pages of 128), every page outside a slot's
            list filled with NaN: the kernel must not read one.
  paged write  (GPU) ops.paged_decode_attention, the kernel that also writes the step's
            key and value and copies filled pages to the pool, against XLA's scatters:
            the moved keys and values exactly, the attention to the tolerance.
  attention ops.attention (prefill and training's full-sequence attention), causal with
            left padding, and its gradient.

Error: ||out - ref|| / ||ref|| over running slots (valid positions), the reference
in float32 on upcast inputs; bf16 passes under 2e-2, float32 under 1e-3 (Triton's
dots are tf32). Prints one line per case and exits 1 if any fails.

  python bench/kernel_check.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from grpojax import ops
from grpojax.ops import xla

TOL = {jnp.float32: 1e-3, jnp.bfloat16: 2e-2}


def paged_case(rng, dtype, *, S, K, m, H, M, p, B, g, P):
  """ops.paged_attention's arguments: S slots (every fourth idle), rows in group order,
  each running slot owning some full pages in shuffled order plus its page in
  progress; pages not full or not owned are NaN; prompts left-padded by up to P/2."""
  slot_row = np.where(np.arange(S) % 4 == 3, -1, rng.permutation(B * g)[:S]).astype(np.int32)
  owner = rng.integers(-1, S, M).astype(np.int32)
  owner[(owner >= 0) & (slot_row[np.maximum(owner, 0)] < 0)] = -1
  full = (owner >= 0) & (rng.random(M) < 0.9)
  kp, vp = rng.normal(size=(2, K, M, H, p))
  kp[:, ~full], vp[:, ~full] = np.nan, np.nan
  visible = np.arange(P)[None, :] >= rng.integers(0, P // 2, B)[:, None]
  own_visible = np.arange(p)[None, :] <= rng.integers(0, p, S)[:, None]
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  q = cast(rng.normal(size=(S, K, m, H)) * H**-0.5)
  prompt = (cast(rng.normal(size=(B, K, H, P))), cast(rng.normal(size=(B, K, P, H))),
            jnp.asarray(visible), g)
  own = (cast(rng.normal(size=(S, K, H, p))), cast(rng.normal(size=(S, K, H, p))),
         jnp.asarray(own_visible))
  pool = (cast(kp), cast(vp), jnp.asarray(owner), jnp.asarray(full))
  return q, prompt, pool, own, jnp.asarray(slot_row)


def rel_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("nan")
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_paged(kernels: str, dtype, rng, **sizes) -> float:
  q, prompt, pool, own, slot_row = paged_case(rng, dtype, **sizes)
  m, H, p = sizes["m"], sizes["H"], sizes["p"]
  backend = ops.paged_backend(kernels, m, H, p)
  if backend == "xla":
    raise ValueError(f"no {kernels} kernel at m={m}, H={H}, p={p}")
  S, K = q.shape[:2]
  run = jax.jit(lambda q, *a: ops.paged_attention(
      q.reshape(S, K * m, H), *a, 1.0, kernels=kernels).reshape(S, K, m, H))
  if "pallas_call" not in str(jax.make_jaxpr(run)(q, prompt, pool, own, slot_row)):
    raise AssertionError(f"ops.paged_attention ran no {kernels} kernel")  # it fell back to XLA
  got = run(q, prompt, pool, own, slot_row)
  f32 = lambda t: jax.tree.map(  # noqa: E731
      lambda x: x.astype(jnp.float32) if getattr(x, "dtype", None) == dtype else x, t)
  # The reference reads only full pages, whose NaN-free copy it gets.
  clean = (jnp.nan_to_num(pool[0]), jnp.nan_to_num(pool[1]), pool[2], pool[3])
  want = xla.paged_attention(f32(q), f32(prompt), f32(clean), f32(own), slot_row)
  running = np.asarray(slot_row) >= 0
  return rel_error(np.asarray(got, np.float32)[running], np.asarray(want)[running])


def check_paged_write(kernels: str, dtype, rng, **sizes) -> float:
  """ops.paged_decode_attention (the engine's decode on a GPU: the step's key and value
  written into each page in progress, and pages that fill copied to the pool, by the
  kernel) against XLA's scatters around the reference. Returns the attention's error;
  the moved keys and values must match exactly, every untouched page (NaN ones too)
  left as it was."""
  q, prompt, pool, own, slot_row = paged_case(rng, dtype, **sizes)
  S, K, m, H = q.shape
  M, p = pool[0].shape[1], pool[0].shape[3]
  new = tuple(jnp.asarray(rng.normal(size=(S, K, H)), dtype) for _ in range(2))
  offset = jnp.asarray(rng.integers(0, p, S), jnp.int32)
  free = np.flatnonzero(np.asarray(pool[2]) < 0)
  flush = np.full(S, M, np.int32)
  flush[np.flatnonzero(np.asarray(slot_row) >= 0)[:2]] = free[:2]  # two running slots fill
  own = (own[0], own[1], jnp.arange(p)[None, :] <= offset[:, None])
  args = (q.reshape(S, K * m, H), new, offset, jnp.asarray(flush), prompt[:3], pool, own,
          slot_row)
  g = prompt[3]  # the group size: static

  def step(backend):
    return jax.jit(lambda q, new, offset, flush, prompt, *rest: ops.paged_decode_attention(
        q, new, offset, flush, (*prompt, g), *rest, 1.0, kernels=backend))

  if "pallas_call" not in str(jax.make_jaxpr(step(kernels))(*args)):
    raise AssertionError(f"ops.paged_decode_attention ran no {kernels} kernel")
  got, want = step(kernels)(*args), step("xla")(*args)
  for a, b in zip([*got[1], *got[2]], [*want[1], *want[2]]):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  running = np.asarray(slot_row) >= 0
  return rel_error(np.asarray(got[0], np.float32)[running], np.asarray(want[0], np.float32)[running])


def check_attention(kernels: str, dtype, rng, *, B=2, T=256, Nq=14, K=2, H=64) -> tuple:
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), dtype) for n in (Nq, K, K))
  valid = jnp.asarray(np.arange(T)[None, :] >= np.array([[0], [37]]))
  ct = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32) * valid[:, :, None, None]

  def loss(backend, q, k, v):
    out = ops.attention(q, k, v, valid, H**-0.5, block=128, kernels=backend)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  grad = lambda b, *a: jax.jit(jax.grad(lambda *x: loss(b, *x), argnums=(0, 1, 2),  # noqa: E731
                                        has_aux=True))(*a)
  (gk, out), (gx, ref) = grad(kernels, q, k, v), grad("xla", *(x.astype(jnp.float32)
                                                               for x in (q, k, v)))
  rows = np.asarray(valid)[:, :, None, None]
  fwd = rel_error(np.asarray(out, np.float32) * rows, np.asarray(ref) * rows)
  bwd = max(rel_error(a, b) for a, b in zip(gk, gx))
  return fwd, bwd


def main() -> int:
  platform = jax.default_backend()
  kernels = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}.get(platform)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform})", flush=True)
  if kernels is None:
    print("no Pallas kernels on this platform: nothing to check")
    return 0
  rng = np.random.default_rng()
  small = dict(S=8, K=2, m=3, H=16 if kernels == "gpu" else 128, M=37,
               p=16 if kernels == "gpu" else 128, B=4, g=2, P=128)
  qwen = dict(S=64, K=2, m=7, H=64, M=300, p=128, B=8, g=8, P=128)
  failed = 0
  cases = [("paged small", check_paged, small), ("paged qwen2.5-0.5b", check_paged, qwen)]
  if kernels == "gpu":  # the kernel that writes the step is the GPU's alone
    cases.append(("paged write qwen2.5-0.5b", check_paged_write, qwen))
  for name, check, sizes in cases:
    for dtype in (jnp.float32, jnp.bfloat16):
      try:
        err = check(kernels, dtype, rng, **sizes)
      except Exception as e:  # noqa: BLE001  a compile error is a failed check
        err, note = float("nan"), f" ({type(e).__name__}: {str(e)[:300]})"
      else:
        note = ""
      ok = err < TOL[dtype]
      failed += not ok
      print(f"{name:<24} {jnp.dtype(dtype).name:<8} rel err {err:.2e} "
            f"{'ok' if ok else 'FAIL'}{note}", flush=True)
  for dtype in (jnp.float32, jnp.bfloat16):
    try:
      fwd, bwd = check_attention(kernels, dtype, rng)
    except Exception as e:  # noqa: BLE001
      fwd = bwd = float("nan")
      print(f"attention {jnp.dtype(dtype).name}: {type(e).__name__}: {str(e)[:300]}")
    ok = fwd < TOL[dtype] and bwd < 2 * TOL[dtype]
    failed += not ok
    print(f"attention {jnp.dtype(dtype).name:<8} rel err forward {fwd:.2e}, gradients "
          f"{bwd:.2e} {'ok' if ok else 'FAIL'}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
