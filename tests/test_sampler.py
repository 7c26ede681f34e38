"""generate(): greedy equals uncached argmax and HF transformers, log-probs equal the
trainer's, EOS handling, sampling frequencies, no retrace, and sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from scipy import stats

from grpojax import models
from grpojax.core import logprobs
from grpojax.sampling import sampler

PROMPTS = jnp.array([[0, 0, 0, 5, 6, 7], [3, 4, 9, 5, 6, 7], [0, 11, 12, 13, 14, 15]], jnp.int32)
MASK = (jnp.arange(6)[None] >= jnp.array([[3], [0], [1]])).astype(jnp.int32)
NEVER = 127  # an id the tiny model is not asked to stop on unless a test says so


@pytest.fixture(scope="module")
def model():
  return models.build_model("tiny", seed=0)


def _real_prompt(b):
  return [int(t) for t, m in zip(PROMPTS[b], MASK[b]) if m]


def _greedy_reference(model, prompts, steps, eos=()):
  """Uncached argmax decoding: one full forward per token over unpadded prompts.

  Sequences are right-padded to one fixed width, which a causal model cannot see
  from earlier positions, so a single compiled forward serves every step.
  """
  width = max(map(len, prompts)) + steps
  forward = jax.jit(model)
  seqs, done = [list(p) for p in prompts], [False] * len(prompts)
  for _ in range(steps):
    batch = jnp.array([s + [0] * (width - len(s)) for s in seqs])
    logits = forward(batch)
    for i, s in enumerate(seqs):
      if not done[i]:
        s.append(int(jnp.argmax(logits[i, len(s) - 1])))
        done[i] = s[-1] in eos
  return [s[len(p):] for s, p in zip(seqs, prompts)]


# 40 new tokens: 39 cache writes, across several of the attention kernel's 16-slot blocks.
@pytest.mark.slow
@pytest.mark.parametrize("steps", [6, 40])
def test_greedy_left_padded_matches_uncached_argmax(model, steps):
  out = sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=2,
                         max_new_tokens=steps, temperature=0.0, eos_ids=NEVER, pad_id=0)
  assert out.tokens.shape == (6, steps)
  refs = _greedy_reference(model, [_real_prompt(b) for b in range(3)], steps)
  for b in range(3):
    for g in range(2):  # rows b*G .. b*G+G-1 belong to prompt b
      assert out.tokens[b * 2 + g].tolist() == refs[b]


@pytest.mark.slow
def test_eos_ends_a_row_and_pads_after_it(model):
  first = sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=1,
                           max_new_tokens=6, temperature=0.0, eos_ids=NEVER, pad_id=0)
  row0 = first.tokens[0].tolist()
  eos = row0[2] if row0[2] not in row0[:2] else row0[0]
  stop = row0.index(eos)
  out = sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=1,
                         max_new_tokens=6, temperature=0.0, eos_ids=[NEVER, eos], pad_id=0)
  refs = _greedy_reference(model, [_real_prompt(b) for b in range(3)], 6, eos=(eos,))
  for b, ref in enumerate(refs):
    n = len(ref)
    assert out.tokens[b, :n].tolist() == ref
    assert out.tokens[b, n:].tolist() == [0] * (6 - n)
    assert out.mask[b].tolist() == [1] * n + [0] * (6 - n)
    assert int(out.lengths[b]) == n
    assert bool(out.truncated[b]) == (ref[-1] != eos)
  assert int(out.lengths[0]) == stop + 1 and not bool(out.truncated[0])


@pytest.mark.slow
@pytest.mark.parametrize("steps", [8, 40])
def test_sampled_logps_equal_teacher_forced_logprobs(model, steps):
  temperature = 0.8
  out = sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(1), num_samples=4,
                         max_new_tokens=steps, temperature=temperature, top_k=20, top_p=0.95,
                         eos_ids=[5, 9], pad_id=0)
  if steps > 16:  # some rows stop in a later chunk, some run to the end
    assert 16 < int(out.lengths.max()) and int(out.lengths.min()) < steps
  full = jnp.concatenate([jnp.repeat(PROMPTS, 4, axis=0), out.tokens], axis=1)
  full_mask = jnp.concatenate([jnp.repeat(MASK, 4, axis=0), out.mask], axis=1)
  logits = model(full, mask=full_mask)[:, 5:-1]  # position t predicts token t + 1
  ref = logprobs.token_logprobs(logits, out.tokens, temperature=temperature)
  m = np.asarray(out.mask) > 0
  assert m.sum() > 0
  np.testing.assert_allclose(np.asarray(out.logps)[m], np.asarray(ref)[m], atol=1e-4)
  assert np.all(np.asarray(out.logps)[~m] == 0)


@pytest.mark.slow
def test_first_token_frequencies_match_the_models_softmax(model):
  temperature, n = 1.5, 4000
  out = sampler.generate(model, PROMPTS[1:2], MASK[1:2], rng=jax.random.key(2), num_samples=n,
                         max_new_tokens=1, temperature=temperature, eos_ids=NEVER, pad_id=0)
  logits = np.asarray(model(PROMPTS[1:2])[0, -1], np.float64) / temperature
  p = np.exp(logits - logits.max())
  p /= p.sum()
  counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=p.size)
  big = p * n >= 5  # chi-square needs expected counts >= 5: pool the rest
  obs, exp = counts[big], p[big] * n
  if (~big).any():
    obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, p[~big].sum() * n)
  assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_same_shapes_do_not_retrace(model):
  kw = dict(num_samples=2, max_new_tokens=4, temperature=1.0, eos_ids=NEVER, pad_id=0)
  sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(3), **kw)
  before = sampler.generate_program._cache_size()
  other = sampler.generate(model, PROMPTS + 1, MASK, rng=jax.random.key(4), **kw)
  other.tokens.block_until_ready()
  assert sampler.generate_program._cache_size() == before


@pytest.mark.slow
def test_sharded_over_8_devices_gives_the_same_greedy_output(model):
  assert jax.device_count() == 8
  kw = dict(rng=jax.random.key(0), num_samples=8, max_new_tokens=5, temperature=0.0,
            eos_ids=NEVER, pad_id=0)
  ref = sampler.generate(model, PROMPTS, MASK, **kw)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  sharded = models.shard_model(model, mesh)
  out = sampler.generate(sharded, PROMPTS, MASK, mesh=mesh, **kw)
  assert out.tokens.tolist() == ref.tokens.tolist()
  assert len(out.tokens.sharding.device_set) > 1
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5)


def test_bucket_length():
  assert sampler.bucket_length(5, [32, 8, 16]) == 8
  assert sampler.bucket_length(16, [8, 16]) == 16
  with pytest.raises(ValueError, match="exceeds the largest bucket"):
    sampler.bucket_length(17, [8, 16])


def test_bad_arguments_raise(model):
  with pytest.raises(ValueError, match="eos_ids"):
    sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=1,
                     max_new_tokens=2, eos_ids=[], pad_id=0)
  with pytest.raises(ValueError, match="top_p"):
    sampler.generate(model, PROMPTS, MASK, rng=jax.random.key(0), num_samples=1,
                     max_new_tokens=2, top_p=0.0, eos_ids=1, pad_id=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_greedy_equals_hf_generate_on_a_left_padded_batch(kind, tmp_path):
  H = pytest.importorskip("test_models_helpers")
  torch = H.torch
  hf = H.hf_model(kind, seed=1)
  hf.save_pretrained(tmp_path)
  ours = models.from_pretrained(str(tmp_path), dtype="float32")
  tokens, mask = H.left_padded(np.random.default_rng(0), [3, 7, 5], 7, vocab=97)
  steps = 8

  def hf_greedy(eos):
    with torch.no_grad():
      seqs = hf.generate(torch.tensor(tokens, dtype=torch.long),
                         attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                         max_new_tokens=steps, min_new_tokens=0, eos_token_id=eos, pad_token_id=0)
    new = seqs[:, tokens.shape[1]:].numpy()
    return np.pad(new, ((0, 0), (0, steps - new.shape[1])))  # HF stops when all rows are done

  never = hf_greedy([96])
  assert not (never == 96).any()
  eos = int(never[1, 3])  # stops row 1 after 4 tokens (or earlier), others maybe never
  expected = hf_greedy([eos])
  out = sampler.generate(ours, jnp.asarray(tokens), jnp.asarray(mask), rng=jax.random.key(0),
                         num_samples=1, max_new_tokens=steps, temperature=0.0, eos_ids=[eos],
                         pad_id=0)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)
  assert bool(out.truncated[1]) is False
