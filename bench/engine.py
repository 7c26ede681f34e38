"""The rollout engine vs lockstep `generate` on ragged completions: tokens/s, KV bytes, KV memory.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, S decode slots, M pages of p tokens, L layers, K kv heads,
H head dim.

Rows: each row's length is drawn from a lognormal with median T/8 and sigma
--sigma (default 1, in log space), rounded and clipped to [1, T], and forced
through the samplers' `stop_at` hook: row n draws eos_ids[0] = V - 1 as its
token len_n - 1. The random model never draws V - 1 itself (`never_samples`:
log-prob below -40), and every run checks that its lengths are the drawn ones.

Timed, on this CPU, with the random 'small' Llama of bench/sampler.py (27.8M
parameters, float32, `ops.resolve`'s native kernels), per T:
  engine ragged     `engine.generate` (S slots, M pages of p), drawn lengths
  engine full       the same program, every row forced to T tokens
  generate ragged   today's lockstep `sampler.generate_from_params`, drawn lengths
  generate full     the same, every row at T
Each program is compiled by a warm-up run (every row stopped at 2 tokens), then
the four are timed in turn, --reps rounds; the best of each is reported. Useful
tokens/s: the sum of the rows' lengths over those seconds. (On a CPU the
lockstep's native attention kernel skips the cache blocks no row has written
yet, which the KV figures below, XLA's, do not.)

On an accelerator (bench/device_engine.sh on a lent GPU): --model qwen2.5-0.5b
--dtype bfloat16 times the same four runs at that preset's shapes with random
weights and the platform's kernels; the bytes are then the floor (--floor,
StepKV.floor: each key read costs one read of its K and V, and every step reads
the weights once), and "% HBM" is a run's floor bytes over its seconds and the
bandwidth of a 2 GiB copy measured in the same process.

KV bytes = keys read x bytes per key. Keys (each with its value) one layer's
attention reads over a run: the engine's, replayed (`simulate`: per step
`ops.paged_keys_read` of its full pages and of the prompts with a running
row, in whole chunks of its loops, and of every slot's page in progress) and
checked against EngineStats.keys_read;
the lockstep's, every row's T - 1 completion slots and the B prompts, each of
its max(len) - 1 steps. Bytes per key (all layers): one decode step of each is
compiled on abstract inputs (no weights), with kernels="xla" (a native kernel is
opaque to XLA's cost model), and `cost_analysis()["bytes accessed"]` is read at
two sizes: the slope per page key (engine: pools of M and 2M pages), per prompt
key (P and 2P) and per completion slot (lockstep: T - 1 and 2(T - 1) slots),
taken upwards as XLA fuses a small pool differently. The engine's step loops
over chunks of live pages and prompts, and a cost analysis counts a loop body
once, so its compiles run with chunks as large as the pool (`one_trip`): one
trip reads every page. XLA also charges a scatter its whole operand, read and
written, in place or not: the engine's page writes cost it twice the pool per
layer and step (the lockstep's dynamic-update-slice, its update only). "x live"
is XLA's count over the live KV; "in place" takes that charge out (the
scatters into a pool-shaped buffer, found in the optimized HLO), what the
writes cost in a donated pool.
Live KV: over rows, over their decode steps t = 1 .. len - 1, (P + t) keys
(its prompt and tokens 0 .. t - 1; EngineStats.live_keys), x bytes_per_token
(2·L·K·H·itemsize). "keys/live" is the count alone.

KV memory: the engine's peak, B·P + pages_peak·p tokens, and its pool as
allocated, B·P + M·p; the lockstep's cache, B·P + N·(T - 1) (both store a
prompt once per group), x bytes_per_token.

Bound by bandwidth: a run's bytes, its steps x the step's fixed bytes (what
no key read moves: weights, activations, logits; the compiled step's count
less its KV slopes) plus its KV bytes in place; tokens per byte, engine
against lockstep, are the tokens/s ratios of a device its memory bandwidth
bounds (JSON "bandwidth_bound"), read from the compiled programs alone.

Kernels: with --targets, the engine's step is also compiled with the
target's own paged attention kernel (kernels="tpu" on the v5e, "gpu" on the
H100; ops/pallas_tpu.py, ops/pallas_gpu.py). XLA's count cannot see what a
kernel reads (DMAs, indexed loads): a key it reads costs one read of its K and
V, what its code moves, and `pool_users` checks that nothing else in the
compiled step touches the pool but the page writes.

Qwen2.5-0.5B (bf16, compile-only, never run): the same slopes from the same
compiles at its shapes, always B=32 x G=8, S=32, P=128, T=1024,4096 (or the
flags given), on XLA:CPU's cost model (which computes bf16 dots in
float32: its slopes show the converts) and, with --targets tpu,h100, the TPU
v5e and H100 compilers' (grpojax.targets: TPU_LIBRARY_PATH,
GRPOJAX_CUDA_PLUGIN; an H100 gives no cost analysis: `targets.read_program`'s
kernel bytes instead), and the replayed schedules.

  python bench/engine.py                # B=32 x G=8, P=128, T=1024,4096: many hours, 16 GiB+
  python bench/engine.py --quick --json # < 10 min on 2 cores
  python bench/engine.py --dry-run      # tiny model, N=16, T=32: < 1 min, the script's test
  python bench/engine.py --compile-only --targets tpu,h100   # the Qwen figures only

--quick changes only the CPU runs: B=4 x G=8 (N=32), S=8 (N/S = 4; 8 in the
full run), P=32, T=256,1024, best of 2. T=4096 would take most of an hour a
round here: a full-length run decodes N·T tokens, and a step of either reads
up to T keys a row.
--dry-run: the 'tiny' preset, B=2 x G=8, S=4, P=8, p=8, T=32, and qwen2_tiny
for the compile-only figures. With --json the last line is a JSON list, one
object per T (the CPU runs' and the Qwen figures'; null where a T had none of
them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpojax import models, ops, targets
from grpojax.models import cache as cache_lib
from grpojax.models import hf, transformer
from grpojax.sampling import engine as engine_lib
from grpojax.sampling import sampler, strategies

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampler import SMALL  # noqa: E402  bench/sampler.py's model

QWEN = "qwen2.5-0.5b"  # grpojax.models preset: Qwen2.5-0.5B's published shapes
SAMPLING = strategies.SamplingParams(temperature=1.0)
TARGETS = {"tpu": "tpu-v5e", "h100": "h100-80gb"}
KERNELS = {"tpu-v5e": ("tpu",), "h100-80gb": ("gpu",)}  # a target's pool kernel backend


# ---------------------------------------------------------------- the rows


def draw_lengths(seed: int, rows: int, T: int, sigma: float) -> np.ndarray:
  """[rows] int32 completion lengths: lognormal with median T/8 and `sigma`, in [1, T]."""
  x = np.random.default_rng(seed).lognormal(math.log(T / 8), sigma, rows)
  return np.clip(np.rint(x), 1, T).astype(np.int32)


def live_tokens(lengths: np.ndarray, P: int) -> int:
  """Tokens a step-by-step reader of each row's own prompt and completion reads:
  decode step t (1 .. len - 1) of a row feeds its token t - 1 and attends P + t."""
  n = lengths.astype(np.int64) - 1
  return int(np.sum(n * P + n * (n + 1) // 2))


def never_samples(cfg, weights: dict) -> dict:
  """The weights with token V - 1 out of reach of the sampler, a stop id nothing but
  `stop_at` emits: every input embedding gets +100 in dimension 0, which dominates
  the residual stream through the norms (the final hidden state is about sqrt(D)
  there), and V - 1's output row reads -40/sqrt(D) of it: a logit near -40 where
  the others are within a few units of 0. Costs and shapes are unchanged."""
  V, D = cfg.vocab_size, cfg.hidden_size
  out = dict(weights, embed=weights["embed"].at[:, 0].add(100.0))
  name = "embed" if cfg.tie_embeddings else "lm_head"
  row = jnp.zeros((D,), out[name].dtype).at[0].set(-40.0 / math.sqrt(D))
  out[name] = out[name].at[V - 1].set(row)
  return out


def bench_model(name: str, seed: int, dtype: str | None = None, kernels: str | None = None):
  """(cfg resolved for this machine, weights) of `name`: bench/sampler.py's 'small'
  Llama or a grpojax.models preset (its published shapes), randomly initialised as
  HF does, in `dtype` (weights and compute) and on `kernels` if given, with V - 1
  never sampled."""
  cfg = (hf.config_from_hf(dict(SMALL, architectures=["LlamaForCausalLM"])) if name == "small"
         else models.get_preset(name))
  if dtype:
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  model = models.build_model(cfg, seed=seed)
  cfg = ops.resolve(model.config.replace(kernels=kernels) if kernels else model.config)
  return cfg, never_samples(cfg, model.param_dict())


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
  """Bytes a second this device moves through its memory: the median of `reps` jitted
  copies of a float32 array of `nbytes`, each counted as its read and its write."""
  x = jnp.arange(nbytes // 4, dtype=jnp.float32)
  copy = jax.jit(lambda x: x + 1)
  copy(x).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    copy(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * x.nbytes / float(np.median(times))


# ---------------------------------------------------------------- the schedule


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
  from grpojax import plan

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


# ---------------------------------------------------------------- timed runs

RUNS = ("engine ragged", "engine full", "generate ragged", "generate full")


@dataclasses.dataclass
class Shapes:
  B: int  # prompts
  G: int  # samples per prompt
  P: int  # prompt tokens
  S: int  # decode slots
  p: int  # page size
  pages: int  # M; 0: enough for every slot at full length
  tail: tuple[int, ...] | None = None  # EngineConfig.tail_slots (None: automatic)

  @property
  def N(self) -> int:
    return self.B * self.G

  @property
  def engine(self) -> engine_lib.EngineConfig:
    return engine_lib.EngineConfig(slots=self.S, page_size=self.p, pages=self.pages,
                                   tail_slots=self.tail)

  def M(self, T: int) -> int:
    return self.engine.sizes(self.N, T)[1]


def timed_runs(cfg, weights, s: Shapes, T: int, lengths: np.ndarray, *, reps: int,
               seed: int, log=print, runs: tuple = RUNS) -> dict:
  """{run: (best seconds, EngineStats or None)} of `runs` (of RUNS): each compiled by a
  warm-up (every row stopped at 2 tokens), then `reps` timed calls, alternating; each
  call's lengths checked against its stop_at."""
  V = cfg.vocab_size
  prompts = jnp.asarray(np.random.default_rng(seed).integers(0, V - 1, (s.B, s.P)), jnp.int32)
  mask = jnp.ones_like(prompts)
  kw = dict(rng=jax.random.key(seed), num_samples=s.G, max_new_tokens=T, sampling=SAMPLING,
            eos_ids=(V - 1,), pad_id=0)

  def call(method: str, stop: np.ndarray):
    stop_at = jnp.asarray(stop, jnp.int32)
    t = time.perf_counter()
    if method == "engine":
      out, stats = engine_lib.generate(cfg, weights, prompts, mask, engine=s.engine,
                                       with_stats=True, stop_at=stop_at, **kw)
    else:
      out, stats = sampler.generate_from_params(cfg, weights, prompts, mask, stop_at=stop_at,
                                                **kw), None
    lengths_out = np.asarray(out.lengths)  # waits for the program
    seconds = time.perf_counter() - t
    if not np.array_equal(lengths_out, stop) or bool(np.any(np.asarray(out.truncated))):
      bad = np.flatnonzero(lengths_out != stop)
      raise AssertionError(f"{method}: {len(bad)} rows did not stop where forced (rows "
                           f"{bad[:8].tolist()}: {lengths_out[bad[:8]].tolist()} != "
                           f"{stop[bad[:8]].tolist()})")
    return seconds, stats

  stops = {"ragged": lengths, "full": np.full(s.N, T, np.int32)}
  for method in dict.fromkeys(run.split()[0] for run in runs):
    seconds, _ = call(method, np.full(s.N, min(2, T), np.int32))
    log(f"  {method}: compiled and warmed up in {seconds:.1f} s")
  best = {}
  for rep in range(reps):
    for run in runs:
      method, schedule = run.split()
      seconds, stats = call(method, stops[schedule])
      log(f"  rep {rep + 1}/{reps} {run}: {seconds:.2f} s")
      if run not in best or seconds < best[run][0]:
        best[run] = (seconds, stats)
  return best


# ---------------------------------------------------------------- figures


def figures(kv: StepKV, bpt: int, s: Shapes, T: int, lengths: np.ndarray,
            schedules: dict) -> dict:
  """{run: {tokens, steps, keys (read, one layer), live_keys, kv (bytes XLA counts over
  the run), kv_in_place, live (bytes), peak_bytes, pool_bytes}}."""
  M = s.M(T)
  prompts = s.B * s.P * bpt
  out = {}
  for run in RUNS:
    method, schedule = run.split()
    rows = lengths if schedule == "ragged" else np.full(s.N, T, np.int32)
    sched = schedules[run]
    r = dict(tokens=int(rows.sum()), steps=sched.steps, keys=sched.page_keys + sched.prompt_keys,
             live_keys=sched.live_keys, live=sched.live_keys * bpt)
    if method == "engine":
      r["kv"], r["kv_in_place"] = kv.engine(sched, M)
      r["step_bytes"] = sched.steps * kv.engine_fixed + r["kv_in_place"]
      r.update(pages_peak=sched.pages_peak, preempted=sched.preempted,
               peak_bytes=prompts + sched.pages_peak * s.p * bpt,
               pool_bytes=prompts + M * s.p * bpt)
    else:
      r.update(kv=kv.lockstep(sched), peak_bytes=prompts + s.N * max(T - 1, 1) * bpt)
      r["kv_in_place"], r["pool_bytes"] = r["kv"], r["peak_bytes"]
      r["step_bytes"] = sched.steps * kv.lockstep_fixed + r["kv"]
    out[run] = r
  return out


def schedules_of(s: Shapes, T: int, lengths: np.ndarray, kernels: tuple = ("xla", 1, 1)) -> dict:
  """{run: Schedule} of RUNS, the engine's replayed (None where it would preempt)."""
  out = {}
  for schedule, rows in (("ragged", lengths), ("full", np.full(s.N, T, np.int32))):
    try:
      out[f"engine {schedule}"] = simulate(rows, T, S=s.S, M=s.M(T), p=s.p, G=s.G, P=s.P,
                                           kernels=kernels)
    except ValueError:
      out[f"engine {schedule}"] = None
    out[f"generate {schedule}"] = lockstep_schedule(rows, T, G=s.G, P=s.P)
  return out


def _mib(x) -> str:
  return f"{x / 2**20:,.1f}"


def table(fig: dict, seconds: dict | None, bpt: int, bandwidth: float | None = None) -> list[str]:
  """The rows of one T: per run its tokens, time, steps, keys read against the live
  ones, KV bytes per token and against the live KV, its KV memory, and with
  `bandwidth` (bytes/s) its bytes' share of it over its seconds."""
  head = (f"  {'run':<16} {'tokens':>9} {'seconds':>8} {'tok/s':>7} {'steps':>6} "
          f"{'keys/live':>9} {'KV MB/tok':>9} {'x live':>7} {'in place':>8} {'peak MiB':>9} "
          f"{'alloc MiB':>9}" + (f" {'% HBM':>6}" if bandwidth else ""))
  lines = [head]
  for run, r in fig.items():
    sec = seconds[run][0] if seconds else None
    cells = [f"  {run:<16}", f"{r['tokens']:>9,}", f"{sec:>8.2f}" if sec else f"{'-':>8}",
             f"{r['tokens'] / sec:>7,.0f}" if sec else f"{'-':>7}", f"{r['steps']:>6,}",
             f"{r['keys'] / r['live_keys']:>9.2f}", f"{r['kv'] / r['tokens'] / 1e6:>9.2f}",
             f"{r['kv'] / r['live']:>7.2f}", f"{r['kv_in_place'] / r['live']:>8.2f}",
             f"{_mib(r['peak_bytes']):>9}", f"{_mib(r['pool_bytes']):>9}"]
    if bandwidth:
      cells.append(f"{100 * r['step_bytes'] / sec / bandwidth:>6.1f}" if sec else f"{'-':>6}")
    lines.append(" ".join(cells))
  rag = fig["engine ragged"]
  lines.append(f"  live KV of the ragged rows: {rag['live'] / rag['tokens'] / 1e6:.4g} MB per "
               f"generated token ({bpt:,} B per token of context)")
  return lines


def kv_line(name: str, kv: StepKV, bpt: int, s: Shapes) -> str:
  """The slopes against one read of each key and value."""
  return (f"  {name}, bytes per key read (x one read of its K and V): engine "
          f"{kv.page_key / bpt:.2f} per page key, {kv.engine_prompt_key / bpt:.2f} per prompt key, "
          f"page writes charged {kv.write_page / (s.p * bpt):.2f} per pool token a step; lockstep "
          f"{kv.slot_key / bpt:.2f} per completion slot, {kv.lockstep_prompt_key / bpt:.2f} per "
          "prompt key")


# ---------------------------------------------------------------- main

# B, G, P, S, p, T list, reps of each mode; flags given override them.
FULL = dict(prompts=32, groups=8, prompt_len=128, slots=32,
            page_size=engine_lib.EngineConfig().page_size, T="1024,4096", reps=3)
QUICK = dict(FULL, prompts=4, prompt_len=32, slots=8, T="256,1024", reps=2)
DRY = dict(prompts=2, groups=8, prompt_len=8, slots=4, page_size=8, T="32", reps=1)


def _ratio(a, b):
  return None if a is None or b is None else a / b


def check_replay(run: str, stats, replay: Schedule | None) -> None:
  """The engine's EngineStats against the replay: steps and pages_peak exactly, keys read
  and live to float32's rounding (the engine sums them in float32, one add a step: each
  rounds by at most half an ulp of the sum, 2**-24 of it)."""
  if replay is None:
    return
  got = (int(stats.steps), int(stats.pages_peak), int(stats.preempted))
  want = (replay.steps, replay.pages_peak, replay.preempted)
  keys = (float(stats.keys_read), float(stats.live_keys))
  want_keys = (replay.page_keys + replay.prompt_keys, replay.live_keys)
  if got != want or not np.allclose(keys, want_keys, rtol=max(1e-6, got[0] * 2.0**-24)):
    raise AssertionError(f"{run}: EngineStats (steps, pages_peak, preempted) {got}, keys (read, "
                         f"live) {keys}; the replay {want}, {want_keys}")


def summary(T: int, s: Shapes, fig: dict, seconds: dict | None,
            bandwidth: float | None = None) -> dict:
  """One T's JSON object: the ratios the issue asks for, then every run's figures
  (with `bandwidth`, bytes/s: each run's bytes over its seconds, as its share)."""
  tok_s = ({run: fig[run]["tokens"] / seconds[run][0] for run in RUNS} if seconds
           else dict.fromkeys(RUNS))
  runs = {}
  for run, r in fig.items():
    runs[run] = dict(tokens=r["tokens"], seconds=seconds[run][0] if seconds else None,
                     tokens_per_s=tok_s[run], steps=r["steps"],
                     keys_vs_live=r["keys"] / r["live_keys"],
                     kv_bytes_per_token=r["kv"] / r["tokens"], kv_vs_live=r["kv"] / r["live"],
                     kv_in_place_vs_live=r["kv_in_place"] / r["live"],
                     kv_peak_bytes=r["peak_bytes"], kv_allocated_bytes=r["pool_bytes"])
    if "pages_peak" in r:
      runs[run].update(pages_peak=r["pages_peak"], preempted=r["preempted"])
    if bandwidth and seconds:
      runs[run]["bandwidth_share"] = r["step_bytes"] / seconds[run][0] / bandwidth
  rag, gen = fig["engine ragged"], fig["generate ragged"]
  # Tokens per byte moved (steps x the fixed bytes + KV in place): the ratios a
  # device bound by its memory bandwidth would show, from the compiled steps alone.
  per_byte = {run: fig[run]["tokens"] / fig[run]["step_bytes"] for run in RUNS}
  modelled = dict(
      ragged_vs_full=per_byte["engine ragged"] / per_byte["engine full"],
      ragged_vs_generate=per_byte["engine ragged"] / per_byte["generate ragged"],
      full_vs_generate=per_byte["engine full"] / per_byte["generate full"])
  return dict(
      T=T,
      ragged_vs_full=_ratio(tok_s["engine ragged"], tok_s["engine full"]),
      ragged_vs_generate=_ratio(tok_s["engine ragged"], tok_s["generate ragged"]),
      full_vs_generate=_ratio(tok_s["engine full"], tok_s["generate full"]),
      kv_bytes_vs_live=rag["kv"] / rag["live"],
      kv_bytes_vs_live_in_place=rag["kv_in_place"] / rag["live"],
      generate_kv_bytes_vs_live=gen["kv"] / gen["live"], bandwidth_bound=modelled,
      bandwidth_bytes_per_s=bandwidth,
      shapes=dict(dataclasses.asdict(s), N=s.N, M=s.M(T)), runs=runs)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prompts", type=int, help="B (default 32; --quick 4)")
  parser.add_argument("--groups", type=int, help="G samples per prompt (default 8)")
  parser.add_argument("--prompt-len", type=int, help="P (default 128; --quick 32)")
  parser.add_argument("--slots", type=int,
                      help="S decode slots of the engine (default 32; --quick 8)")
  parser.add_argument("--page-size", type=int,
                      help="p tokens per page (default the engine's, "
                      f"{engine_lib.EngineConfig().page_size})")
  parser.add_argument("--pages", type=int, default=0,
                      help="M pages in the pool; 0: every slot at full length, S*ceil(T/p)")
  parser.add_argument("--T", help="completion lengths, comma-separated (default 1024,4096; "
                      "--quick 256,1024 on the CPU)")
  parser.add_argument("--reps", type=int, help="timed runs of each; the best is reported "
                      "(default 3; --quick 2)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sigma", type=float, default=1.0,
                      help="of the lognormal lengths (median T/8), in log space")
  parser.add_argument("--targets", default="",
                      help="also compile the Qwen steps for these (tpu = tpu-v5e, h100 = "
                      "h100-80gb), comma-separated; default none")
  parser.add_argument("--model", help="the timed runs' model: 'small' (bench/sampler.py's, "
                      "the default; --dry-run: 'tiny') or a grpojax.models preset, e.g. "
                      f"{QWEN} (its shapes, random weights)")
  parser.add_argument("--dtype", help="the timed model's weights and compute (default its "
                      "config's: float32)")
  parser.add_argument("--kernels", choices=ops.BACKENDS,
                      help="the timed model's kernels (default auto: the platform's)")
  parser.add_argument("--floor", action="store_true",
                      help="cost the timed runs at the fewest bytes (StepKV.floor) and report "
                      "each one's share of the measured memory bandwidth, instead of XLA's "
                      "cost model; the default on an accelerator")
  parser.add_argument("--no-qwen", action="store_true", help="skip the Qwen2.5-0.5B figures")
  parser.add_argument("--compile-only", action="store_true",
                      help="skip the CPU runs: only the Qwen2.5-0.5B figures")
  parser.add_argument("--quick", action="store_true",
                      help="the CPU runs at B=4, S=8, P=32, T=256,1024, 2 reps (< 10 min)")
  parser.add_argument("--dry-run", action="store_true",
                      help="the tiny model, N=16, T=32 (< 1 min): the script's test")
  parser.add_argument("--json", action="store_true",
                      help="last line: a JSON list, one object per T")
  a = parser.parse_args(argv)
  if a.quick and a.dry_run:
    parser.error("--quick and --dry-run are exclusive")
  if a.compile_only and a.no_qwen:
    parser.error("--compile-only and --no-qwen leave nothing to do")
  names = ("prompts", "groups", "prompt_len", "slots", "page_size", "T", "reps")
  preset = DRY if a.dry_run else QUICK if a.quick else FULL
  given = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
  cpu = dict(preset, **given)
  big = dict(DRY if a.dry_run else FULL, **given)  # the compile-only figures: --quick keeps them
  for n in ("prompts", "groups", "prompt_len", "slots", "page_size", "reps"):
    if cpu[n] < 1:
      parser.error(f"--{n.replace('_', '-')} must be >= 1")
  shapes = lambda d: Shapes(d["prompts"], d["groups"], d["prompt_len"], d["slots"],  # noqa: E731
                            d["page_size"], a.pages)
  s, sq = shapes(cpu), shapes(big)
  cpu_T = [int(t) for t in str(cpu["T"]).split(",")]
  big_T = [int(t) for t in str(big["T"]).split(",")]
  compilers = ["cpu", *(TARGETS.get(t, t) for t in a.targets.split(",") if t)]

  log = functools.partial(print, flush=True)
  log(f"lengths lognormal (median T/8, sigma {a.sigma}), seed {a.seed}")
  if not a.compile_only:
    model = a.model or ("tiny" if a.dry_run else "small")
    cfg, weights = bench_model(model, a.seed, a.dtype, a.kernels)
    xla_cfg = cfg.replace(kernels="xla")
    bpt = bytes_per_token(cfg)
    n_params = sum(int(np.prod(w.shape)) for w in weights.values())
    weight_bytes = sum(int(w.nbytes) for w in weights.values())
    on_cpu = jax.default_backend() == "cpu"
    floor = a.floor or not on_cpu
    bandwidth = copy_bandwidth(2**26 if on_cpu else 2**31) if floor else None
    log(f"{model} model: {n_params / 1e6:.2f}M parameters, "
        f"{cfg.dtype}, kernels={cfg.kernels}, on {jax.devices()[0].device_kind}; B={s.B} x "
        f"G={s.G} = {s.N} rows, P={s.P}, S={s.S}, p={s.p}, pages={s.pages or 'auto'}, "
        f"T={cpu_T}, best of {cpu['reps']}")
    if bandwidth:
      log(f"memory bandwidth, a copy of {2**26 if on_cpu else 2**31:,} B (read + write): "
          f"{bandwidth / 1e9:,.0f} GB/s")
  out: dict[int, dict] = {}
  t0 = time.perf_counter()
  for T in [] if a.compile_only else cpu_T:
    lengths = draw_lengths(a.seed, s.N, T, a.sigma)
    M = s.M(T)
    log(f"\nT={T}: {s.N} rows of {int(lengths.sum()):,} tokens (median {int(np.median(lengths))}, "
        f"max {int(lengths.max())}); engine S={s.S}, M={M} pages of {s.p}")
    seconds = timed_runs(cfg, weights, s, T, lengths, reps=cpu["reps"], seed=a.seed, log=log)
    sched = schedules_of(s, T, lengths, attention_of(cfg))
    for run in ("engine ragged", "engine full"):
      check_replay(run, seconds[run][1], sched[run])
      if sched[run] is None:  # preempted: the replay does not follow; EngineStats' keys
        stats = seconds[run][1]
        sched[run] = Schedule(int(stats.steps), int(stats.pages_peak), int(stats.preempted),
                              int(stats.keys_read), 0, int(stats.live_keys))
        log(f"  {run}: preempted, not replayed; its keys read are EngineStats' (pages and "
            "prompts together, costed as page keys)")
    kv = (StepKV.floor(bpt, weight_bytes) if floor
          else step_kv(xla_cfg, B=s.B, G=s.G, P=s.P, S=s.S, T=T, p=s.p, M=M))
    fig = figures(kv, bpt, s, T, lengths, sched)
    log("\n".join(table(fig, seconds, bpt, bandwidth)))
    log(f"  bytes: the floor, each key read once and the weights ({_mib(weight_bytes)} MiB) "
        "once a step; % HBM: that over the seconds and the copy's bandwidth" if floor
        else kv_line("XLA:CPU", kv, bpt, s))
    out[T] = summary(T, s, fig, seconds, bandwidth)
    out[T].update(model=model, dtype=cfg.dtype, kernels=cfg.kernels,
                  device=jax.devices()[0].device_kind, bytes="floor" if floor else "xla")
    log(f"  engine ragged / full {out[T]['ragged_vs_full']:.2f}x, ragged / generate "
        f"{out[T]['ragged_vs_generate']:.2f}x, full / generate {out[T]['full_vs_generate']:.2f}x; "
        f"KV read / live: engine {out[T]['kv_bytes_vs_live']:.2f} "
        f"({out[T]['kv_bytes_vs_live_in_place']:.2f} in place), generate "
        f"{out[T]['generate_kv_bytes_vs_live']:.2f}  [{time.perf_counter() - t0:.0f} s]")

  if not a.no_qwen:
    name = "qwen2_tiny" if a.dry_run else QWEN
    qcfg = models.get_preset(name).replace(dtype="bfloat16", kernels="xla")
    qbpt = bytes_per_token(qcfg)
    log(f"\n{name} (bf16, compile-only; schedules replayed): B={sq.B} x G={sq.G} = {sq.N} rows, "
        f"P={sq.P}, S={sq.S}, p={sq.p}, pages={sq.pages or 'auto'}, {qbpt:,} B of KV per token")
    for T in big_T:
      lengths = draw_lengths(a.seed, sq.N, T, a.sigma)
      sched = schedules_of(sq, T, lengths)
      if None in sched.values():
        log(f"T={T}: the engine would preempt with {sq.M(T)} pages, which the replay does "
            "not follow: no figures")
        continue
      per_compiler = {}
      for target in compilers:
        if target != "cpu" and not targets.available(target):
          log(f"  {target}: skipped, its compiler is not installed")
          continue
        device = None if target == "cpu" else targets.devices(target, chips=1)[0]
        # XLA's paged attention, and on a TPU or GPU also the platform's pool kernel.
        for kernels in ["xla", *KERNELS.get(target, ())]:
          kcfg = qcfg.replace(kernels=kernels)
          kernel = pool_kernel(kcfg, sq.p)
          if kernels != "xla" and not kernel:
            log(f"  {target}: no {kernels} kernel at these sizes (ops.paged_backend), XLA's above")
            continue
          ksched = schedules_of(sq, T, lengths, attention_of(kcfg)) if kernel else sched
          try:
            with jax.default_device(device) if device is not None else contextlib.nullcontext():
              kv = step_kv(kcfg, B=sq.B, G=sq.G, P=sq.P, S=sq.S, T=T, p=sq.p, M=sq.M(T),
                           device=device)
          except (RuntimeError, AssertionError) as e:  # refused, or the pool moved
            log(f"T={T}, {target} ({kernels}): {e}")
            continue
          fig = figures(kv, qbpt, sq, T, lengths, ksched)
          name = f"{target}:{kernels}" if kernel else target
          log(f"T={T}, compiled for {name}:")
          log("\n".join(table(fig, None, qbpt)))
          log(kv_line(name, kv, qbpt, sq))
          q = summary(T, sq, fig, None)
          bb = q["bandwidth_bound"]
          log(f"  bound by bandwidth (tokens per byte moved; a step's fixed bytes: engine "
              f"{_mib(kv.engine_fixed)} MiB, lockstep {_mib(kv.lockstep_fixed)} MiB): engine "
              f"ragged / full {bb['ragged_vs_full']:.2f}x, ragged / generate "
              f"{bb['ragged_vs_generate']:.2f}x, full / generate {bb['full_vs_generate']:.2f}x")
          per_compiler[name] = {k: v for k, v in q.items() if k not in (
              "T", "ragged_vs_full", "ragged_vs_generate", "full_vs_generate")}
      out.setdefault(T, dict(T=T, ragged_vs_full=None, ragged_vs_generate=None,
                             full_vs_generate=None, kv_bytes_vs_live=None,
                             kv_bytes_vs_live_in_place=None, generate_kv_bytes_vs_live=None))
      out[T]["qwen"] = dict(model=name, **per_compiler)
  log(f"\ndone in {time.perf_counter() - t0:.0f} s")
  result = [out[T] for T in sorted(out)]
  if a.json:
    print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
