"""Where one engine decode step's time goes, part by part, at a fixed cache state.

bench/engine_overhead.py found a step of the engine costing ~3.2 ms on an H200 with
a single live row, ten times its floor (the weights read once). This times the
step's parts, each jitted alone and called `--calls` times back to back (one wait
at the end: the device's time per call, dispatch overlapped), at Qwen2.5-0.5B's
shapes in bf16 (random weights and a random pool: never zeros), B=32 x G=8, P=128,
S=256 slots, M=8192 pages of 128, in three cache states:

  one row   slot 0 at completion position 4095 (31 full pages), 255 slots idle
  ragged    every slot running, at positions drawn as bench/engine.py's lengths
            (lognormal, median T/8, capped at T) halved: the mid-run state
  full      every slot at position 2047 (15 full pages each)

Parts, per state and kernels (gpu: the Triton kernel; xla: the reference):
  step       transformer.paged_decode_step, the cache donated (24 layers, logits)
  attention  ops.paged_attention of one layer, alone
and once: the draw (strategies.sample_rows over [S, V] logits). The engine's step
is these plus its bookkeeping (admission, pages, release, the token writes).

  python bench/engine_step_parts.py [--calls 50]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpojax import ops
from grpojax.models import cache as cache_lib
from grpojax.models import transformer
from grpojax.sampling import strategies

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import QWEN, SAMPLING, bench_model, draw_lengths  # noqa: E402


def per_call(fn, args, calls: int, chain=None) -> float:
  """Seconds a call of jitted `fn` takes on the device, `calls` back to back after a
  warm-up. chain(out) -> the next call's args (a donated cache), else the same args."""
  out = fn(*args)
  jax.block_until_ready(out)
  if chain:
    args = chain(out)
  t = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
    if chain:
      args = chain(out)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / calls


def cache_at(cfg, params, positions: np.ndarray, *, B, G, P, S, M, p, seed) -> cache_lib.PagedCache:
  """A PagedCache with slot s running row s at completion position positions[s] (-1:
  idle), its full pages and its page in progress owned in the pool, every buffer random."""
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (B, P)), jnp.int32)
  _, prefilled = jax.jit(functools.partial(transformer.prefill, cfg, group=G, max_new_tokens=1))(
      params, prompts, jnp.ones_like(prompts))
  heads = (cfg.kernels, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
  c = cache_lib.PagedCache.after_prefill(prefilled, jnp.full((B,), P, jnp.int32), slots=S, pages=M,
                                         page_size=p,
                                         prompt_multiple=ops.paged_prompt_multiple(*heads, p))
  owner, start = np.full(M, -1, np.int32), np.zeros(M, np.int32)
  slot_page = np.full(S, M, np.int32)
  used = 0
  for s, pos in enumerate(positions):
    if pos < 0:
      continue
    n = pos // p + 1  # full pages and the one in progress
    if used + n > M:
      raise ValueError(f"{M} pages hold fewer than the slots' {used + n}")
    owner[used:used + n], start[used:used + n] = s, np.arange(n) * p
    slot_page[s] = used + n - 1
    used += n
  key = jax.random.key(seed)
  noise = lambda x, i: jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)  # noqa: E731
  L = len(c.k_pages)
  return c.replace(
      k_pages=tuple(noise(x, i) for i, x in enumerate(c.k_pages)),
      v_pages=tuple(noise(x, L + i) for i, x in enumerate(c.v_pages)),
      slot_k=tuple(noise(x, 2 * L + i) for i, x in enumerate(c.slot_k)),
      slot_v=tuple(noise(x, 3 * L + i) for i, x in enumerate(c.slot_v)),
      page_owner=jnp.asarray(owner), page_start=jnp.asarray(start),
      slot_row=jnp.asarray(np.where(positions >= 0, np.arange(S), -1), jnp.int32),
      slot_position=jnp.asarray(np.maximum(positions, 0), jnp.int32),
      slot_page=jnp.asarray(slot_page))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument("--model", default=QWEN)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--slots", type=int, default=256)
  parser.add_argument("--pages", type=int, default=8192)
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--kernels", default="gpu,xla", help="comma-separated")
  a = parser.parse_args(argv)
  B, G, P, S, M, p, T = a.prompts, a.groups, 128, a.slots, a.pages, 128, a.T
  # Positions never at a page's last token: no page is flushed, so a donated step's
  # cache is the next call's unchanged in shape and state.
  last = lambda x: np.where(x % p == p - 1, x - 1, x)  # noqa: E731
  states = {
      "one row": np.array([last(T - 1)] + [-1] * (S - 1)),
      "ragged": last(np.minimum(draw_lengths(0, S, T, 1.0) // 2, T - 1)),
      "full": np.full(S, last(T // 2 - 1)),
  }
  rows = []
  for kernels in a.kernels.split(","):
    cfg, params = bench_model(a.model, 0, a.dtype, kernels)
    weights = transformer.decode_params(cfg, params)
    Nq, H = cfg.num_heads, cfg.head_dim
    step = jax.jit(functools.partial(transformer.paged_decode_step, cfg), donate_argnums=(2,))
    attend = jax.jit(lambda q, c: ops.paged_attention(
        q, (c.prompt_k[0], c.prompt_v[0], c.prompt_valid, c.group),
        (c.k_pages[0], c.v_pages[0], c.page_owner, c.page_full()),
        (c.slot_k[0], c.slot_v[0], c.own_visible()), c.slot_row, H**-0.5, kernels))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size - 1, S), jnp.int32)
    q = jax.random.normal(jax.random.key(2), (S, Nq, H), jnp.dtype(cfg.dtype))
    for name, positions in states.items():
      c = cache_at(cfg, params, positions, B=B, G=G, P=P, S=S, M=M, p=p, seed=3)
      t_att = per_call(attend, (q, c), a.calls)
      t_step = per_call(step, (weights, tokens, c), a.calls,
                        chain=lambda out: (weights, tokens, out[1]))
      live = int(np.sum(P + positions[positions >= 0] + 1))
      rows.append((kernels, name, live, t_step, t_att))
      print(f"{kernels} {name}: step {1e3 * t_step:.3f} ms, one layer's attention "
            f"{1e3 * t_att:.3f} ms", flush=True)
      del c
    logits = jax.random.normal(jax.random.key(4), (S, cfg.vocab_size), jnp.float32)
    keys = jax.random.split(jax.random.key(5), S)
    t_draw = per_call(jax.jit(lambda k, x: strategies.sample_rows(k, x, SAMPLING)),
                      (keys, logits), a.calls)
    weights = params = None  # freed before the next model
  print(f"\n{jax.devices()[0].device_kind}: S={S}, M={M} pages of {p}, P={P}, "
        f"{a.model} {a.dtype}; per call, {a.calls} calls back to back")
  print(f"  {'kernels':<8} {'state':<8} {'live keys':>10} {'step ms':>8} {'attn ms':>8} "
        f"{'x layers':>9}")
  L = cfg.num_layers
  for kernels, name, live, t_step, t_att in rows:
    print(f"  {kernels:<8} {name:<8} {live:>10,} {1e3 * t_step:>8.3f} {1e3 * t_att:>8.3f} "
          f"{1e3 * t_att * L:>9.3f}")
  print(f"  the draw over [{S}, {cfg.vocab_size}]: {1e3 * t_draw:.3f} ms")


if __name__ == "__main__":
  main()
