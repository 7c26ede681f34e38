"""What both samplers (sampler.py's lockstep, engine.py's paged engine) take and return.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class SampleOutput:
  """What `generate` returns; every array has N = B*G rows, groups contiguous.

  tokens: [N, T] int32 completion tokens, the first EOS included, pad_id after it.
  mask: [N, T] int32, 1 on completion tokens (through the first EOS), else 0.
  logps: [N, T] float32 log-prob of each token under softmax(logits / temperature)
    over the full vocabulary (0 where mask is 0).
  lengths: [N] int32 tokens per completion (= mask.sum(-1)).
  truncated: [N] bool, rows that reached T tokens without an EOS.
  loss_mask: [N, T] int32, 1 on the tokens the policy sampled (to be trained),
    0 on tokens that joined a completion from outside it (a tool's response:
    they exist, are attended to and have positions, but are never trained) and
    where mask is 0; None: every token of mask is the policy's (both samplers).
  """

  tokens: Array
  mask: Array
  logps: Array
  lengths: Array
  truncated: Array
  loss_mask: Array | None = None



def checked_inputs(prompt_tokens, prompt_mask, *, eos_ids, num_samples: int, max_new_tokens: int):
  """(eos ids as a tuple, prompt_tokens [B, P] int32, prompt_mask [B, P]) for either
  sampler, or a ValueError that says what is wrong."""
  eos = (eos_ids,) if isinstance(eos_ids, int) else tuple(int(e) for e in eos_ids)
  if not eos:
    raise ValueError("eos_ids is empty: give at least one end-of-sequence id")
  if num_samples < 1 or max_new_tokens < 1:
    raise ValueError(f"num_samples={num_samples} and max_new_tokens={max_new_tokens} must be >= 1")
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  if prompt_tokens.ndim != 2 or prompt_mask.shape != prompt_tokens.shape:
    raise ValueError(
        f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} must both be [B, P]")
  return eos, prompt_tokens, jnp.asarray(prompt_mask)
