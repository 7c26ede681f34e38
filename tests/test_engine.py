"""The rollout engine (sampling/engine.py): greedy equals the lockstep sampler and uncached
argmax whatever the slots, pages and preemptions; samples do not depend on them; their
frequencies and log-probs match a full forward; paged attention reads no stale entries;
EOS and the stop hook; config validation; stats.

Compiles dominate the runtime: runs are cached by their static arguments and share
(G, T) = (2, 12), so each engine config below is compiled once per sampling setting.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpojax import models, ops
from grpojax.models import cache as cache_lib
from grpojax.ops import xla as xla_ops
from grpojax.sampling import engine, sampler, strategies

PROMPTS = jnp.array([[0, 0, 0, 5, 6, 7], [3, 4, 9, 5, 6, 7], [0, 11, 12, 13, 14, 15]], jnp.int32)
MASK = (jnp.arange(6)[None] >= jnp.array([[3], [0], [1]])).astype(jnp.int32)
NEVER = 127  # an id the tiny model is not asked to stop on unless a test says so
G, T = 2, 12  # N = 6 rows
N = 3 * G

GREEDY = strategies.SamplingParams(0.0)
SAMPLED = strategies.SamplingParams(1.0)
FILTERED = strategies.SamplingParams(1.0, top_k=8, top_p=0.8)
EOS_SAMPLED = tuple(range(1, 9))  # ~6% a step at temperature 1: rows end at varied lengths

ALL = engine.EngineConfig(page_size=4)  # S = N = 6 slots, M = 18: every row at once
REFILL = engine.EngineConfig(slots=2, page_size=4)  # rows wait for slots, 3 pages each
PREEMPT = engine.EngineConfig(slots=4, page_size=4, pages=5)  # 4 rows need 8 pages at token 5
PREEMPT8 = engine.EngineConfig(slots=3, page_size=8, pages=2)  # other page size, preempts
ONE_SLOT = engine.EngineConfig(slots=1, page_size=4, pages=3)  # rows reuse one slot's pages
# The tail narrowed: 6 slots, then 4 once at most 4 run, then 2, with a pool of 8 pages
# of 2: rows are preempted before and after narrowing.
TAIL = engine.EngineConfig(page_size=2, pages=8, tail_slots=(4, 2))
RAGGED = (3, 12, 5, 9, 2, 7)  # stop_at: rows end one after another


@pytest.fixture(scope="module")
def tiny():
  m = models.build_model("tiny", seed=0)
  return m, ops.resolve(m.config), m.param_dict()


@pytest.fixture(scope="module")
def run(tiny):
  """engine.generate with stats, memoized: tests that share a run share its compile."""
  _, cfg, weights = tiny
  done = {}

  def go(ec, sampling=GREEDY, seed=0, eos=(NEVER,), stop_at=None, steps=T, prompts=None,
         group=G):
    key = (ec, sampling, seed, eos, stop_at, steps, prompts, group)
    if key not in done:
      tokens, mask = (PROMPTS, MASK) if prompts is None else prompts_of(prompts)
      done[key] = engine.generate(
          cfg, weights, tokens, mask, rng=jax.random.key(seed), num_samples=group,
          max_new_tokens=steps, sampling=sampling, eos_ids=eos, pad_id=0, engine=ec,
          with_stats=True, stop_at=None if stop_at is None else jnp.array(stop_at, jnp.int32))
    return done[key]

  return go


def prompts_of(rows):
  return PROMPTS[jnp.array(rows)], MASK[jnp.array(rows)]


def _real_prompt(b):
  return [int(t) for t, m in zip(PROMPTS[b], MASK[b]) if m]


def _greedy_reference(model, prompts, steps):
  """Uncached argmax decoding: one full forward per token over unpadded prompts.

  Sequences are right-padded to one fixed width, which a causal model cannot see
  from earlier positions, so a single compiled forward serves every step.
  """
  width = max(map(len, prompts)) + steps
  forward = jax.jit(model)
  seqs = [list(p) for p in prompts]
  for _ in range(steps):
    logits = forward(jnp.array([s + [0] * (width - len(s)) for s in seqs]))
    for i, s in enumerate(seqs):
      s.append(int(jnp.argmax(logits[i, len(s) - 1])))
  return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def greedy_refs(tiny):
  """[3] lists of T argmax tokens, one per prompt (no EOS)."""
  return _greedy_reference(tiny[0], [_real_prompt(b) for b in range(3)], T)


@pytest.fixture(scope="module")
def lockstep(tiny):
  _, cfg, weights = tiny
  return sampler.generate_from_params(cfg, weights, PROMPTS, MASK, rng=jax.random.key(0),
                                      num_samples=G, max_new_tokens=T, sampling=GREEDY,
                                      eos_ids=NEVER, pad_id=0)


def _assert_greedy(out, lockstep, greedy_refs):
  for r in range(N):  # rows b*G .. b*G+G-1 belong to prompt b
    assert out.tokens[r].tolist() == greedy_refs[r // G], f"row {r}"
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(lockstep.tokens))
  np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(lockstep.mask))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(lockstep.lengths))
  np.testing.assert_array_equal(np.asarray(out.truncated), np.asarray(lockstep.truncated))
  assert np.all(np.asarray(out.lengths) == T) and np.all(np.asarray(out.mask) == 1)
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(lockstep.logps), atol=1e-5)


# ------------------------------------------------------------------ 1. greedy


@pytest.mark.slow
@pytest.mark.parametrize("ec", [ALL, REFILL, PREEMPT], ids=["all_slots", "refill", "preempt"])
def test_greedy_equals_lockstep_and_uncached_argmax(run, lockstep, greedy_refs, ec):
  out, st = run(ec)
  _assert_greedy(out, lockstep, greedy_refs)
  if ec is PREEMPT:
    assert int(st.preempted) > 0  # the pool of 5 pages cannot hold 4 rows past token 4
  else:
    assert int(st.preempted) == 0  # the default pool holds every slot at full length


def test_generate_from_params_dispatches_to_the_engine(tiny, run):
  _, cfg, weights = tiny
  out = sampler.generate_from_params(cfg, weights, PROMPTS, MASK, rng=jax.random.key(0),
                                     num_samples=G, max_new_tokens=T, sampling=GREEDY,
                                     eos_ids=NEVER, pad_id=0, engine=REFILL)
  ref, _ = run(REFILL)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.logps), np.asarray(ref.logps))


# --------------------------------------------------------------- 2. sampled


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SAMPLED, FILTERED], ids=["t1", "top_k_top_p"])
def test_samples_do_not_depend_on_slots_pages_or_preemption(run, sampling):
  # PREEMPT8 differs from ALL in slots (3 of 6: rows refill them), page size and pool.
  configs = [ALL, PREEMPT8]
  outs = [run(ec, sampling, seed=1, eos=EOS_SAMPLED) for ec in configs]
  base, _ = outs[0]
  lengths = np.asarray(base.lengths)
  assert lengths.min() < T and lengths.max() == T  # ragged rows: slots refill at varied steps
  assert int(outs[-1][1].preempted) > 0
  for (out, _), ec in zip(outs[1:], configs[1:]):
    for field in ("tokens", "mask", "lengths", "truncated"):
      np.testing.assert_array_equal(np.asarray(getattr(out, field)),
                                    np.asarray(getattr(base, field)), err_msg=f"{ec} {field}")
    np.testing.assert_allclose(np.asarray(out.logps), np.asarray(base.logps), atol=1e-5)
  other, _ = run(ALL, sampling, seed=2, eos=EOS_SAMPLED)
  assert not np.array_equal(np.asarray(other.tokens), np.asarray(base.tokens))


@pytest.mark.slow
def test_filtered_samples_stay_in_the_top_k(tiny, run):
  model = tiny[0]
  out, _ = run(ALL, FILTERED, seed=1, eos=EOS_SAMPLED)
  full = jnp.concatenate([jnp.repeat(PROMPTS, G, axis=0), out.tokens], axis=1)
  full_mask = jnp.concatenate([jnp.repeat(MASK, G, axis=0), out.mask], axis=1)
  logits = np.asarray(model(full, mask=full_mask)[:, 5:-1])  # position t predicts token t + 1
  kth = np.sort(logits, axis=-1)[..., -FILTERED.top_k]
  drawn = np.take_along_axis(logits, np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
  m = np.asarray(out.mask) > 0
  assert np.all(drawn[m] >= kth[m])
  logp = jax.nn.log_softmax(logits, axis=-1)  # temperature 1: the full softmax, not the filtered
  ref = np.take_along_axis(np.asarray(logp), np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logps)[m], ref[m], atol=1e-4)
  assert np.all(np.asarray(out.logps)[~m] == 0)


# ---------------------------------------------------------- 3. distribution


def _chisquare_pvalue(counts, p):
  n = counts.sum()
  big = p * n >= 5  # chi-square needs expected counts >= 5: pool the rest
  obs, exp = counts[big], p[big] * n
  if (~big).any():
    obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, p[~big].sum() * n)
  assert big.sum() >= 5, "too few cells for a meaningful test"
  return stats.chisquare(obs, exp).pvalue


@pytest.mark.slow
def test_frequencies_and_logps_match_a_full_forward(tiny, run):
  # The tiny model's softmax is near uniform; temperature 0.05 sharpens it so that
  # the rows sharing the commonest first token are many enough to test the second.
  model = tiny[0]
  temperature, group = 0.05, 1024
  sampling = strategies.SamplingParams(temperature)
  ec = engine.EngineConfig(slots=256, page_size=2)  # 4 rounds of slot refills
  out, _ = run(ec, sampling, seed=3, steps=2, prompts=(1,), group=group)
  tokens = np.asarray(out.tokens)
  assert np.all(np.asarray(out.lengths) == 2)

  full = jnp.concatenate([jnp.repeat(PROMPTS[1:2], group, axis=0), out.tokens], axis=1)
  logits = np.asarray(model(full)[:, 5:7], np.float64) / temperature  # [n, 2, V]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  ref = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logps), ref, atol=2e-4)

  def p_of(row_logp):
    p = np.exp(row_logp)
    return p / p.sum()

  first = np.bincount(tokens[:, 0], minlength=logp.shape[-1])
  assert _chisquare_pvalue(first, p_of(logp[0, 0])) > 1e-3
  mode = int(first.argmax())
  rows = tokens[:, 0] == mode
  assert rows.sum() >= 300
  second = np.bincount(tokens[rows, 1], minlength=logp.shape[-1])
  assert _chisquare_pvalue(second, p_of(logp[np.argmax(rows), 1])) > 1e-3


# ---------------------------------------------------------- 4. stale reads


# XLA with 2048: every page and prompt in one trip of each loop; 8: two pages or one
# prompt a trip (the online softmax across trips, the last trip part empty). The TPU
# kernel through its interpreter, two pages a DMA block.
@pytest.mark.parametrize("kernels,chunk_tokens", [("xla", 2048), ("xla", 8), ("tpu", 2048)])
def test_paged_attention_reads_only_visible_tokens(monkeypatch, kernels, chunk_tokens):
  """Every entry a slot must not see holds +-1e6: free pages, the pool copy of its
  page in progress (stale until full), its own page past its position, left
  padding. Other slots' full pages hold ordinary values."""
  from grpojax.ops import pallas_tpu

  monkeypatch.setattr(xla_ops, "PAGED_CHUNK_TOKENS", chunk_tokens)
  monkeypatch.setattr(pallas_tpu, "paged_attention", functools.partial(
      pallas_tpu.paged_attention, pages_per_block=2, interpret=True))
  rng = np.random.default_rng(0)
  B, g, K, Nq, H, P, M, p = 2, 2, 2, 4, 8, 5, 7, 4  # GQA: Nq = 2 K; g = 2 rows per prompt
  S, scale = 4, H**-0.5

  def garbage(*shape):
    return 1e6 * rng.choice([-1.0, 1.0], shape)

  slot_row = np.array([3, -1, 0, 1], np.int32)  # slot 1 idle; rows 0 and 1 share prompt 0
  slot_position = np.array([5, 0, 2, 8])
  slot_pages = {0: [2, 5], 2: [0], 3: [6, 1, 3]}  # page 4 is free; the last are in progress
  prompt_valid = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)

  pk, pv = garbage(B, K, H, P), garbage(B, K, P, H)
  kp, vp = garbage(K, M, H, p), garbage(K, M, H, p)
  sk, sv = garbage(S, K, H, p), garbage(S, K, H, p)
  owner, full = np.full(M, -1, np.int32), np.zeros(M, bool)
  page_start = np.zeros(M, np.int32)
  for b in range(B):
    for j in np.flatnonzero(prompt_valid[b]):
      pk[b, :, :, j], pv[b, :, j] = rng.normal(size=(K, H)), rng.normal(size=(K, H))
  own = {}  # slot -> its tokens' (key, value), in order
  for s, pages in slot_pages.items():
    own[s] = []
    for i, page in enumerate(pages):
      owner[page], page_start[page] = s, i * p
      full[page] = i < slot_position[s] // p
      for o in range(p):
        if i * p + o > slot_position[s]:
          break
        k, v = rng.normal(size=(K, H)), rng.normal(size=(K, H))
        if full[page]:
          kp[:, page, :, o], vp[:, page, :, o] = k, v
        else:
          sk[s, :, :, o], sv[s, :, :, o] = k, v
        own[s].append((k, v))
  q = rng.normal(size=(S, Nq, H))
  cache = cache_lib.PagedCache(
      prompt_k=(), prompt_v=(), prompt_valid=jnp.asarray(prompt_valid),
      prompt_length=jnp.asarray(prompt_valid.sum(1)), k_pages=(jnp.asarray(kp),),
      v_pages=(jnp.asarray(vp),), slot_k=(jnp.asarray(sk),), slot_v=(jnp.asarray(sv),),
      page_owner=jnp.asarray(owner), page_start=jnp.asarray(page_start),
      slot_row=jnp.asarray(slot_row), slot_position=jnp.asarray(slot_position, jnp.int32),
      slot_page=jnp.full((S,), M, jnp.int32), group=g)
  np.testing.assert_array_equal(np.asarray(cache.page_full()), full)
  own_visible = np.arange(p)[None, :] <= (slot_position % p)[:, None]
  np.testing.assert_array_equal(np.asarray(cache.own_visible()), own_visible)

  attend = jax.jit(lambda q, pk, pv, pvis, kp, vp, sk, sv, owner, full, ovis, slot_row:
                   ops.paged_attention(q, (pk, pv, pvis, g), (kp, vp, owner, full),
                                       (sk, sv, ovis), slot_row, scale, kernels))
  f32 = [jnp.asarray(x, jnp.float32) for x in (q, pk, pv, kp, vp, sk, sv)]
  out = np.asarray(attend(*f32[:3], jnp.asarray(prompt_valid), *f32[3:], jnp.asarray(owner),
                          jnp.asarray(full), jnp.asarray(own_visible), jnp.asarray(slot_row)))
  assert out.shape == (S, Nq, H) and np.all(np.isfinite(out))

  for s, r in enumerate(slot_row):
    if r < 0:
      continue
    b = r // g
    keys = [pk[b, :, :, j] for j in np.flatnonzero(prompt_valid[b])]  # each [K, H]
    values = [pv[b, :, j] for j in np.flatnonzero(prompt_valid[b])]
    keys += [k for k, _ in own[s]]  # its own completion tokens 0 .. position
    values += [v for _, v in own[s]]
    keys, values = np.stack(keys, 1), np.stack(values, 1)  # [K, n, H]
    for n in range(Nq):
      kv = n // (Nq // K)
      w = keys[kv] @ q[s, n] * scale
      w = np.exp(w - w.max())
      np.testing.assert_allclose(out[s, n], w @ values[kv] / w.sum(), atol=1e-5,
                                 err_msg=f"slot {s} head {n}")


@pytest.mark.slow
def test_greedy_over_many_trips_of_the_paged_loops(monkeypatch, tiny, lockstep, greedy_refs):
  """A page and a prompt a trip: the decode's online softmax over many trips."""
  _, cfg, weights = tiny
  monkeypatch.setattr(xla_ops, "PAGED_CHUNK_TOKENS", 4)
  jax.clear_caches()  # the engine's program is keyed by its static arguments, not the constant
  try:
    out = engine.generate(cfg, weights, PROMPTS, MASK, rng=jax.random.key(0), num_samples=G,
                          max_new_tokens=T, sampling=GREEDY, eos_ids=NEVER, pad_id=0,
                          engine=REFILL)
  finally:
    jax.clear_caches()
  _assert_greedy(out, lockstep, greedy_refs)


@pytest.mark.slow
def test_one_slot_reuses_its_pages_without_stale_reads(run, lockstep, greedy_refs):
  out, st = run(ONE_SLOT)  # every row takes the slot and the 3 pages the previous row freed
  _assert_greedy(out, lockstep, greedy_refs)
  assert int(st.steps) == N * (T - 1)  # one row at a time, never idle
  assert int(st.pages_peak) == 3 and int(st.preempted) == 0


# ---------------------------------------------------------- 5. EOS and stop_at


@pytest.mark.slow
def test_eos_and_stop_at_end_rows(run, greedy_refs):
  # A natural EOS: a token prompt 0's argmax emits (first at index 2 or later) and
  # prompt 2's never does, so prompt 2's unforced row runs to T.
  eos = next(t for i, t in enumerate(greedy_refs[0])
             if i >= 2 and t not in greedy_refs[0][:i] and t not in greedy_refs[2])
  nat = greedy_refs[0].index(eos)
  stop_at = (T + 3, nat + 3, 1, 5, T, T + 3)  # > T: never forced
  out, _ = run(REFILL, eos=(NEVER, eos), stop_at=stop_at)

  ends = set()
  for r in range(N):
    seq = list(greedy_refs[r // G])
    if stop_at[r] <= T:
      seq[stop_at[r] - 1] = NEVER
    hit = [i for i, t in enumerate(seq) if t in (NEVER, eos)]
    n = hit[0] + 1 if hit else T
    ends.add("natural" if hit and seq[hit[0]] == eos else "stop_at" if hit else "T")
    if hit and seq[hit[0]] == NEVER:
      assert n == stop_at[r]  # lengths equal stop_at where no natural EOS came first
    assert out.tokens[r].tolist() == seq[:n] + [0] * (T - n), f"row {r}"
    assert out.mask[r].tolist() == [1] * n + [0] * (T - n)
    assert int(out.lengths[r]) == n
    assert bool(out.truncated[r]) == (not hit)
    assert np.all(np.asarray(out.logps[r, n:]) == 0)
  assert ends == {"natural", "stop_at", "T"}
  assert int(out.lengths[2]) == 1 and int(out.lengths[4]) == T and not bool(out.truncated[4])


@pytest.mark.slow
def test_one_new_token(run, greedy_refs):
  stop_at = (1, 9, 1, 9, 1, 9)
  out, st = run(ALL, steps=1, stop_at=stop_at)
  assert out.tokens.shape == (N, 1)
  for r in range(N):
    assert int(out.tokens[r, 0]) == (NEVER if stop_at[r] == 1 else greedy_refs[r // G][0])
    assert bool(out.truncated[r]) == (stop_at[r] != 1)
  assert np.all(np.asarray(out.lengths) == 1) and np.all(np.asarray(out.mask) == 1)
  assert int(st.steps) == 0  # every token comes from the prefill


# ------------------------------------------------------------ 6. validation


@pytest.mark.slow
def test_a_narrowed_tail_draws_the_same_samples(run):
  """Once few rows are left the engine gathers their slots, and the pages they own,
  into fewer slots: each row attends to the same keys and draws the same tokens as
  with every slot kept (a page left with its old slot's number would be read by
  another row, or by none)."""
  base, _ = run(ALL, SAMPLED, seed=1, stop_at=RAGGED)
  assert np.array_equal(np.asarray(base.lengths), RAGGED)
  out, st = run(TAIL, SAMPLED, seed=1, stop_at=RAGGED)
  assert 0 < int(st.tail_steps) < int(st.steps)
  assert int(st.preempted) > 0  # a narrowed run preempts and admits rows too
  for field in ("tokens", "mask", "lengths", "truncated"):
    np.testing.assert_array_equal(np.asarray(getattr(out, field)),
                                  np.asarray(getattr(base, field)), err_msg=field)
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(base.logps), atol=1e-5)


def test_host_scorer_hands_back_finished_groups_per_shard_and_run():
  """Stream.host's host side: a collect returns the finished hand-offs of its own shard,
  as many as fit in F groups, their rows in place; a new run drops what an earlier one
  left; an error in the scoring function reaches the collect."""
  import threading

  release = threading.Event()

  def fn(ids, tokens, mask, valid):
    if ids[0] == 7:
      release.wait(5)
    if ids[0] == 9:
      raise ValueError("verifier broke")
    return (np.where(valid[:, None], ids[:, None] + 0.5, np.nan).astype(np.float32),
            np.full((1, 1), int(valid.sum()), np.int32))

  scorer = engine.HostScorer(fn)
  rows = np.zeros((4, 3), np.int32)  # F = 2 groups of G = 2 rows, T = 3
  collect = lambda shard, wait: scorer.collect(shard, wait, F=2, rows=4, K=1)  # noqa: E731

  def hand(shard, groups, ids):
    valid = np.repeat(np.asarray(groups) >= 0, 2)
    scorer.submit(shard, np.asarray(groups), np.repeat(ids, 2), rows, rows, valid)

  scorer.begin()
  hand(0, [3, -1], [3, 0])
  hand(1, [5, 6], [5, 6])
  hand(0, [7, -1], [7, 0])  # held until released
  hand(0, [4, -1], [4, 0])
  got, errors = {}, 0
  for _ in range(50):  # shard 0's two free hand-offs (one collect or two)
    groups, rewards, errs = collect(0, True)
    for i, g in enumerate(groups):
      if g >= 0:
        got[int(g)] = rewards[2 * i:2 * i + 2, 0].tolist()
    errors += int(errs[0])
    if len(got) == 2:
      break
  assert got == {3: [3.5, 3.5], 4: [4.5, 4.5]} and errors == 4
  assert (collect(0, False)[0] == -1).all()  # 7 is not done
  groups, rewards, _ = collect(1, True)
  assert groups.tolist() == [5, 6] and rewards[:, 0].tolist() == [5.5, 5.5, 6.5, 6.5]
  scorer.begin()  # a new run: 7's result is not this run's
  release.set()
  assert (collect(0, False)[0] == -1).all()
  with pytest.raises(RuntimeError, match="does not hold"):  # never a loop waiting forever
    collect(0, True)
  hand(0, [9, -1], [9, 0])
  with pytest.raises(ValueError, match="verifier broke"):
    for _ in range(50):
      collect(0, True)
  scorer.close()
  with pytest.raises(ValueError, match="host and accept"):
    engine.Stream(score=lambda *a: a, groups=1, rewards=1, host=scorer,
                  accept=lambda r, v: v)


def test_engine_config_validation(tiny):
  for bad in ({"slots": -1}, {"page_size": 0}, {"pages": -2}, {"tail_slots": (4, 0)},
              {"tail_slots": [4]}, {"tail_slots": "auto"}):
    with pytest.raises(ValueError, match="EngineConfig"):
      engine.EngineConfig(**bad)
  # Automatic tails: a quarter, a sixteenth, ... of the slots, while at least 16.
  assert engine.EngineConfig().tail(256) == (64, 16)
  assert engine.EngineConfig().tail(63) == ()
  assert engine.EngineConfig(tail_slots=(2, 8, 8, 32)).tail(16) == (8, 2)
  assert engine.EngineConfig(tail_slots=()).tail(256) == ()
  assert engine.EngineConfig(slots=9, tail_slots=(5, 2)).per_shard(2, 12).tail_slots == (3, 1)
  assert engine.EngineConfig(slots=4, page_size=4).sizes(6, 12) == (4, 12)
  assert engine.EngineConfig(slots=9).sizes(6, 12) == (6, 6)  # no more slots than rows
  assert engine.EngineConfig(page_size=4, pages=3).sizes(6, 12) == (6, 3)
  with pytest.raises(ValueError, match="pages"):
    engine.EngineConfig(page_size=4, pages=2).sizes(6, 12)
  _, cfg, weights = tiny
  with pytest.raises(ValueError, match="pages"):  # raised before tracing
    engine.generate(cfg, weights, PROMPTS, MASK, rng=jax.random.key(0), num_samples=G,
                    max_new_tokens=T, sampling=GREEDY, eos_ids=NEVER, pad_id=0,
                    engine=engine.EngineConfig(slots=1, page_size=5, pages=2))


# ------------------------------------------------------------------ 7. stats


@pytest.mark.slow
@pytest.mark.parametrize("ec,sampling", [(ALL, GREEDY), (REFILL, GREEDY), (PREEMPT, GREEDY),
                                         (ALL, SAMPLED), (PREEMPT8, SAMPLED)],
                         ids=["all", "refill", "preempt", "all_sampled", "preempt8_sampled"])
def test_stats(run, ec, sampling):
  eos = EOS_SAMPLED if sampling is SAMPLED else (NEVER,)
  out, st = run(ec, sampling, seed=1 if sampling is SAMPLED else 0, eos=eos)
  S, M = ec.sizes(N, T)
  lengths = np.asarray(out.lengths)
  steps, peak = int(st.steps), int(st.pages_peak)
  assert steps >= lengths.max() - 1
  assert steps * S >= np.sum(lengths - 1)  # S slots decode at most S tokens a step
  assert -(-(lengths.max() - 1) // ec.page_size) <= peak <= M
  if ec is ALL and sampling is GREEDY:
    assert steps == T - 1 and peak == N * -(-(T - 1) // ec.page_size)
  if ec.pages:
    assert ec.pages < S * -(-T // ec.page_size) and peak <= ec.pages
    assert int(st.preempted) > 0
  if not int(st.preempted):  # every token decoded once: each attended its prompt and itself
    prompt_len = np.repeat(np.asarray(MASK).sum(1), G)
    live = sum(int(plen) * (n - 1) + (n - 1) * n // 2 for plen, n in zip(prompt_len, lengths))
    assert float(st.live_keys) == live
  # Read: whole pages and padded prompts, each prompt once for its G rows; never
  # more than the pool, the pages in progress and every prompt, each step.
  assert 0 < float(st.keys_read) <= steps * ((M + S) * ec.page_size + PROMPTS.size)


# ---------------------------------------------------------------- 7. a mesh


@pytest.mark.slow
def test_a_mesh_runs_an_engine_per_row_shard_with_the_same_samples(tiny):
  """Over a mesh's batch axes each device decodes its prompts' rows with its share of
  the slots and pages; the rows keep their keys, so the samples are one engine's."""
  _, cfg, weights = tiny
  tokens, mask = PROMPTS[:2], MASK[:2]
  kw = dict(rng=jax.random.key(3), num_samples=G, max_new_tokens=T, sampling=SAMPLED,
            eos_ids=NEVER, pad_id=0)
  want = engine.generate(cfg, weights, tokens, mask, engine=REFILL, **kw)
  devices = np.array(jax.devices()[:4]).reshape(2, 1, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
  assert engine.row_shards(mesh, 2) == 2 and engine.row_shards(mesh, 3) == 1
  got, stats = engine.generate(cfg, weights, tokens, mask, engine=PREEMPT8, mesh=mesh,
                               with_stats=True, **kw)
  for field in ("tokens", "mask", "lengths", "truncated"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                  err_msg=field)
  np.testing.assert_allclose(np.asarray(got.logps), np.asarray(want.logps), atol=1e-5)
  # Rows stay on their devices: each holds its prompt's G rows (replicated over "tensor").
  assert {x.data.shape for x in got.tokens.addressable_shards} == {(G, T)}
  # PREEMPT8 per shard: 2 slots, 2 pages of 8 (one row's 12 tokens): one slot preempts.
  assert int(stats.preempted) > 0 and int(stats.live_keys) > 0


@pytest.mark.slow
def test_sharded_weights_reach_each_engine_in_the_compute_dtype(tiny, monkeypatch):
  """Float32 weights sharded over "fsdp" and a bfloat16 compute dtype: each row shard's
  engine gets its replica of the matmul weights already narrowed (half the bytes), and
  the samples are those of the weights replicated as they are (every matmul casts its
  weight to the compute dtype anyway)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  _, cfg, weights = tiny
  cfg = cfg.replace(dtype="bfloat16")
  narrowed = engine.compute_dtype_matmuls(cfg, weights)
  matmuls = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}
  assert matmuls & set(weights)
  for name, w in weights.items():
    assert narrowed[name].dtype == (jnp.bfloat16 if name in matmuls else w.dtype), name
  assert weights["wq"].dtype == jnp.float32 and narrowed["embed"].dtype == jnp.float32
  # Adapters are merged in float32 by the decode step: nothing is narrowed before.
  with_adapter = dict(weights, **{"wq" + models.lora.SUFFIX_A: jnp.zeros((2, 3))})
  assert engine.compute_dtype_matmuls(cfg, with_adapter)["wq"].dtype == jnp.float32

  tokens, mask = PROMPTS[:2], MASK[:2]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("data", "fsdp", "tensor"))
  sharded = {n: jax.device_put(w, NamedSharding(mesh, P(*(["fsdp"] + [None] * (w.ndim - 1)))
                                                if w.shape[0] % 2 == 0 else P()))
             for n, w in weights.items()}
  run = lambda: engine.generate(cfg, sharded, tokens, mask, engine=REFILL, mesh=mesh,  # noqa: E731
                                rng=jax.random.key(5), num_samples=G, max_new_tokens=T,
                                sampling=SAMPLED, eos_ids=NEVER, pad_id=0)
  got = run()
  monkeypatch.setattr(engine.loop, "compute_dtype_matmuls", lambda cfg, w: w)
  jax.clear_caches()
  want = run()
  for field in ("tokens", "lengths", "truncated", "logps"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                  err_msg=field)


# ---------------------------------------------------------------- 8. the program's shape


def _loops(jaxpr) -> list:
  """The loop equations (while, and scan not fully unrolled: XLA makes it a while) of a
  jaxpr, at any depth, outer before inner."""
  found = []
  for eqn in jaxpr.eqns:
    unroll, length = eqn.params.get("unroll"), eqn.params.get("length")
    unrolled = unroll is True or (type(unroll) is int and length and unroll >= length > 1)
    if eqn.primitive.name == "while" or (eqn.primitive.name == "scan" and not unrolled):
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _loops(sub)
  return found


def test_the_engines_bookkeeping_runs_no_loop_of_its_own(tiny, monkeypatch):
  """Slots, pages and the draw add no loop inside the decode loop. A GPU runs a while
  loop's trips from the host, each waiting for the last: jnp.searchsorted's default
  method did so for log2(pages) trips every decode step, 7% of the engine's time on an
  H100 (bench/RESULTS.md). The model's step is stubbed out: XLA's reference paged
  attention loops over chunks, the GPU's and TPU's kernels do not."""
  _, cfg, weights = tiny
  V = cfg.vocab_size
  monkeypatch.setattr(models.transformer, "paged_decode_step",
                      lambda cfg, w, fed, c: (jnp.zeros((fed.shape[0], V), jnp.float32), c))
  jaxpr = jax.make_jaxpr(functools.partial(
      engine.generate_program, cfg, sampling=FILTERED, num_samples=G, max_new_tokens=T,
      eos=(NEVER,), pad_id=0, engine=PREEMPT))(weights, PROMPTS, MASK, jax.random.key(0))
  decode = next(e for e in _loops(jaxpr.jaxpr) if e.primitive.name == "while")
  inner = _loops(decode.params["body_jaxpr"].jaxpr)
  assert not inner, [f"{e.primitive.name} {e.params.get('length', '')}" for e in inner]
