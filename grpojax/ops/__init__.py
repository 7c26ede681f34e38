"""The kernel boundary: the few ops whose best implementation depends on the machine.

Every model and sampler computation that has a platform-tuned variant goes
through one of these functions, each given a backend:

- "xla": plain JAX, the reference; what TPUs and GPUs run.
- "cpu": the native CPU kernels (grpojax/ops/cpu_kernels.cc, XLA FFI) and the
  variants measured faster on XLA:CPU (bench/RESULTS.md): packed dense
  layers, decode attention, a two-level inverse-CDF draw, and a custom
  backward for the MLP's wide input projections.

`ModelConfig.kernels` (the run's `model.kernels`) names it: "auto" (the
default) is "cpu" when JAX's default backend is the CPU and the kernels
build, else "xla". `resolve` makes that choice, building the kernels if
needed: the trainer and `generate` call it before tracing anything, so no
trace ever runs a compiler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpojax.ops import cpu, xla

BACKENDS = ("auto", "xla", "cpu")


def resolve(cfg):
  """cfg (a ModelConfig) with `kernels` resolved to "xla" or "cpu", building the CPU kernels.

  Raises ValueError when "cpu" is asked for explicitly and the kernels cannot
  be built or JAX's default backend is not the CPU.
  """
  if cfg.kernels == "xla":
    return cfg
  on_cpu = jax.default_backend() == "cpu"
  if cfg.kernels == "cpu" and not (on_cpu and cpu.load()):
    raise ValueError("model.kernels='cpu' needs JAX's CPU backend and a C++ compiler "
                     f"(default backend: {jax.default_backend()}); use 'auto' or 'xla'")
  return cfg.replace(kernels="cpu" if on_cpu and cpu.load() else "xla")


def backend(kernels: str) -> str:
  """The backend a trace uses for `kernels`; never builds ("auto" unresolved: "cpu" if built)."""
  if kernels == "auto":
    return "cpu" if jax.default_backend() == "cpu" and cpu.loaded() else "xla"
  if kernels not in BACKENDS:
    raise ValueError(f"kernels={kernels!r}; valid: {', '.join(BACKENDS)}")
  return kernels


def linear(x: jax.Array, w, kernels: str = "xla") -> jax.Array:
  """x [..., I] times a weight [O, I] (or cpu.PackedWeight, see pack_decode) -> [..., O]."""
  return cpu.linear(x, w) if backend(kernels) == "cpu" else xla.linear(x, w)


def wide_linear(x: jax.Array, w: jax.Array, kernels: str = "xla") -> jax.Array:
  """x [B, T, D] @ w [F, D].T -> [B, T, F] (the MLP's gate and up projections, F > D)."""
  return cpu.wide_linear(x, w) if backend(kernels) == "cpu" else xla.wide_linear(x, w)


def decode_attention(q: jax.Array, segments, scale: float, kernels: str = "xla") -> jax.Array:
  """Attention of q [N, T, Nq, H] over keys and values held in several segments.

  segments: (k [R, K, H, S], v [R, K, S, H], visible, g) tuples, one softmax
  over all of them. A segment holds R = N / g rows, each shared by g
  consecutive query rows (a group's prompt is stored once and read by its g
  samples); visible is a bool mask broadcastable to [N, T, S], or None for all.
  Scores, softmax and the sum over segments in float32; returns q's dtype.
  """
  N, T, Nq, H = q.shape
  K = segments[0][0].shape[1]
  m = T * (Nq // K)
  q = (q * scale).astype(q.dtype)
  q = q.reshape(N, T, K, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, K, m, H)
  impl = cpu.segment_attention if backend(kernels) == "cpu" else xla.segment_attention
  out = impl(q, segments, T=T)
  return out.reshape(N, K, T, Nq // K, H).transpose(0, 2, 1, 3, 4).reshape(N, T, Nq, H).astype(q.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_valid: jax.Array, q_slot: jax.Array,
              kv_slot: jax.Array, scale: float, *, block: int, kernels: str = "xla") -> jax.Array:
  """Causal attention over a whole sequence without its [T, S] scores: q [B, T, Nq, H]
  over k, v [B, S, K, H] (K divides Nq), in key blocks of `block` with an online
  softmax, the backward recomputing each block (memory O(T · block)).

  Query t sees key s when kv_slot[s] <= q_slot[t] and (kv_valid[b, s] or the
  slots are equal): kv_valid [B, S] bool, q_slot [T], kv_slot [S] int. That is
  `models.cache.attention_mask`'s causal + left-padding mask, and the shared
  prompt's (a group's completions at slots P.. over its prompt's keys at 0..P-1).
  Returns [B, T, Nq, H] in q's dtype. Every backend runs the `xla` blockwise
  reference today; the TPU and GPU kernels slot in here.
  """
  backend(kernels)  # an unknown name fails here
  return xla.blockwise_attention(q, k, v, kv_valid, q_slot, kv_slot, scale, block)


def categorical(rng: jax.Array, logits: jax.Array, kernels: str = "xla") -> jax.Array:
  """One draw per row from softmax(logits): [B, V] -> [B] int32; -inf logits are never drawn."""
  return (cpu.categorical if backend(kernels) == "cpu" else xla.categorical)(rng, logits)


def packs_weights(kernels: str, dtype) -> bool:
  """Whether decode weights are packed for the native dense kernel (cpu backend, float32)."""
  return backend(kernels) == "cpu" and jnp.dtype(dtype) == jnp.float32
