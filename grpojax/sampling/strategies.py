"""Sampling strategies as pure functions of one decode step's logits.

Axes: B rows, V vocabulary.

The order is temperature, then top-k, top-p and min-p on the tempered
distribution (as HF transformers and vLLM). The truncations only decide which
tokens may be drawn; the log-prob reported for a drawn token is always under
the full `softmax(logits / temperature)`, the quantity the trainer recomputes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpojax import ops

Array = jax.Array
_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable: part of the jitted program's identity).

  temperature: 0 is greedy.
  top_k: keep the k most likely tokens; 0 is off.
  top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 is off.
  min_p: keep tokens with probability >= min_p * max probability; 0 is off.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 is off)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if not 0 <= self.min_p < 1:
      raise ValueError(f"min_p={self.min_p} must be in [0, 1)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def top_k_mask(logits: Array, k: int) -> Array:
  """Logits with all but the k largest per row set to -inf (ties at the k-th kept).

  logits: [B, V] -> [B, V].
  """
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits >= kth, logits, _NEG_INF)


def top_p_mask(logits: Array, p: float) -> Array:
  """Nucleus: keep the most likely tokens until their mass first reaches p.

  The token that crosses p is kept, so the most likely token always survives.
  logits: [B, V] -> [B, V].
  """
  if p >= 1.0:
    return logits
  sorted_desc = -jnp.sort(-logits, axis=-1)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < p
  # The smallest kept logit is the threshold; everything at or above it stays.
  threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits >= threshold, logits, _NEG_INF)


def min_p_mask(logits: Array, min_p: float) -> Array:
  """Keep tokens whose probability is at least min_p times the largest one's.

  In log space: logit >= max_logit + log(min_p). logits: [B, V] -> [B, V].
  """
  if min_p <= 0.0:
    return logits
  cutoff = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)
  return jnp.where(logits >= cutoff, logits, _NEG_INF)


def filtered_logits(logits: Array, sampling: SamplingParams) -> Array:
  """Tempered logits with the truncations applied; -inf marks excluded tokens.

  logits: [B, V] -> [B, V] float32. Requires temperature > 0.
  """
  x = logits.astype(jnp.float32) / sampling.temperature
  x = top_k_mask(x, sampling.top_k)
  x = top_p_mask(x, sampling.top_p)
  return min_p_mask(x, sampling.min_p)


def sample(rng: Array, logits: Array, sampling: SamplingParams,
           kernels: str = "xla") -> tuple[Array, Array]:
  """Draws one token per row.

  Args:
    rng: a PRNG key.
    logits: [B, V] this step's logits.
    sampling: SamplingParams.
    kernels: the grpojax.ops backend that draws (ModelConfig.kernels).

  Returns:
    tokens [B] int32, and logps [B] float32: each token's log-prob under the
    full softmax(logits / temperature) (temperature 1 when greedy).
  """
  logits = logits.astype(jnp.float32)
  if sampling.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp_BV = jax.nn.log_softmax(logits, axis=-1)
  else:
    tokens = ops.categorical(rng, filtered_logits(logits, sampling), kernels)
    logp_BV = jax.nn.log_softmax(logits / sampling.temperature, axis=-1)
  return tokens, jnp.take_along_axis(logp_BV, tokens[:, None], axis=-1)[:, 0]


def sample_rows(keys: Array, logits: Array, sampling: SamplingParams) -> tuple[Array, Array]:
  """`sample` with a key per row: keys [B] (typed or raw), logits [B, V] -> tokens [B]
  int32 and their logps [B]. Row b's draw depends on keys[b] and its logits alone, not
  on the rows beside it (the rollout engine's rows move between slots)."""
  logits = logits.astype(jnp.float32)
  if sampling.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp_BV = jax.nn.log_softmax(logits, axis=-1)
  else:
    filtered = filtered_logits(logits, sampling)
    tokens = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filtered).astype(jnp.int32)
    logp_BV = jax.nn.log_softmax(logits / sampling.temperature, axis=-1)
  return tokens, jnp.take_along_axis(logp_BV, tokens[:, None], axis=-1)[:, 0]
