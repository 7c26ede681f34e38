"""The rollout engine's schedule and KV bytes, for bench/workloads/engine.py: the engine's
admission, paging and keys read replayed in numpy (checked against EngineStats), and
the bytes a decode step moves per key it reads, read from compiled steps (XLA's cost
model, a device compiler's through grpojax.targets, or the floor of one read of each
key and value).

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, S decode slots, M pages of p tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from grpojax import models, ops, plan, targets
from grpojax.models import cache as cache_lib
from grpojax.models import transformer


def live_tokens(lengths: np.ndarray, P: int) -> int:
  """Tokens a step-by-step reader of each row's own prompt and completion reads:
  decode step t (1 .. len - 1) of a row feeds its token t - 1 and attends P + t."""
  n = lengths.astype(np.int64) - 1
  return int(np.sum(n * P + n * (n + 1) // 2))


@dataclasses.dataclass
class Schedule:
  """What a run decodes: steps, the engine's pages_peak and preemptions, and the
  keys (each with its value) one layer's attention reads over the run: from pages
  (the lockstep's: completion slots) and from prompts, and live (each running row
  its prompt and its tokens through the one fed)."""

  steps: int
  pages_peak: int = 0
  preempted: int = 0
  page_keys: int = 0
  prompt_keys: int = 0
  live_keys: int = 0


def simulate(lengths: np.ndarray, T: int, *, S: int, M: int, p: int, G: int, P: int,
             kernels: tuple = ("xla", 1, 1)) -> Schedule:
  """The engine's schedule replayed in numpy: its admission (idle slots take the
  lowest pending rows while every running slot's next page stays free), page
  taking (a page when a fed token starts one), release (a row's pages when it
  ends) and keys read per step (`ops.paged_keys_read` of its full pages and
  the prompts with a running row, as the engine counts them). Rows of length 1 end
  at the prefill. Preemption is not replayed: raises if the pool runs short.
  kernels: (backend, m, H) of the attention, whose keys read per step are
  `ops.paged_keys_read`'s."""
  N = len(lengths)
  B = N // G
  pending = [r for r in range(N) if lengths[r] > 1 and T > 1]
  row = np.full(S, -1)
  pos = np.zeros(S, np.int64)
  held = np.zeros(S, np.int64)
  out = Schedule(steps=0)
  nxt = 0
  while nxt < len(pending) or (row >= 0).any():
    running = row >= 0
    free = M - held.sum()
    needs = int(np.sum(running & (pos % p == 0)))
    idle = np.flatnonzero(~running)[:max(min(free - needs, S), 0)]
    for s in idle[:len(pending) - nxt]:
      row[s], pos[s] = pending[nxt], 0
      nxt += 1
    running = row >= 0
    need = running & (pos % p == 0)
    if held.sum() + need.sum() > M:
      raise ValueError(f"the pool of {M} pages runs short at step {out.steps}: preemption "
                       "is not replayed")
    held += need
    out.pages_peak = max(out.pages_peak, int(held.sum()))
    # As the engine's step: paged_keys_read of the full pages (a slot at position pos
    # has filled pos // p) and the prompts with a running row; the rest are page keys.
    full = int(np.sum(np.where(running, pos // p, 0)))
    page_keys, prompt_keys = ops.paged_keys_read(
        *kernels, slot_row=jnp.asarray(row), slot_position=jnp.asarray(pos, jnp.int32), group=G,
        full_pages=jnp.int32(full),
        prompt_length=P, num_prompts=B, page_size=p, num_pages=M)
    out.page_keys += int(page_keys)
    out.prompt_keys += int(prompt_keys)
    out.live_keys += int(np.sum(P + pos[running] + 1))
    t = pos + 1
    end = running & ((t + 1 == lengths[np.maximum(row, 0)]) | (t + 1 == T))
    pos = np.where(running, t, pos)
    out.steps += 1
    row[end], held[end] = -1, 0
  return out


def lockstep_schedule(lengths: np.ndarray, T: int, *, G: int, P: int) -> Schedule:
  """`sampler.generate_program` decodes until its longest row ends, max(len) - 1 steps, each
  reading every row's T - 1 completion slots and the B prompts (once per group)."""
  steps = max(int(lengths.max()) - 1, 0)
  N = len(lengths)
  return Schedule(steps=steps, page_keys=steps * N * max(T - 1, 1),
                  prompt_keys=steps * (N // G) * P, live_keys=live_tokens(lengths, P))


# ---------------------------------------------------------------- KV bytes, compile-only


def bytes_per_token(cfg) -> int:
  """Keys and values of one token, all layers, in the compute dtype."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def _bytes_accessed(compiled) -> float:
  """XLA's cost_analysis()["bytes accessed"]; where a compiler gives none (a GPU
  compiled without one), `targets.read_program`'s kernel_bytes, what its kernels read
  and write, read from the optimized HLO."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0] if cost else None
  if cost and cost.get("bytes accessed") is not None:
    return float(cost["bytes accessed"])
  return float(targets.read_program(compiled).kernel_bytes)


def _on(device, tree):
  """tree's shapes as ShapeDtypeStructs on `device` (a target's compile-only one)."""
  if device is None:
    return tree
  where = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)


def _compile(fn, args, device, donate):
  """`fn` jitted over `args` (abstract, placed on `device`) and compiled."""
  lower = lambda: jax.jit(fn, donate_argnums=donate).lower(*_on(device, args))  # noqa: E731
  if device is None:
    return lower().compile()
  measured, _, compiled = plan.measure(lower, quiet=True)
  if compiled is None:
    raise RuntimeError(f"the compiler refused the step: it needs >= {measured['peak_bytes']} bytes")
  return compiled


def _abstract(cfg, B: int, P: int, G: int, T: int):
  """(decode weights, the prefill's KVCache for T slots) as ShapeDtypeStructs."""
  params = {n: jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.param_dtype))
            for n, (shape, _) in models.param_specs(cfg).items()}
  weights = jax.eval_shape(functools.partial(transformer.decode_params, cfg), params)
  tokens = jax.ShapeDtypeStruct((B, P), jnp.int32)
  _, cache = jax.eval_shape(
      functools.partial(transformer.prefill, cfg, group=G, max_new_tokens=T), params, tokens,
      tokens)
  return weights, cache


def _paged(cfg, *, B, G, P, S, M, p):
  """(decode weights, an empty PagedCache of S slots and M pages of p) as ShapeDtypeStructs."""
  weights, cache = _abstract(cfg, B, P, G, 1)
  paged = jax.eval_shape(lambda c: cache_lib.PagedCache.after_prefill(
      c, jnp.full((B,), P, jnp.int32), slots=S, pages=M, page_size=p), cache)
  return weights, paged


# What may touch the pool in a step whose pool a kernel reads: the kernel, the page
# writes, and passing it along.
POOL_USERS = {"custom-call", "scatter", "fusion(scatter)", "parameter", "get-tuple-element",
              "tuple", "bitcast", "optimization-barrier"}


def attention_of(cfg) -> tuple:
  """(cfg.kernels, m, H): what ops.paged_backend and ops.paged_keys_read take."""
  return cfg.kernels, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim


def pool_kernel(cfg, p: int) -> bool:
  """Whether a kernel reads the engine's pool on cfg.kernels (ops.paged_backend)."""
  return ops.paged_backend(*attention_of(cfg), p) != "xla"


def engine_step_bytes(cfg, *, B, G, P, S, M, p, device=None) -> tuple[float, float]:
  """(bytes accessed, of them the page writes' charge) of one `paged_decode_step` of S
  slots, a pool of M pages and prompts of P. With a pool kernel, bytes accessed
  without the kernel's pool operands (`_without_pool_operands`), after checking
  that nothing else reads the pool."""
  weights, paged = _paged(cfg, B=B, G=G, P=P, S=S, M=M, p=p)
  tokens = jax.ShapeDtypeStruct((S,), jnp.int32)
  compiled = _compile(functools.partial(transformer.paged_decode_step, cfg),
                      (weights, tokens, paged), device, donate=(2,))
  pool = paged.k_pages[0]
  total = _bytes_accessed(compiled)
  if pool_kernel(cfg, p):
    users = pool_users(compiled, pool)
    if set(users) - POOL_USERS:
      raise AssertionError(f"the pool is touched by more than the kernel and the page "
                           f"writes: {users}")
    total = _without_pool_operands(compiled, pool, total)
  return total, _pool_scatter_bytes(compiled, pool)


def pool_users(compiled, pool) -> dict:
  """{op: count} of the instructions of the optimized program whose result has the
  shape of `pool` (any layout or memory space), or that take such an operand,
  outside fusions' bodies: what reads or writes a pool. A kernel backend's step
  should show only its custom calls, the page writes (scatter) and plumbing; a copy
  or fusion would move the pool."""
  dims = ",".join(str(d) for d in pool.shape)
  comps, _ = targets.computations(compiled.as_text())
  fused = {c for body in comps.values() for *_, tail in body
           for c in re.findall(r"calls=%?([\w.\-]+)", tail)}
  shapes = {n: sh for body in comps.values() for n, sh, *_ in body}
  users: dict = {}
  for name, body in comps.items():
    if name in fused:
      continue
    for _, shape, op, operands, tail in body:
      operand_shapes = [shapes.get(o.strip().lstrip("%"), "") for o in operands.split(",")]
      if any(re.search(rf"\[{dims}\]", x or "") for x in [shape, *operand_shapes]):
        called = re.search(r"calls=%?([\w.\-]+)", tail)
        if op == "fusion" and called and comps.get(called[1]):
          op = f"fusion({comps[called[1]][-1][2]})"  # by its root: fusion(scatter), ...
        users[op] = users.get(op, 0) + 1
  return users


def _without_pool_operands(compiled, pool, total: float) -> float:
  """`total` less what it charges the pool kernels for their pool operands, whole:
  they read the listed pages only (DMA or indexed loads), which bytes_per_token
  costs per page key. A TPU's cost analysis charges a Mosaic call's HBM operands
  nothing already (the kernel alone, at the 4k experiment's pool of 128 MiB a
  layer: 3 MB); `targets.read_program`'s kernel bytes (an H100's count) charge
  a custom call every operand."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if cost and cost.get("bytes accessed") is not None:
    return total
  dims = ",".join(str(d) for d in pool.shape)
  text = compiled.as_text()
  pools = {m[1] for m in re.finditer(rf"^\s+(?:ROOT )?%?([\w.\-]+) = \w+\[{dims}\]", text, re.M)}
  charged = 0
  for line in text.splitlines():
    if "custom-call(" in line and "paged_attention" in line:
      operands = re.findall(r"%([\w.\-]+)", line.split("custom-call(", 1)[1].split(")", 1)[0])
      charged += sum(o in pools for o in operands)
  return total - charged * math.prod(pool.shape) * jnp.dtype(pool.dtype).itemsize


def _pool_scatter_bytes(compiled, pool) -> float:
  """What XLA's cost model charges the scatters into a buffer of `pool`'s shape (the
  page writes; of any element type: XLA:CPU scatters bf16 in float32): each its
  operand read and its result written, in place or not."""
  dims = re.escape(",".join(str(d) for d in pool.shape))
  total = 0.0
  for dtype in re.findall(rf"= (\w+)\[{dims}\](?:\{{[^}}]*\}})? scatter\(", compiled.as_text()):
    itemsize = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8}.get(dtype, jnp.dtype(pool.dtype).itemsize)
    total += 2.0 * math.prod(pool.shape) * itemsize
  return total


def lockstep_step_bytes(cfg, *, B, G, P, T, device=None) -> float:
  """Bytes accessed by one `decode_step` of N = B·G rows over T completion slots."""
  weights, cache = _abstract(cfg, B, P, G, T)
  tokens = jax.ShapeDtypeStruct((B * G,), jnp.int32)
  return _bytes_accessed(_compile(functools.partial(transformer.decode_step, cfg),
                                  (weights, tokens, cache), device, donate=(2,)))


@contextlib.contextmanager
def one_trip():
  """`ops.xla.paged_attention` with chunks as large as the pool and the prompts:
  one trip of each of its loops reads every page and every prompt, so a compile's
  cost analysis (which counts a loop body once) holds all of their keys."""
  chunk = ops.xla.PAGED_CHUNK_TOKENS
  ops.xla.PAGED_CHUNK_TOKENS = 1 << 40
  try:
    yield
  finally:
    ops.xla.PAGED_CHUNK_TOKENS = chunk


@dataclasses.dataclass
class StepKV:
  """Bytes a decode step moves per key (with its value) it reads, all layers, each
  the slope between two compiles.

  engine: per page key (page_key, the page writes' share taken out), per prompt
  key (engine_prompt_key), and XLA's charge for the page writes per pool page and
  step (write_page); lockstep: per completion slot of a row (slot_key) and per
  prompt key (lockstep_prompt_key). engine_fixed, lockstep_fixed: the rest of a
  step's bytes, the part no key read moves (weights, activations, logits)."""

  page_key: float
  write_page: float
  engine_prompt_key: float
  slot_key: float
  lockstep_prompt_key: float
  engine_fixed: float = 0.0
  lockstep_fixed: float = 0.0

  def engine(self, sched: Schedule, M: int) -> tuple[float, float]:
    """(XLA's count, in place) of a run of the engine with a pool of M pages."""
    read = self.page_key * sched.page_keys + self.engine_prompt_key * sched.prompt_keys
    return read + self.write_page * M * sched.steps, read

  def lockstep(self, sched: Schedule) -> float:
    return self.slot_key * sched.page_keys + self.lockstep_prompt_key * sched.prompt_keys

  @classmethod
  def floor(cls, bpt: int, weight_bytes: int) -> "StepKV":
    """The fewest bytes a step can move: each key it reads costs one read of its K and
    V (bpt, all layers), and every step reads the weights once; what a device's run
    is held against for its share of the memory bandwidth (no compile needed)."""
    return cls(page_key=bpt, write_page=0.0, engine_prompt_key=bpt, slot_key=bpt,
               lockstep_prompt_key=bpt, engine_fixed=weight_bytes, lockstep_fixed=weight_bytes)


def step_kv(cfg, *, B, G, P, S, T, p, M, device=None) -> StepKV:
  """The slopes of StepKV at these shapes, taken upwards from the run's size (XLA
  fuses a small pool differently): pools of M and 2M pages, prompts of P and 2P
  (under `one_trip`), caches of T - 1 and 2(T - 1) slots (six compiles of a step).

  Where cfg.kernels reads the pool with a kernel (ops.paged_backend), XLA's
  count cannot see what it reads (its DMAs or indexed loads): a page key costs
  one read of its K and V (bytes_per_token), what the kernel's code moves for
  each page listed, and nothing else may touch the pool but the page writes,
  which `pool_users` checks in the compiled step; the slope per pool page is
  then all charge for the writes (and the page list's sort). The kernels read
  each prompt key they fetch once too (ops.paged_keys_read counts the fetches).
  A lockstep cache of 2(T - 1) slots larger than the device (its compiler
  refuses it): the slope from (T - 1) / 2 and T - 1 instead."""
  T1 = max(T - 1, 1)
  kw = dict(B=B, G=G, S=S, p=p, device=device)
  kernel = pool_kernel(cfg, p)
  with one_trip():
    eng, write = engine_step_bytes(cfg, P=P, M=M, **kw)
    eng2, write2 = engine_step_bytes(cfg, P=P, M=2 * M, **kw)
    eng_prompt = bytes_per_token(cfg) if kernel else (
        engine_step_bytes(cfg, P=2 * P, M=M, **kw)[0] - eng) / (P * B)
  per_page, write_page = (eng2 - eng) / M, (write2 - write) / M
  if kernel:
    write_page = per_page
    per_page = write_page + p * bytes_per_token(cfg)
  kw = dict(B=B, G=G, device=device)
  lock = lockstep_step_bytes(cfg, P=P, T=T1, **kw)
  try:
    per_slot = (lockstep_step_bytes(cfg, P=P, T=2 * T1, **kw) - lock) / (T1 * B * G)
  except RuntimeError:
    half = max(T1 // 2, 1)
    per_slot = (lock - lockstep_step_bytes(cfg, P=P, T=half, **kw)) / ((T1 - half) * B * G)
  lock_prompt = (lockstep_step_bytes(cfg, P=2 * P, T=T1, **kw) - lock) / (P * B)
  # A kernel's reads are not in XLA's count (the pool's DMAs or loads, and on an
  # H100 its operands are taken out): only the writes' charge scales with M there.
  engine_fixed = eng - write_page * M if kernel else eng - per_page * M - eng_prompt * P * B
  lockstep_fixed = lock - per_slot * T1 * B * G - lock_prompt * P * B
  return StepKV((per_page - write_page) / p, write_page, eng_prompt, per_slot, lock_prompt,
                engine_fixed, lockstep_fixed)
