"""The rollout program: rewards from the host bridge, advantages, optional log-probs,
metrics, and identical results on a sharded mesh; dynamic sampling around it."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpojax import models
from grpojax.core import advantages as adv_lib
from grpojax.core import losses
from grpojax.parallel import mesh as mesh_lib
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling.contract import SampleOutput
from grpojax.sampling.engine import EngineConfig
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import rollout as rollout_lib
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib
from grpojax.train import strategy as strategy_lib
from reward_helpers import decode_chars

# One optimizer for every state: it is part of the state's pytree structure, so a
# fresh one per state would trace and compile the rollout programs again.
SGD = optax.sgd(0.1)

G, T = 4, 8
EXAMPLES = {10: {"prompt": "a", "target": "5"}, 11: {"prompt": "b", "target": "z"}}


def digits(completions, **unused):
  return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def has_target(completions, target, **unused):
  return [1.0 if t in c else 0.0 for c, t in zip(completions, target)]


@pytest.fixture(scope="module")
def host():
  with HostRewards([digits, has_target], decode=decode_chars, lookup=EXAMPLES.__getitem__,
                   num_workers=0) as h:
    yield h


@pytest.fixture(scope="module")
def model():
  return models.build_model("tiny", seed=1)


BATCH = {
    "prompt_tokens": jnp.array([[0, 53, 54, 55], [49, 50, 51, 52]], jnp.int32),
    "prompt_mask": jnp.array([[0, 1, 1, 1], [1, 1, 1, 1]], jnp.int32),
    "example_ids": jnp.array([10, 11], jnp.int32),
}

def _plain(config, host, **kw):
  """The plain strategy over BATCH's 2 prompts (a dict is a source serving it)."""
  return strategy_lib.make("plain", config, host, num_prompts=2, **kw)


def _dynamic(config, host, **kw):
  return strategy_lib.make("dynamic", config, host, **kw)


def _streaming(config, host, **kw):
  return strategy_lib.make("streaming", config, host, **kw)



def _config(**kw):
  return rollout_lib.RolloutConfig(group_size=G, max_new_tokens=T,
                                   sampling=SamplingParams(temperature=1.0), eos_ids=(1,),
                                   pad_id=0, **kw)


def _state(model, beta=0.0):
  return state_lib.create_train_state(model.config, model.param_dict(), SGD,
                                      with_reference=beta > 0)


@pytest.mark.slow
def test_rewards_advantages_and_metrics(model, host):
  fn = _plain(_config(), host, reward_weights=[1.0, 2.0])
  r, metrics = fn(_state(model), BATCH, jax.random.key(0))
  assert r.tokens.shape == (2 * G, T) and r.old_logps is None and r.ref_logps is None
  # Independent recomputation on the host from the sampled tokens.
  texts = [decode_chars([row[m > 0].tolist()])[0] for row, m in zip(np.asarray(r.tokens),
                                                                      np.asarray(r.mask))]
  targets = [EXAMPLES[10]["target"]] * G + [EXAMPLES[11]["target"]] * G
  expected = np.array(digits(texts)) + 2.0 * np.array(has_target(texts, targets))
  want = adv_lib.group_advantages(jnp.asarray(expected), G)
  np.testing.assert_allclose(np.asarray(r.advantages), np.asarray(want), atol=1e-6)
  assert float(metrics["reward"]) == pytest.approx(expected.mean(), abs=1e-5)
  assert float(metrics["rewards/digits/mean"]) == pytest.approx(np.mean(digits(texts)), abs=1e-5)
  assert int(metrics["rewards/has_target/errors"]) == 0
  assert float(metrics["completions/mean_length"]) == pytest.approx(float(r.mask.sum()) / (2 * G))
  np.testing.assert_array_equal(np.asarray(r.prompt_tokens[:G]),
                                np.repeat(np.asarray(BATCH["prompt_tokens"][:1]), G, 0))


@pytest.mark.slow
def test_gdpo_and_truncation_masking(model, host):
  # gdpo gets each function's rewards; mask_truncated zeroes the loss mask of the rows
  # that hit T without EOS, after they were scored (rewards computed on the full
  # text); their tokens still exist (mask).
  # A sixteenth of the vocabulary ends a completion: some rows stop, some run to T.
  kw = dict(eos_ids=tuple(range(0, 128, 16)))
  plain, _ = _plain(
      dataclasses.replace(_config(), **kw), host)(_state(model), BATCH, jax.random.key(0))
  fn = _plain(
      dataclasses.replace(_config(estimator="gdpo", mask_truncated=True), **kw), host,
      reward_weights=[1.0, 2.0])
  r, _ = fn(_state(model), BATCH, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(plain.tokens))
  full = np.asarray(plain.mask)
  last = np.asarray(plain.tokens)[np.arange(2 * G), full.sum(1) - 1]
  truncated = ~np.isin(last, kw["eos_ids"])  # no EOS among its T tokens
  assert truncated.any() and (~truncated).any()  # both kinds in this draw
  np.testing.assert_array_equal(np.asarray(r.mask), full)
  np.testing.assert_array_equal(np.asarray(r.loss_mask), np.where(truncated[:, None], 0, full))
  np.testing.assert_array_equal(np.asarray(plain.loss_mask), full)
  texts = [decode_chars([row[m > 0].tolist()])[0] for row, m in zip(np.asarray(plain.tokens), full)]
  targets = [EXAMPLES[10]["target"]] * G + [EXAMPLES[11]["target"]] * G
  per_fn = np.stack([digits(texts), has_target(texts, targets)], axis=1)
  want = adv_lib.gdpo_advantages(jnp.asarray(per_fn), G, weights=jnp.array([1.0, 2.0]))
  np.testing.assert_allclose(np.asarray(r.advantages), np.asarray(want), atol=1e-6)


def test_the_estimator_gets_the_configs_scale_and_eps(model, host):
  name, seen = "test_rollout_spy", []

  def spy(rewards, group_size, **kw):
    seen.append(kw)  # at trace time: the values are static Python ones
    return adv_lib.group_advantages(rewards, group_size, **kw)

  adv_lib.register_advantage(name)(spy)
  try:
    config = _config(estimator=name, advantage_scale="none", advantage_eps=0.25)
    r, _ = _plain(config, host)(_state(model), BATCH, jax.random.key(0))
  finally:
    adv_lib.ESTIMATORS.pop(name)
  assert seen == [{"scale": "none", "eps": 0.25}]
  assert np.isfinite(np.asarray(r.advantages)).all()


def test_untrained_tokens_exist_but_only_the_policys_are_trained(model, host, monkeypatch):
  """A sampler whose rows hold tokens from outside the policy (a tool's response:
  SampleOutput.loss_mask 0, TRL's tool_mask) and a truncated row, under
  mask_truncated: Rollout.mask keeps every token (the rewards read the whole
  text, the log-prob forward attends to it), loss_mask is mask * the sampler's
  loss_mask with the truncated row zeroed, and completions/*_length count the
  policy's tokens before truncation, as TRL's (grpo_trainer.py 2276-2277)."""
  a, b, c, t1, t2 = 97, 98, 99, 49, 50  # "a", "b", "c", "1", "2"
  tokens = np.array([
      [a, b, t1, t2, c, 1, 0, 0],  # a tool's "12" inside the row
      [a, t1, 1, 0, 0, 0, 0, 0],
      [a, b, c, 1, 0, 0, 0, 0],
      [a, t1, t2, b, c, a, b, c],  # truncated: no EOS
      [b, t2, t2, t2, a, 1, 0, 0],
      [t1, t2, t1, 1, 0, 0, 0, 0],  # every token from outside
      [c, 1, 0, 0, 0, 0, 0, 0],
      [a, a, t1, a, 1, 0, 0, 0]], np.int32)
  lengths = np.array([6, 3, 4, 8, 6, 4, 2, 5])
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
  tool = np.ones_like(mask)  # TRL pads its tool_mask with 1s
  for row, cols in {0: [2, 3], 1: [1], 3: [1, 2], 4: [1, 2, 3], 5: [0, 1, 2, 3], 7: [2]}.items():
    tool[row, cols] = 0
  truncated = lengths == T

  def fake_generate(cfg, params, prompt_tokens, prompt_mask, *, num_samples, **kw):
    assert prompt_tokens.shape[0] * num_samples == len(tokens)
    return SampleOutput(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                        logps=jnp.zeros(tokens.shape), lengths=jnp.asarray(lengths, jnp.int32),
                        truncated=jnp.asarray(truncated), loss_mask=jnp.asarray(tool))

  monkeypatch.setattr(rollout_lib.sampler, "generate_from_params", fake_generate)
  state = _state(model)
  # engine=None: the rollout calls the sampler the fake stands in for.
  fn = _plain(_config(mask_truncated=True, with_old_logps=True, engine=None), host)
  r, metrics = fn(state, BATCH, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(r.mask), mask)
  want = np.where(truncated[:, None], 0, mask * tool)
  np.testing.assert_array_equal(np.asarray(r.loss_mask), want)
  assert want[0, :2].all() and not want[0, 2:4].any() and want[0, 4:6].all()  # interior zeros
  # The rewards read every token that exists: the tools' digits count.
  texts = decode_chars([row[m > 0].tolist() for row, m in zip(tokens, mask)])
  assert float(metrics["rewards/digits/mean"]) == pytest.approx(np.mean(digits(texts)))
  own = (mask * tool).sum(1)
  assert (own < lengths).any()
  assert float(metrics["completions/mean_length"]) == pytest.approx(own.mean())
  assert float(metrics["completions/min_length"]) == own.min() == 0
  assert float(metrics["completions/max_length"]) == own.max()
  # The old log-probs' forward attends to every token (mask), the truncated row's too.
  attended = rollout_lib.completion_logps(model.config, state.params, r.prompt_tokens,
                                          r.prompt_mask, r.tokens, r.mask)
  np.testing.assert_allclose(np.asarray(r.old_logps)[mask > 0], np.asarray(attended)[mask > 0],
                             atol=1e-5)
  skipped = rollout_lib.completion_logps(model.config, state.params, r.prompt_tokens,
                                         r.prompt_mask, r.tokens, r.loss_mask)
  assert np.abs(np.asarray(skipped) - np.asarray(attended))[want > 0].max() > 1e-3


@pytest.mark.slow
def test_old_and_reference_logps_only_when_asked(model, host):
  fn = _plain(_config(with_old_logps=True, with_reference=True), host)
  state = _state(model, beta=0.04)
  r, metrics = fn(state, BATCH, jax.random.key(0))
  assert r.old_logps.shape == r.tokens.shape and r.ref_logps.shape == r.tokens.shape
  # The sampler's own log-probs travel with the rollout and agree with the
  # trainer's recomputation (float32).
  m = np.asarray(r.mask) > 0
  assert np.abs(np.asarray(r.sampler_logps) - np.asarray(r.old_logps))[m].max() < 1e-4
  # The reference is a bf16 copy of the same weights: close, not equal.
  gap = np.abs(np.asarray(r.ref_logps) - np.asarray(r.old_logps))[m]
  assert 0 < gap.max() < 0.1


@pytest.mark.slow
def test_sharded_rollout_gives_the_same_samples_and_rewards(model, host):
  fn = _plain(_config(), host)
  ref, ref_metrics = fn(_state(model), BATCH, jax.random.key(3))
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded = models.shard_model(model, mesh)
  fn = _plain(_config(), host, mesh=mesh)
  state = state_lib.create_train_state(model.config, sharded.param_dict(), SGD,
                                       with_reference=False)
  out, metrics = fn(state, BATCH, jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_allclose(np.asarray(out.advantages), np.asarray(ref.advantages), atol=1e-6)
  assert float(metrics["reward"]) == pytest.approx(float(ref_metrics["reward"]))


@pytest.mark.slow
def test_paged_engine_rollout_samples_as_the_engine_does_sharded_or_not(model, host):
  """rollout engine="paged": the rows are engine.generate's, on one device and on a mesh."""
  from grpojax.sampling import engine

  paged = engine.EngineConfig(slots=3, page_size=4, pages=4)  # refills slots, preempts
  cfg = model.config.replace(kernels="xla")
  state = state_lib.create_train_state(cfg, model.param_dict(), SGD, with_reference=False)
  key = jax.random.key(5)
  r, metrics = _plain(_config(engine=paged), host)(state, BATCH, key)
  kw = dict(num_samples=G, max_new_tokens=T, sampling=SamplingParams(temperature=1.0),
            eos_ids=(1,), pad_id=0, engine=paged, with_stats=True)
  want, stats = engine.generate(cfg, state.params, BATCH["prompt_tokens"], BATCH["prompt_mask"],
                                rng=key, **kw)
  np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(r.mask), np.asarray(want.mask))
  np.testing.assert_allclose(np.asarray(r.sampler_logps), np.asarray(want.logps), atol=1e-6)
  # The engine's own account of the run reaches the metrics.
  assert int(stats.preempted) > 0
  for name in ("steps", "tail_steps", "preempted", "pages_peak"):
    assert int(metrics[f"engine/{name}"]) == int(getattr(stats, name)), name
  assert float(metrics["engine/keys_read_per_live"]) == pytest.approx(
      float(stats.keys_read) / float(stats.live_keys))
  # Generation chunks run one after another: their steps add up, their peaks do not.
  stacked = jax.tree.map(lambda *x: jnp.stack(x), stats, stats.replace(
      steps=stats.steps + 3, pages_peak=stats.pages_peak + 2, tail_steps=stats.tail_steps + 1))
  chunked = rollout_lib.engine_metrics(stacked)
  assert int(chunked["engine/steps"]) == 2 * int(stats.steps) + 3
  assert int(chunked["engine/tail_steps"]) == 2 * int(stats.tail_steps) + 1
  assert int(chunked["engine/preempted"]) == 2 * int(stats.preempted)
  assert int(chunked["engine/pages_peak"]) == int(stats.pages_peak) + 2

  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded = state_lib.create_train_state(cfg, models.shard_model(model, mesh).param_dict(),
                                         SGD, with_reference=False)
  out, _ = _plain(_config(engine=paged), host, mesh=mesh)(sharded, BATCH, key)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(r.tokens))
  np.testing.assert_allclose(np.asarray(out.advantages), np.asarray(r.advantages), atol=1e-6)


@pytest.mark.slow
def test_rollout_then_update_does_not_retrace(model, host):
  fn = _plain(_config(), host)
  state = _state(model)
  for step in range(2):
    rng = jax.random.fold_in(jax.random.key(0), step)
    r, _ = fn(state, BATCH, rng)
    state, metrics = step_lib.update(state, r, rng, loss_config=losses.LossConfig(), group_size=G)
    if step == 0:
      sizes = (fn.program._cache_size(), step_lib.update._cache_size())
  assert (fn.program._cache_size(), step_lib.update._cache_size()) == sizes
  assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_runs_share_one_compiled_rollout_each_scored_by_its_own_functions(model, host):
  """Two HostRewards of the same shape (two runs in one process, here at once): one
  compiled rollout program, and each call's rewards are its own host's (an empty
  target is in every completion)."""
  every = {i: dict(row, target="") for i, row in EXAMPLES.items()}
  with HostRewards([digits, has_target], decode=decode_chars, lookup=every.__getitem__,
                   num_workers=0) as other:
    mine, theirs = _plain(_config(), host), _plain(_config(), other)
    assert theirs.program.jitted is mine.program.jitted
    state, rng = _state(model), jax.random.key(5)
    r, metrics = mine(state, BATCH, rng)
    size = mine.program._cache_size()
    got = {}
    threads = [threading.Thread(target=lambda k=k, fn=fn: got.__setitem__(k, fn(state, BATCH, rng)))
               for k, fn in (("mine", mine), ("theirs", theirs))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert mine.program._cache_size() == size
  texts = decode_chars([row[m > 0].tolist() for row, m in zip(np.asarray(r.tokens),
                                                              np.asarray(r.mask))])
  want = np.mean(has_target(texts, [EXAMPLES[10]["target"]] * G + [EXAMPLES[11]["target"]] * G))
  assert want < 1.0
  for name in ("mine", "theirs"):
    np.testing.assert_array_equal(np.asarray(got[name][0].tokens), np.asarray(r.tokens))
  assert float(got["mine"][1]["rewards/has_target/mean"]) == pytest.approx(want)
  assert float(got["theirs"][1]["rewards/has_target/mean"]) == 1.0
  assert float(metrics["rewards/has_target/mean"]) == pytest.approx(want)


# Dynamic sampling: examples 20-29 score every completion 1.0 (a zero-std group);
# 30-39 score a checksum of the completion text (groups whose rewards differ).
DS_EXAMPLES = {i: {"prompt": str(i), "flat": i < 30} for i in range(20, 40)}
DS_ROUNDS = 4


def flat_or_checksum(completions, flat, **unused):
  return [1.0 if f else float(sum(map(ord, c)) % 97) for c, f in zip(completions, flat)]


@pytest.fixture(scope="module")
def ds_fns():
  """(dynamic, plain) rollout functions on 2 prompts, shared so each compiles once."""
  with HostRewards([flat_or_checksum], decode=decode_chars, lookup=DS_EXAMPLES.__getitem__,
                   num_workers=0) as host:
    yield (_dynamic(_config(), host, num_prompts=2,
                                               max_rounds=DS_ROUNDS),
           _plain(_config(), host))


class _Batches:
  """A rollout source over the given batches of example ids (prompt tokens name the
  example); back: the rewinds, as (batch drawn, prompts of it used)."""

  def __init__(self, *example_ids):
    self.batches = [{"prompt_tokens": jnp.array([[50, i] for i in ids], jnp.int32),
                     "prompt_mask": jnp.ones((len(ids), 2), jnp.int32),
                     "example_ids": jnp.array(ids, jnp.int32)} for ids in example_ids]
    self.drawn, self.back = 0, []

  def next(self):
    self.drawn += 1
    return self.batches[self.drawn - 1]

  def rewind(self, back, used):
    self.back.append((self.drawn - back, used))


def _batches(*example_ids):
  return _Batches(*example_ids)


def _groups(rollout):
  """The example each group of a rollout was drawn for (from its prompt tokens)."""
  return np.asarray(rollout.prompt_tokens)[::G, -1].tolist()


def _counts(metrics):
  return tuple(metrics[f"dynamic_sampling/{k}"] for k in ("rounds", "dropped_groups",
                                                          "kept_zero_std"))


@pytest.mark.slow
def test_dynamic_sampling_trains_on_groups_whose_rewards_differ(model, ds_fns):
  dynamic, plain = ds_fns
  state, rng = _state(model), jax.random.key(5)
  out, metrics = dynamic(state, _batches([20, 30], [21, 31], [22, 32]), rng)
  assert _groups(out) == [30, 31]  # the flat groups 20 and 21 were dropped
  assert _counts(metrics) == (2, 2, 0)
  # Each kept group is the one its round generated (round r draws with fold_in(rng, r)),
  # advantages included; the metrics are round 0's.
  first, first_metrics = plain(state, _batches([20, 30]), rng)
  second, _ = plain(state, _batches([21, 31]), jax.random.fold_in(rng, 1))
  for name in ("tokens", "mask", "advantages", "prompt_tokens"):
    want = np.concatenate([np.asarray(getattr(first, name))[G:],
                           np.asarray(getattr(second, name))[G:]])
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), want)
  assert float(metrics["reward"]) == float(first_metrics["reward"])
  assert float(metrics["frac_reward_zero_std"]) == 0.5
  adv = np.asarray(out.advantages).reshape(-1, G)
  assert np.all(np.abs(adv).max(axis=1) > 0.1)


def test_dynamic_sampling_out_of_rounds_fills_with_zero_std_groups(model, ds_fns):
  dynamic, _ = ds_fns
  out, metrics = dynamic(_state(model), _batches([20, 21], [22, 23], [24, 25], [26, 30]),
                         jax.random.key(5))
  assert _groups(out) == [30, 26]
  assert _counts(metrics) == (DS_ROUNDS, 6, 1)
  assert not np.any(np.asarray(out.advantages)[G:])


@pytest.mark.slow
def test_dynamic_sampling_with_nothing_to_drop_is_the_plain_rollout(model, ds_fns):
  dynamic, plain = ds_fns
  state, rng = _state(model), jax.random.key(5)
  out, metrics = dynamic(state, _batches([30, 31]), rng)
  want, want_metrics = plain(state, _batches([30, 31]), rng)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _counts(metrics) == (1, 0, 0)
  rest = {k: float(v) for k, v in metrics.items() if not k.startswith("dynamic_sampling/")}
  assert rest == {k: float(v) for k, v in want_metrics.items()}


@pytest.mark.slow
def test_generation_chunks_sample_each_chunks_prompts_with_its_own_key(model, host):
  """Two chunks: prompt i's rows are generate() of prompt i alone with fold_in(rng, i)."""
  from grpojax.sampling import sampler

  cfg = model.config.replace(kernels="xla")  # one draw kernel for both, whatever is built
  state = state_lib.create_train_state(cfg, model.param_dict(), SGD, with_reference=False)
  key = jax.random.key(3)
  r, _ = _plain(_config(generation_chunks=2), host)(state, BATCH, key)
  for i in range(2):
    want = sampler.generate_from_params(
        cfg, state.params, BATCH["prompt_tokens"][i:i + 1], BATCH["prompt_mask"][i:i + 1],
        rng=jax.random.fold_in(key, i), num_samples=G, max_new_tokens=T,
        sampling=SamplingParams(temperature=1.0), eos_ids=(1,), pad_id=0,
        engine=_config().engine)  # the rollout's decoder
    rows = slice(i * G, (i + 1) * G)
    np.testing.assert_array_equal(np.asarray(r.tokens[rows]), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(r.mask[rows]), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(r.sampler_logps[rows]), np.asarray(want.logps), atol=1e-6)


# Streaming dynamic sampling (the engine decodes each batch's groups in order only
# until enough are accepted): the groups, tokens and advantages whole rounds give.
ENGINE = EngineConfig(slots=4, page_size=4)  # 8 rows a batch wait for slots


@pytest.fixture(scope="module")
def streams():
  """(streaming, rounds) on 2 prompts over the same engine, and a 2-shard streaming; the
  streaming scored in the loop (overlap=False), so the groups decoded are exact."""
  with HostRewards([flat_or_checksum], decode=decode_chars, lookup=DS_EXAMPLES.__getitem__,
                   num_workers=0) as host:
    kw = dict(num_prompts=2, max_rounds=DS_ROUNDS)
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, jax.devices()[:2])
    yield (_streaming(_config(engine=ENGINE), host, overlap=False,
                                                 **kw),
           _dynamic(_config(engine=ENGINE), host, **kw),
           _streaming(_config(engine=ENGINE), host, mesh=mesh,
                                                 overlap=False, **kw),
           host)


def _same(a, b):
  for name in ("tokens", "mask", "advantages", "prompt_tokens", "sampler_logps", "zero_std"):
    np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)),
                                  err_msg=name)


def test_streaming_picks_the_rounds_groups_and_gives_back_the_prompts_not_reached(model, streams):
  stream, rounds, *_ = streams
  state, rng = _state(model), jax.random.key(5)
  batches = ([30, 20], [31, 21], [22, 32], [23, 33])  # DS_ROUNDS batches are drawn
  source = _batches(*batches)
  out, metrics = stream(state, source, rng)
  want, want_metrics = rounds(state, _batches(*batches), rng)
  assert _groups(out) == _groups(want) == [30, 31]
  _same(out, want)
  # Rows queue in order (4 slots: a group at a time): 30, 20 and 31 are scored, 20 flat,
  # and the run stops. The slots 31's first rows freed began 21 (surplus): it goes back
  # to the data with batches 2 and 3, from batch 1's second prompt on.
  assert source.back == [(1, 1)]
  assert _counts(metrics) == (2, 1, 0)  # rounds also decode and drop flat 21
  assert _counts(want_metrics) == (2, 2, 0)
  assert (metrics["dynamic_sampling/decoded_groups"],
          metrics["dynamic_sampling/surplus_groups"]) == (4, 1)
  assert metrics["dynamic_sampling/skipped_prompts"] == 0
  for name in ("reward", "frac_reward_zero_std", "completions/mean_length"):  # batch 0's
    assert float(metrics[name]) == float(want_metrics[name])

  # Out of batches: the last batch's zero-std groups fill in, as with rounds.
  four = ([20, 21], [22, 23], [24, 25], [26, 30])
  source = _batches(*four)
  out, metrics = stream(state, source, rng)
  want, _ = rounds(state, _batches(*four), rng)
  assert _groups(out) == [30, 26]
  _same(out, want)
  assert source.back == [] and _counts(metrics) == (DS_ROUNDS, 6, 1)


def test_streaming_on_two_row_shards_collects_each_shards_share(model, streams):
  """Shard s holds prompt s of every batch and accepts its own group; its rows draw as
  the engine draws batch r's rows alone (the rollout's round r with fold_in(rng, r))."""
  _, _, sharded, host = streams
  state, rng = _state(model), jax.random.key(5)
  source = _batches([30, 20], [31, 21], [22, 32], [23, 33])
  out, metrics = sharded(state, source, rng)
  assert _groups(out) == [30, 32]  # shard 0 stops at 30; shard 1 passes 20 and 21
  # Shard 0 needs only 30 (31 began beside it), shard 1 20, 21 and 32 (33 began): batch
  # 3 goes back; shard 0's 31 and 22, below shard 1's 32, are consumed unused.
  assert source.back == [(3, 0)] and metrics["dynamic_sampling/skipped_prompts"] == 2
  assert (metrics["dynamic_sampling/decoded_groups"],
          metrics["dynamic_sampling/surplus_groups"]) == (6, 2)
  plain = _plain(_config(engine=ENGINE), host)
  first, _ = plain(state, _batches([30, 20]), rng)
  third, _ = plain(state, _batches([22, 32]), jax.random.fold_in(rng, 2))
  for name in ("tokens", "mask", "sampler_logps"):
    want = np.concatenate([np.asarray(getattr(first, name))[:G],
                           np.asarray(getattr(third, name))[G:]])
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), want, err_msg=name)


def slow_flat_or_checksum(completions, flat, **unused):
  # Flat groups are verified last: hand-offs finish out of order, and after the
  # engine has decoded on.
  time.sleep(0.3 if all(flat) else 0.05)
  return flat_or_checksum(completions, flat)


@pytest.mark.slow
def test_overlapped_scoring_picks_the_groups_scoring_in_the_loop_does(model, streams):
  """rollout's default: groups verified on host threads while the engine decodes. The
  groups, rows, advantages and prompts given back are those of scoring in the loop,
  on one device and per row shard, however late and out of order the results come."""
  stream, _, sharded, _ = streams
  state, rng = _state(model), jax.random.key(5)
  batches = ([30, 20], [31, 21], [22, 32], [23, 33])
  with HostRewards([slow_flat_or_checksum], decode=decode_chars,
                   lookup=DS_EXAMPLES.__getitem__, num_workers=0) as slow:
    kw = dict(num_prompts=2, max_rounds=DS_ROUNDS)
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, jax.devices()[:2])
    for inline, overlapped in (
        (stream, _streaming(_config(engine=ENGINE), slow, **kw)),
        (sharded, _streaming(_config(engine=ENGINE), slow, mesh=mesh,
                                                        **kw))):
      source, want_source = _batches(*batches), _batches(*batches)
      out, metrics = overlapped(state, source, rng)
      want, want_metrics = inline(state, want_source, rng)
      assert _groups(out) == _groups(want)
      _same(out, want)
      assert source.back == want_source.back
      for name in ("dynamic_sampling/rounds", "dynamic_sampling/dropped_groups",
                   "dynamic_sampling/kept_zero_std", "reward", "frac_reward_zero_std"):
        assert float(metrics[name]) == float(want_metrics[name]), name
      # The engine decoded on while the verifiers worked, and waited once it had nothing left.
      assert (metrics["dynamic_sampling/decoded_groups"]
              >= want_metrics["dynamic_sampling/decoded_groups"])
      assert metrics["dynamic_sampling/scoring_wait_s"] > 0
