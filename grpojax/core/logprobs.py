"""Per-token log-probabilities and entropies of completion tokens.

Axes: N rows, T completion positions, D model width, V vocabulary.

The `[N, T, V]` logits tensor is the largest thing in a GRPO update (V = 152k
for Qwen), so `chunked_token_logprobs` computes the same quantities from the
final hidden states and the unembedding matrix one chunk of tokens at a time,
recomputing each chunk's logits in the backward pass instead of storing them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _scaled_log_softmax(logits: Array, temperature: float) -> Array:
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(
        f"temperature={temperature} must be > 0 for log-probs (greedy sampling"
        " has no log-prob of its own; score it at temperature 1)"
    )
  # Statistics in float32 whatever the compute dtype: bf16 log-softmax over a
  # large vocabulary loses ~1e-2 in log-probs, more than the clip range cares about.
  return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _entropy_from_logp(logp: Array) -> Array:
  """-sum(p log p) over the last axis, for log-probs that may be -inf."""
  # exp(logp) * logp is 0 * -inf = NaN for masked-out (-inf) logits: zero those.
  # The inner `where` keeps that NaN out of the gradient too (the outer one
  # alone zeroes the value, but its backward pass multiplies 0 by NaN).
  finite = jnp.isfinite(logp)
  safe = jnp.where(finite, logp, 0.0)
  return -jnp.sum(jnp.where(finite, jnp.exp(safe) * safe, 0.0), axis=-1)


def token_logprobs(logits: Array, targets: Array, *, temperature: float = 1.0) -> Array:
  """Log-probability of each target token under `softmax(logits / temperature)`.

  Args:
    logits: [N, T, V], position t's logits predict targets[:, t].
    targets: [N, T] int token ids.
    temperature: the sampling temperature (as TRL: the policy being trained is
      the tempered distribution the samples came from). Must be > 0.

  Returns:
    [N, T] float32.
  """
  logp_NTV = _scaled_log_softmax(logits, temperature)
  return jnp.take_along_axis(logp_NTV, targets[..., None], axis=-1)[..., 0]


def entropy(logits: Array, *, temperature: float = 1.0) -> Array:
  """Entropy of `softmax(logits / temperature)` at each position.

  Args:
    logits: [N, T, V].

  Returns:
    [N, T] float32, in nats.
  """
  return _entropy_from_logp(_scaled_log_softmax(logits, temperature))


def token_logprobs_and_entropy(
    logits: Array, targets: Array, *, temperature: float = 1.0
) -> tuple[Array, Array]:
  """Both of the above from one log-softmax. Shapes as `token_logprobs`."""
  logp_NTV = _scaled_log_softmax(logits, temperature)
  logps = jnp.take_along_axis(logp_NTV, targets[..., None], axis=-1)[..., 0]
  return logps, _entropy_from_logp(logp_NTV)


def soft_cap(x: Array, cap: float | None) -> Array:
  """cap * tanh(x / cap), Gemma's soft-capping of attention scores and final logits;
  x itself for cap None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def chunked_token_logprobs(
    hidden: Array,
    unembedding: Array,
    targets: Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    softcap: float | None = None,
) -> Array | tuple[Array, Array]:
  """`token_logprobs` from hidden states, never holding more than `[chunk_size, V]` logits.

  The N*T token positions are cut into chunks of `chunk_size` tokens; a
  `lax.scan` computes each chunk's logits (`hidden @ unembedding`), log-softmax
  and gather under `jax.checkpoint`, so the backward pass recomputes a chunk's
  logits rather than keeping all of them alive.

  Args:
    hidden: [N, T, D] final (normed) hidden states; position t predicts targets[:, t].
    unembedding: [D, V] output projection (the transposed embedding when tied).
    targets: [N, T] int.
    temperature: sampling temperature, > 0.
    chunk_size: tokens per chunk; the peak extra memory is ~chunk_size * V * 4 bytes.
    with_entropy: also return per-token entropies.
    softcap: the model's final logit soft-capping, softcap * tanh(logits / softcap)
      (Gemma 2/3's final_logit_softcapping), applied to each chunk's logits; None: none.

  Returns:
    logps [N, T] float32, and entropies [N, T] float32 if `with_entropy`.
  """
  n, t, d = hidden.shape
  tokens = n * t
  chunk = min(chunk_size, tokens)
  num_chunks = -(-tokens // chunk)
  pad = num_chunks * chunk - tokens
  h_CkD = jnp.pad(hidden.reshape(tokens, d), ((0, pad), (0, 0))).reshape(num_chunks, chunk, d)
  y_Ck = jnp.pad(targets.reshape(tokens), (0, pad)).reshape(num_chunks, chunk)

  @jax.checkpoint
  def one_chunk(h_kD, y_k):
    logits_kV = soft_cap(jnp.dot(h_kD, unembedding, preferred_element_type=jnp.float32),
                         softcap)
    logp_kV = _scaled_log_softmax(logits_kV, temperature)
    logps_k = jnp.take_along_axis(logp_kV, y_k[:, None], axis=-1)[:, 0]
    if not with_entropy:
      return logps_k, None
    return logps_k, _entropy_from_logp(logp_kV)

  def body(carry, xs):
    return carry, one_chunk(*xs)

  _, (logps_Ck, ent_Ck) = jax.lax.scan(body, None, (h_CkD, y_Ck))
  logps_NT = logps_Ck.reshape(-1)[:tokens].reshape(n, t)
  if not with_entropy:
    return logps_NT
  return logps_NT, ent_Ck.reshape(-1)[:tokens].reshape(n, t)
