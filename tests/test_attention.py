"""Blockwise attention (grpojax.ops.attention): the same outputs and gradients as
the materialised softmax(q·kᵀ) with the same mask, through every long forward,
in memory linear in the sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax import models, ops
from grpojax.models import cache as cache_lib
from grpojax.models import transformer


def _materialised(q, k, v, kv_valid, q_slot, kv_slot):
  mask = cache_lib.attention_mask(kv_valid, q_slot, kv_slot)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=q.shape[-1]**-0.5,
                                      implementation="xla")


@pytest.mark.parametrize("block", [4, 16, 64])
@pytest.mark.parametrize("layout", ["causal", "shared_prompt"])
def test_outputs_and_gradients_equal_the_materialised_attention(block, layout):
  rng = np.random.default_rng(block)
  B, T, Nq, K, H = 2, 29, 6, 2, 8  # 3 query heads per kv head; T not a multiple of block
  P = 0 if layout == "causal" else 11  # completions at slots P.. over their prompt's keys
  S = P + T
  q = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32) for _ in range(2))
  kv_valid = np.ones((B, S), bool)
  kv_valid[0, :5] = False  # left padding
  kv_valid[1, P + 20:] = False  # a completion that ended
  kv_valid = jnp.asarray(kv_valid)
  q_slot, kv_slot = P + jnp.arange(T), jnp.arange(S)
  w = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32)

  def loss(f, *qkv):
    return jnp.sum(f(*qkv, kv_valid, q_slot, kv_slot) * w)

  blockwise = lambda *a: ops.attention(*a, H**-0.5, block=block)  # noqa: E731
  np.testing.assert_allclose(blockwise(q, k, v, kv_valid, q_slot, kv_slot),
                             _materialised(q, k, v, kv_valid, q_slot, kv_slot), atol=1e-5)
  got = jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(lambda *a: loss(_materialised, *a), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-5)


def test_every_long_forward_equals_its_materialised_self():
  """forward, the prompt prefill and forward_shared_prompt, with keys longer than
  the block (so blockwise) against attention_block=0 (never): same hidden states
  and the same gradient of a loss through them."""
  model = models.build_model("qwen2_tiny", seed=3)
  params = model.param_dict()
  short = model.config.replace(attention_block=0)
  long = model.config.replace(attention_block=8)
  rng = np.random.default_rng(0)
  B, G, P, T = 2, 2, 13, 21
  prompts = jnp.asarray(rng.integers(3, 256, (B, P)), jnp.int32)
  pmask = jnp.asarray(np.arange(P)[None] >= np.array([[0], [4]]))  # left padding
  tokens = jnp.asarray(rng.integers(3, 256, (B * G, T)), jnp.int32)
  mask = jnp.asarray(np.arange(T)[None] < np.array([[21], [9], [15], [1]]))

  for cfg_a, cfg_b in [(short, long)]:
    full_a = transformer.forward(cfg_a, params, tokens, mask=mask)
    full_b = transformer.forward(cfg_b, params, tokens, mask=mask)
    np.testing.assert_allclose(full_a, full_b, atol=2e-5)
    hidden_a, cache_a = transformer.prefill(cfg_a, params, prompts, pmask, group=G,
                                            max_new_tokens=4)
    hidden_b, cache_b = transformer.prefill(cfg_b, params, prompts, pmask, group=G,
                                            max_new_tokens=4)
    np.testing.assert_allclose(hidden_a, hidden_b, atol=2e-5)
    np.testing.assert_allclose(cache_a.prompt_k[0], cache_b.prompt_k[0], atol=2e-5)

  def objective(cfg, params):
    hp, hc = transformer.forward_shared_prompt(cfg, params, prompts, pmask, tokens, mask)
    return jnp.sum(hc * mask[..., None]) + jnp.sum(hp * pmask[..., None])

  np.testing.assert_allclose(objective(short, params), objective(long, params), rtol=1e-5)
  got = jax.grad(lambda p: objective(long, p))(params)
  want = jax.grad(lambda p: objective(short, p))(params)
  for name in ("wq", "wk", "wv", "embed"):
    np.testing.assert_allclose(got[name], want[name], atol=1e-4, rtol=1e-4)


def _attention_temp_bytes(S: int, block: int) -> int:
  """Temporary bytes of one attention layer's forward and backward at length S."""
  B, Nq, K, H = 1, 4, 2, 16
  q = jax.ShapeDtypeStruct((B, S, Nq, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
  valid = jax.ShapeDtypeStruct((B, S), jnp.bool_)

  def loss(q, k, v, valid):
    slots = jnp.arange(S)
    if block:
      out = ops.attention(q, k, v, valid, slots, slots, H**-0.5, block=block)
    else:
      out = _materialised(q, k, v, valid, slots, slots)
    return jnp.sum(out)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_temporary_memory_is_linear_in_the_sequence():
  blockwise = {S: _attention_temp_bytes(S, 512) for S in (2048, 8192)}
  # 4x the length, 4x the memory (and nothing near the scores: 8192² x 4 heads x 4 B
  # would be 1 GiB for one layer).
  assert blockwise[8192] <= 4.5 * blockwise[2048]
  assert blockwise[8192] < 64 * 2**20
  materialised = _attention_temp_bytes(2048, 0)
  assert materialised > 4 * blockwise[2048]  # the square, already at 2k
