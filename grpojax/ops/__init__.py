"""The kernel boundary: the few ops whose best implementation depends on the machine.

Every model and sampler computation that has a platform-tuned variant goes
through one of these functions, each given a backend:

- "xla": plain JAX, the reference on every platform.
- "cpu": the native CPU kernels (grpojax/ops/cpu_kernels.cc, XLA FFI) and the
  variants measured faster on XLA:CPU (bench/RESULTS.md): packed dense
  layers, decode attention, a two-level inverse-CDF draw, and a custom
  backward for the MLP's wide input projections.
- "tpu", "gpu": the full-sequence `attention` and the paged pool's part of
  `paged_attention` as Pallas kernels for that platform (ops/pallas_tpu.py,
  ops/pallas_gpu.py); every other op is XLA's.

Sliding windows and soft-capped scores (Gemma) are in the XLA reference only:
where the Pallas kernels or the native CPU decode kernel would run,
`attention`, `decode_attention` and the paged ops run XLA's instead when given
a window or a softcap (the same program as before when given neither).

`ModelConfig.kernels` (the run's `model.kernels`) names it: "auto" (the
default) is the platform's own: "cpu" when JAX's default backend is the CPU
and the kernels build, "tpu" on one TPU chip, "gpu" on GPUs, else "xla". `resolve`
makes that choice, building the kernels if needed: the trainer and `generate`
call it before tracing anything, so no trace ever runs a compiler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpojax.ops import cpu, quant, xla

BACKENDS = ("auto", "xla", "cpu", "tpu", "gpu")


def _platform_backend(build: bool = True) -> str:
  """The backend "auto" means on JAX's default platform.

  On TPUs only with one chip: a Mosaic kernel lowers in a program over several
  chips only under a mesh in context (ops/pallas_tpu.py), which the trainer
  does not set yet; there the blockwise XLA reference runs.
  """
  platform = jax.default_backend()
  if platform == "cpu":
    return "cpu" if (cpu.load() if build else cpu.loaded()) else "xla"
  if platform == "tpu":
    return "tpu" if jax.device_count() == 1 else "xla"
  return "gpu" if platform in ("gpu", "cuda") else "xla"


def resolve(cfg):
  """cfg (a ModelConfig) with `kernels` resolved to a concrete backend, building the CPU kernels.

  Raises ValueError when "cpu" is asked for explicitly and its kernels cannot be
  built or JAX's default backend is not the CPU. "tpu" and "gpu" are kept as
  given, whatever this host is: a program compiled here for another machine
  (grpojax.targets) names that machine's backend.
  """
  if cfg.kernels in ("xla", "tpu", "gpu"):
    return cfg
  on_cpu = jax.default_backend() == "cpu"
  if cfg.kernels == "cpu" and not (on_cpu and cpu.load()):
    raise ValueError("model.kernels='cpu' needs JAX's CPU backend and a C++ compiler "
                     f"(default backend: {jax.default_backend()}); use 'auto' or 'xla'")
  return cfg.replace(kernels=_platform_backend())


def backend(kernels: str) -> str:
  """The backend a trace uses for `kernels`; never builds ("auto" unresolved: "cpu" if built)."""
  if kernels == "auto":
    return _platform_backend(build=False)
  if kernels not in BACKENDS:
    raise ValueError(f"kernels={kernels!r}; valid: {', '.join(BACKENDS)}")
  return kernels


def linear(x: jax.Array, w, kernels: str = "xla") -> jax.Array:
  """x [..., I] times a weight [O, I] (or cpu.PackedWeight, see pack_decode, or a
  quant.QuantizedWeight, dequantised to x's dtype here) -> [..., O]."""
  w = quant.maybe_dequantize(w, x.dtype)
  return cpu.linear(x, w) if backend(kernels) == "cpu" else xla.linear(x, w)


def wide_linear(x: jax.Array, w: jax.Array, kernels: str = "xla") -> jax.Array:
  """x [B, T, D] @ w [F, D].T -> [B, T, F] (the MLP's gate and up projections, F > D;
  w may be a quant.QuantizedWeight)."""
  w = quant.maybe_dequantize(w, x.dtype)
  return cpu.wide_linear(x, w) if backend(kernels) == "cpu" else xla.wide_linear(x, w)


def decode_attention(q: jax.Array, segments, scale: float, kernels: str = "xla", *,
                     softcap: float | None = None) -> jax.Array:
  """Attention of q [N, T, Nq, H] over keys and values held in several segments.

  segments: (k [R, K, H, S], v [R, K, S, H], visible, g) tuples, one softmax
  over all of them. A segment holds R = N / g rows, each shared by g
  consecutive query rows (a group's prompt is stored once and read by its g
  samples); visible is a bool mask broadcastable to [N, T, S], or None for all.
  Scores, softmax and the sum over segments in float32; returns q's dtype. softcap:
  scores capped to softcap * tanh(s / softcap) (XLA's path: the native kernel has none).
  """
  N, T, Nq, H = q.shape
  K = segments[0][0].shape[1]
  m = T * (Nq // K)
  q = (q * scale).astype(q.dtype)
  q = q.reshape(N, T, K, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, K, m, H)
  if softcap is not None:
    out = xla.segment_attention(q, segments, T=T, softcap=softcap)
  else:
    impl = cpu.segment_attention if backend(kernels) == "cpu" else xla.segment_attention
    out = impl(q, segments, T=T)
  return out.reshape(N, K, T, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, T, Nq, H).astype(q.dtype)


def paged_attention(q: jax.Array, prompt, pool, own, slot_row: jax.Array, scale: float,
                    kernels: str = "xla", *, window=None, softcap: float | None = None
                    ) -> jax.Array:
  """One decode query per slot, q [S, Nq, H], over a paged KV cache -> [S, Nq, H] in q's dtype.

  prompt: (k [B, K, H, P], v [B, K, P, H], visible [B, P] bool, g): the B
  prompts stored once, row r reading prompt r // g. pool: (k_pages,
  v_pages [K, M, H, p], owner [M] int32: the slot a page belongs to, -1 free,
  full [M] bool: its owner sees all its p tokens). own: (k, v [S, K, H, p],
  visible [S, p] bool, a prefix: through the fed token): each slot's page in
  progress. slot_row: [S] int32, the
  row each slot decodes, -1 idle (its output is finite garbage). The keys read
  are the live ones, not the pool or slots x the longest row (sampling/engine/;
  `paged_keys_read` counts them).

  "tpu": one Mosaic kernel (pallas_tpu.paged_attention: prompts and pages in
  progress fetched as blocks, full pages by DMA). "gpu": one Triton kernel
  (pallas_gpu.paged_attention: everything by indexed loads) where its tiles
  take the sizes and P is a multiple of `paged_prompt_multiple` (the engine
  pads its prompts to it). Else XLA's compacted chunks (ops/xla.py), the
  reference, which alone takes a sliding window (window: (w, the slots' completion
  positions [S], the pages' first positions [M]): a key w or more positions before
  its query is not seen) or a softcap on the scores: with either, XLA's runs.
  """
  S, Nq, H = q.shape
  kp, vp, owner, full = pool
  K = kp.shape[0]
  q = (q * scale).astype(q.dtype).reshape(S, K, Nq // K, H)
  b = _paged_runs(kernels, Nq // K, H, kp.shape[3], prompt[2].shape[1])
  if window is not None or softcap is not None:
    out = xla.paged_attention(q, prompt, pool, own, slot_row, window=window, softcap=softcap)
  elif b == "tpu":
    from grpojax.ops import pallas_tpu
    out = pallas_tpu.paged_attention(q, prompt, pool, own, slot_row)
  elif b == "gpu":
    from grpojax.ops import pallas_gpu
    out = pallas_gpu.paged_attention(q, prompt, pool, own, slot_row)
  else:
    out = xla.paged_attention(q, prompt, pool, own, slot_row)
  return out.reshape(S, Nq, H).astype(q.dtype)


def paged_decode_attention(q: jax.Array, new, offset: jax.Array, flush: jax.Array, prompt, pool,
                           own, slot_row: jax.Array, scale: float, kernels: str = "xla", *,
                           window=None, softcap: float | None = None):
  """One layer's cache work in a decode step over the paged cache: this step's keys
  and values written, `paged_attention` over them, full pages moved to the pool.

  new: (k, v [S, K, H]), put at `offset` [S] in each slot's page in progress
  (own: (k, v [S, K, H, p], visible [S, p]), visible counting the new token);
  then q [S, Nq, H] attends as `paged_attention` does; then each slot's page in
  progress is copied whole to pool page flush [S] (M: none), once the attention
  has read the pool. Returns (out [S, Nq, H], (slot_k, slot_v), (k_pages,
  v_pages)) for the cache, written in place where the buffers are donated.

  "gpu" (where `paged_attention`'s kernel runs): all of it in the kernel
  (pallas_gpu.paged_attention's `write`), one launch a layer. Else XLA's
  scatters around `paged_attention` (window, softcap: as there; with either, XLA's).
  """
  S, Nq, H = q.shape
  kp, vp, owner, full = pool
  K = kp.shape[0]
  plain = window is None and softcap is None
  if plain and _paged_runs(kernels, Nq // K, H, kp.shape[3], prompt[2].shape[1]) == "gpu":
    from grpojax.ops import pallas_gpu
    qs = (q * scale).astype(q.dtype).reshape(S, K, Nq // K, H)
    out, sk, sv, kp, vp = pallas_gpu.paged_attention(qs, prompt, pool, own, slot_row,
                                                     write=(*new, offset, flush))
    return out.reshape(S, Nq, H).astype(q.dtype), (sk, sv), (kp, vp)
  sk, sv = xla.write_token(own[0], own[1], *new, offset)
  out = paged_attention(q, prompt, pool, (sk, sv, own[2]), slot_row, scale, kernels,
                        window=window, softcap=softcap)
  # The flush writes the pool in place only once the attention has read it; tied
  # to the attention's output, XLA orders it so, instead of copying the pool first.
  out, kp, vp = jax.lax.optimization_barrier((out, kp, vp))
  return out, (sk, sv), xla.flush_pages(kp, vp, sk, sv, flush)


def paged_backend(kernels: str, m: int, H: int, page_size: int) -> str:
  """The implementation `paged_attention` runs for `kernels`: "tpu" (pages a multiple
  of 128 tokens, a vector register's lanes: smaller pages are stored in a layout
  XLA copies the pool out of before the kernel, measured on a v5e's compiler),
  "gpu" (where its Triton tiles take m query heads per kv head, head dim H and
  pages of page_size) or "xla"."""
  b = backend(kernels)
  if b == "gpu":
    from grpojax.ops import pallas_gpu
    return "gpu" if pallas_gpu.paged_supported(m, H, page_size) else "xla"
  return "tpu" if b == "tpu" and page_size % 128 == 0 else "xla"


def _paged_runs(kernels: str, m: int, H: int, page_size: int, prompt_length: int) -> str:
  """`paged_backend`'s choice, or "xla" where the prompts are not padded to the GPU
  kernel's chunk (`paged_prompt_multiple`: the engine pads them)."""
  b = paged_backend(kernels, m, H, page_size)
  if b == "gpu" and prompt_length % paged_prompt_multiple(kernels, m, H, page_size):
    return "xla"
  return b


def paged_prompt_multiple(kernels: str, m: int, H: int, page_size: int) -> int:
  """The prompt length `paged_attention`'s kernel needs a multiple of (1: any)."""
  if paged_backend(kernels, m, H, page_size) == "gpu":
    from grpojax.ops import pallas_gpu
    return pallas_gpu.PROMPT_CHUNK
  return 1


def paged_keys_read(kernels: str, m: int, H: int, *, slot_row: jax.Array,
                    slot_position: jax.Array, group: int, full_pages: jax.Array,
                    prompt_length: int, num_prompts: int, page_size: int,
                    num_pages: int) -> tuple[jax.Array, jax.Array]:
  """(completion keys, prompt keys), each with its value, that one layer's
  `paged_attention` reads in a step whose slots decode slot_row [S] (-1 idle) at
  completion positions slot_position [S] with full_pages [] full pages in use, on
  this backend: XLA's in whole chunks of its loops (prompts: those with a decoding
  row, once each); the kernels' full pages once each, and prompts: the TPU
  kernel's once per run of slots that share one, the GPU kernel's once per
  running slot. Pages in progress: the TPU kernel's and XLA's whole, every slot's;
  the GPU kernel's a running slot's visible prefix, in whole chunks of
  pallas_gpu.OWN_CHUNK."""
  S = slot_row.shape[0]
  b = paged_backend(kernels, m, H, page_size)
  if b == "tpu":
    from grpojax.ops import pallas_tpu
    pages = S * page_size + full_pages * page_size
    keys = pallas_tpu.paged_keys_read(slot_row, group, full_pages, prompt_length, page_size)
    return pages, keys - pages
  if b == "gpu":
    from grpojax.ops import pallas_gpu
    c = pallas_gpu.OWN_CHUNK
    seen = -(-(slot_position % page_size + 1) // c) * c
    own = jnp.sum(jnp.where(slot_row >= 0, seen, 0))
    return own + full_pages * page_size, jnp.sum(slot_row >= 0) * prompt_length
  running = slot_row >= 0
  prompts = jnp.sum(jnp.zeros((num_prompts,), bool).at[
      jnp.where(running, slot_row // group, num_prompts)].set(True, mode="drop"))
  keys = xla.paged_keys_read(full_pages, page_size, num_pages, prompts, prompt_length,
                             num_prompts, S)
  prompt_keys = keys - xla.paged_keys_read(full_pages, page_size, num_pages, 0, prompt_length,
                                           num_prompts, S)
  return keys - prompt_keys, prompt_keys


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array, scale: float, *,
              block: int, kernels: str = "xla", window=None,
              softcap: float | None = None) -> jax.Array:
  """Causal attention over a whole sequence without its [T, S] scores: q [B, T, Nq, H]
  over k, v [B, S, K, H] (K divides Nq, T <= S), the queries being the last T of
  the S key positions, in blocks of `block` with an online softmax and a backward
  that recomputes each block (memory O(T · block)).

  Query t (position S - T + t) sees key s <= S - T + t that is valid
  (kv_valid [B, S] bool) or is its own position: `models.cache.attention_mask`'s
  causal + left-padding mask, and the shared prompt's when T < S (a group's
  completions over their prompt's keys, then their own). Outputs at invalid
  positions are finite but backend-dependent: callers mask them.
  window (an int or int32 scalar): query t also sees no key window or more slots
  before it; softcap: scores capped to softcap * tanh(s / softcap). Only XLA's
  blockwise reference takes them: with either, it runs whatever the backend.
  Returns [B, T, Nq, H] in q's dtype.
  """
  if q.shape[1] > k.shape[1]:
    raise ValueError(f"{q.shape[1]} queries over {k.shape[1]} keys: queries must be the last keys")
  if window is not None or softcap is not None:
    return xla.blockwise_attention(q, k, v, kv_valid, scale, block, window=window,
                                   softcap=softcap)
  b = backend(kernels)
  if b == "tpu":
    from grpojax.ops import pallas_tpu
    return pallas_tpu.attention(q, k, v, kv_valid, scale, block=block)
  if b == "gpu":
    from grpojax.ops import pallas_gpu
    return pallas_gpu.attention(q, k, v, kv_valid, scale, block=block)
  return xla.blockwise_attention(q, k, v, kv_valid, scale, block)


def categorical(rng: jax.Array, logits: jax.Array, kernels: str = "xla") -> jax.Array:
  """One draw per row from softmax(logits): [B, V] -> [B] int32; -inf logits are never drawn."""
  return (cpu.categorical if backend(kernels) == "cpu" else xla.categorical)(rng, logits)


def packs_weights(kernels: str, dtype) -> bool:
  """Whether decode weights are packed for the native dense kernel (cpu backend, float32)."""
  return backend(kernels) == "cpu" and jnp.dtype(dtype) == jnp.float32
