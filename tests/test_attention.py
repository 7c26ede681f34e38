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


def _materialised(q, k, v, kv_valid):
  T, S = q.shape[1], k.shape[1]
  mask = cache_lib.attention_mask(kv_valid, jnp.arange(S - T, S), jnp.arange(S))
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=q.shape[-1]**-0.5,
                                      implementation="xla")


@pytest.mark.slow
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
  w = jnp.asarray(rng.normal(size=(B, T, Nq, H)), jnp.float32)

  def loss(f, *qkv):
    return jnp.sum(f(*qkv, kv_valid) * w)

  blockwise = lambda *a: ops.attention(*a, H**-0.5, block=block)  # noqa: E731
  np.testing.assert_allclose(blockwise(q, k, v, kv_valid), _materialised(q, k, v, kv_valid),
                             atol=1e-5)
  got = jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(lambda *a: loss(_materialised, *a), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-5)


@pytest.mark.slow
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

  np.testing.assert_allclose(transformer.forward(long, params, tokens, mask=mask),
                             transformer.forward(short, params, tokens, mask=mask), atol=2e-5)
  prefill = lambda cfg: transformer.prefill(cfg, params, prompts, pmask, group=G,  # noqa: E731
                                            max_new_tokens=4)
  (hidden_b, cache_b), (hidden_a, cache_a) = prefill(long), prefill(short)
  np.testing.assert_allclose(hidden_b, hidden_a, atol=2e-5)
  np.testing.assert_allclose(cache_b.prompt_k[0], cache_a.prompt_k[0], atol=2e-5)

  def objective(cfg, params):
    hp, hc = transformer.forward_shared_prompt(cfg, params, prompts, pmask, tokens, mask)
    return jnp.sum(hc * mask[..., None]) + jnp.sum(hp * pmask[..., None])

  np.testing.assert_allclose(objective(short, params), objective(long, params), rtol=1e-5)
  got = jax.grad(lambda p: objective(long, p))(params)
  want = jax.grad(lambda p: objective(short, p))(params)
  # The gradients reach a few hundred: float32's reordered sums (blockwise against
  # materialised, and however XLA orders them) differ by ~1e-6 of the largest entry.
  for name in ("wq", "wk", "wv", "embed"):
    scale = float(np.abs(want[name]).max())
    np.testing.assert_allclose(got[name], want[name], atol=2e-6 * scale, rtol=1e-4)


def _attention_temp_bytes(S: int, block: int) -> int:
  """Temporary bytes of one attention layer's forward and backward at length S."""
  B, Nq, K, H = 1, 4, 2, 16
  q = jax.ShapeDtypeStruct((B, S, Nq, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
  valid = jax.ShapeDtypeStruct((B, S), jnp.bool_)

  def loss(q, k, v, valid):
    if block:
      out = ops.attention(q, k, v, valid, H**-0.5, block=block)
    else:
      out = _materialised(q, k, v, valid)
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


@pytest.mark.slow
def test_logits_at_4096_tokens_equal_transformers(tmp_path):
  """A 4,096-token left-padded sequence (blockwise: past model.attention_block) gives
  HF transformers' eager-attention logits, in float32."""
  import test_models_helpers as H

  S = 4096
  hf = H.hf_model("qwen2", seed=4, max_position_embeddings=S)
  hf.save_pretrained(tmp_path / "hf")
  model = models.from_pretrained(str(tmp_path / "hf"), dtype="float32")
  assert 0 < model.config.attention_block < S
  tokens, mask = H.left_padded(np.random.default_rng(5), [S - 300], S, hf.config.vocab_size)
  ours = transformer.forward(model.config, model.param_dict(), jnp.asarray(tokens),
                             mask=jnp.asarray(mask))
  ours = np.asarray(transformer.unembed(model.config, model.param_dict(), ours))
  want = H.hf_logits(hf, tokens, mask)
  # To 1e-5 of the logits' scale (|logit| reaches ~70 here; float32 sums over 4k keys).
  np.testing.assert_allclose(ours[mask], want[mask], atol=1e-5 * np.abs(want[mask]).max(), rtol=0)


@pytest.mark.slow
def test_4k_sampled_tokens_rescore_to_the_samplers_logps():
  """Decoding (the cache, RoPE at positions past 4k) and the blockwise training
  forward agree at long positions: the sampler's log-probs of 4,096 tokens equal
  the teacher-forced ones, in float32."""
  from grpojax.core import logprobs
  from grpojax.sampling import sampler

  model = models.build_model("qwen2_tiny", seed=6, max_position_embeddings=8192)
  prompts = jnp.array([[0, 0, 5, 6, 7], [3, 4, 9, 5, 6]], jnp.int32)
  mask = (prompts > 0).astype(jnp.int32)
  T, temperature = 4096, 0.9
  out = sampler.generate(model, prompts, mask, rng=jax.random.key(7), num_samples=1,
                         max_new_tokens=T, temperature=temperature, eos_ids=[10**6], pad_id=0)
  assert int(out.lengths.min()) == T
  full = jnp.concatenate([prompts, out.tokens], axis=1)
  full_mask = jnp.concatenate([mask, out.mask], axis=1)
  assert 0 < model.config.attention_block < full.shape[1]  # the blockwise path
  logits = model(full, mask=full_mask)[:, prompts.shape[1] - 1:-1]
  ref = logprobs.token_logprobs(logits, out.tokens, temperature=temperature)
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref), atol=1e-5)


def _logps_program_temp_bytes(T: int, *, block: int) -> int:
  """Temporary bytes of the update's forward and backward (the completion log-probs
  of 2 prompts x 2 rows sharing each, P=64 + T) for the tiny model."""
  from grpojax.train import rollout as rollout_lib

  cfg = models.get_preset("tiny", attention_block=block)
  specs = transformer.param_specs(cfg)
  params = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, (s, _) in specs.items()}
  N, P, G = 4, 64, 2
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

  def loss(params, pt, pm, t, m):
    return jnp.sum(rollout_lib.completion_logps(cfg, params, pt, pm, t, m, group_size=G))

  compiled = jax.jit(jax.grad(loss)).lower(params, i32(N, P), i32(N, P), i32(N, T),
                                           i32(N, T)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_the_updates_memory_is_linear_in_the_completion_length():
  """Forward and backward of the trained log-probs through the layer scan (the
  shared-prompt forward the update runs): 4x the length, at most ~4x the memory.
  Before the mask was tied to the scores, JAX hoisted every block's mask out of
  the layer scan: 512 MiB of them at 8k here, the square again."""
  short, long = (_logps_program_temp_bytes(T, block=512) for T in (2048, 8192))
  assert long <= 4.5 * short
  squared = _logps_program_temp_bytes(2048, block=0)
  assert squared > 2 * short  # what the materialised scores cost already at 2k
