"""The engine's row-event hooks (sampling/engine/hooks.py): a hook written here, outside
the engine, stops a row at a chosen token and resumes it with tokens it appends, and
the rows are what uncached decoding with the same rule gives, whatever the slots,
pages and preemptions; the appended tokens exist but are never trained, through the
rollout and the update.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpojax import models, ops
from grpojax.core import losses
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling import engine, strategies
from grpojax.train import rollout as rollout_lib
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib
from grpojax.train import strategy as strategy_lib
from reward_helpers import decode_chars

PROMPTS = jnp.array([[0, 0, 0, 5, 6, 7], [3, 4, 9, 5, 6, 7], [0, 11, 12, 13, 14, 15]], jnp.int32)
MASK = (jnp.arange(6)[None] >= jnp.array([[3], [0], [1]])).astype(jnp.int32)
NEVER = 127  # the only EOS id: greedy rows never draw it, and the hook appends it
G, T = 2, 12
GREEDY = strategies.SamplingParams(0.0)


@dataclasses.dataclass(frozen=True)
class Interject(engine.RowHook):
  """When a row first draws `mark`, its next tokens are `tokens` (a tool's answer, say):
  the row stops sampling there and resumes after them. Its state: [N] the position of
  each row's mark, -1 before it."""

  mark: int
  tokens: tuple[int, ...]
  forces = True

  def init(self, num_prompts, group):
    return jnp.full((num_prompts * group,), -1, jnp.int32)

  def draw(self, at, rows, drawn):
    N, L = at.shape[0], len(self.tokens)
    start = at[jnp.minimum(drawn.row, N - 1)]
    k = drawn.position - start - 1  # which appended token this position holds
    forced = drawn.active & (start >= 0) & (k >= 0) & (k < L)
    token = jnp.where(forced, jnp.asarray(self.tokens, jnp.int32)[jnp.clip(k, 0, L - 1)],
                      drawn.token)
    marked = drawn.active & (start < 0) & (drawn.token == self.mark)
    return at.at[jnp.where(marked, drawn.row, N)].set(drawn.position, mode="drop"), token, forced

  def restart(self, at, rows):
    # A restarted row draws again from its second token (the first came from the prefill).
    return jnp.where(rows & (at > 0), -1, at)


@pytest.fixture(scope="module")
def tiny():
  m = models.build_model("tiny", seed=0)
  return m, ops.resolve(m.config), m.param_dict()


def _real_prompt(b):
  return [int(t) for t, m in zip(PROMPTS[b], MASK[b]) if m]


def _reference(model, hook, steps):
  """Per prompt: (tokens, forced) of uncached argmax decoding under the hook's rule, one
  full forward per drawn token (right padding, which a causal model cannot see)."""
  prompts = [_real_prompt(b) for b in range(PROMPTS.shape[0])]
  width = max(map(len, prompts)) + steps
  forward = jax.jit(model)
  out = []
  for p in prompts:
    seq, forced, at = list(p), [], None
    while len(seq) - len(p) < steps:
      n = len(seq) - len(p)
      if at is not None and 0 <= n - at - 1 < len(hook.tokens):
        seq.append(hook.tokens[n - at - 1])
        forced.append(True)
        continue
      logits = forward(jnp.array([seq + [0] * (width - len(seq))]))
      token = int(jnp.argmax(logits[0, len(seq) - 1]))
      if at is None and token == hook.mark:
        at = n
      seq.append(token)
      forced.append(False)
    out.append((seq[len(p):], forced))
  return out


@pytest.fixture(scope="module")
def hook(tiny):
  """Marks the third greedy token of prompt 0 (so prompt 0's rows meet it), and appends
  the EOS id among its tokens: a token the hook puts never ends a row."""
  plain = _reference(tiny[0], Interject(mark=-1, tokens=(1,)), T)
  return Interject(mark=plain[0][0][2], tokens=(NEVER, 9, 10))


@pytest.mark.parametrize("ec", [
    # Rows wait for slots, and are preempted and restart.
    engine.EngineConfig(slots=4, page_size=4, pages=5),
    # Every row at once, preempted before and after the tail narrows (6 -> 4 -> 2 slots).
    engine.EngineConfig(page_size=2, pages=8, tail_slots=(4, 2)),
], ids=["preempt", "tail"])
def test_a_hook_outside_the_engine_stops_and_resumes_rows(tiny, hook, ec):
  model, cfg, weights = tiny
  out, stats = engine.generate(cfg, weights, PROMPTS, MASK, rng=jax.random.key(0), num_samples=G,
                               max_new_tokens=T, sampling=GREEDY, eos_ids=(NEVER,), pad_id=0,
                               engine=ec, with_stats=True, hook=hook)
  want = _reference(model, hook, T)
  assert any(any(forced) for _, forced in want)  # the hook acted
  tokens, loss_mask = np.asarray(out.tokens), np.asarray(out.loss_mask)
  for r in range(PROMPTS.shape[0] * G):
    ref_tokens, ref_forced = want[r // G]
    np.testing.assert_array_equal(tokens[r], ref_tokens, err_msg=f"row {r}")
    np.testing.assert_array_equal(loss_mask[r], ~np.array(ref_forced), err_msg=f"row {r}")
  np.testing.assert_array_equal(np.asarray(out.mask), 1)  # the appended EOS ended nothing
  assert not np.asarray(out.logps)[loss_mask == 0].any()  # not the policy's draws
  assert int(stats.preempted) > 0


def test_without_a_hook_no_loss_mask_is_kept(tiny):
  _, cfg, weights = tiny
  out = engine.generate(cfg, weights, PROMPTS, MASK, rng=jax.random.key(0), num_samples=G,
                        max_new_tokens=T, sampling=GREEDY, eos_ids=(NEVER,), pad_id=0,
                        engine=engine.EngineConfig(page_size=4))
  assert out.loss_mask is None


@pytest.mark.slow
def test_the_hooks_tokens_exist_but_are_never_trained_through_the_rollout_and_update(tiny,
                                                                                      hook):
  model, cfg, weights = tiny
  examples = {i: {"prompt": str(i)} for i in range(3)}

  def length(completions, **unused):
    return [float(len(c)) for c in completions]

  config = rollout_lib.RolloutConfig(
      group_size=G, max_new_tokens=T, sampling=strategies.SamplingParams(1.0),
      eos_ids=(NEVER,), pad_id=0, with_old_logps=True,
      engine=engine.EngineConfig(slots=4, page_size=4), hook=hook)
  state = state_lib.create_train_state(cfg, weights, optax.sgd(0.1), with_reference=False)
  batch = {"prompt_tokens": PROMPTS, "prompt_mask": MASK,
           "example_ids": jnp.arange(3, dtype=jnp.int32)}
  with HostRewards([length], decode=decode_chars, lookup=examples.__getitem__,
                   num_workers=0) as host:
    rollout, _ = strategy_lib.make("plain", config, host, num_prompts=3)(
        state, batch, jax.random.key(1))
  tokens, mask = np.asarray(rollout.tokens), np.asarray(rollout.mask)
  loss_mask = np.asarray(rollout.loss_mask)
  # Where a row drew the mark, the hook's tokens follow it, in the row, untrained.
  marks = 0
  for r in range(tokens.shape[0]):
    at = np.flatnonzero(tokens[r] == hook.mark)
    if not len(at) or at[0] + 1 >= T:
      np.testing.assert_array_equal(loss_mask[r], mask[r])
      continue
    marks += 1
    span = slice(at[0] + 1, min(T, at[0] + 1 + len(hook.tokens)))
    np.testing.assert_array_equal(tokens[r, span], hook.tokens[:span.stop - span.start])
    assert mask[r, span].all() and not loss_mask[r, span].any()
    assert loss_mask[r].sum() == mask[r].sum() - (span.stop - span.start)
  assert marks, "no sampled row drew the mark: pick another seed"
  # The update reads nothing of the hook's tokens but their presence: their behaviour
  # log-probs may be anything, and the step is the same; a trained token's are read.
  kw = dict(loss_config=losses.LossConfig(loss_type="dapo"), group_size=G)
  untrained = jnp.asarray((mask > 0) & (loss_mask == 0))
  # The update donates its state: each step gets a copy.
  step = lambda r: step_lib.update(jax.tree.map(jnp.copy, state), r, jax.random.key(2),  # noqa: E731
                                  **kw)[0].params
  base = step(rollout)
  garbled = step(rollout.replace(old_logps=jnp.where(untrained, 5.0, rollout.old_logps)))
  trained = jnp.asarray(loss_mask > 0)
  changed = step(rollout.replace(old_logps=jnp.where(trained, rollout.old_logps - 0.5,
                                                     rollout.old_logps)))
  gap = lambda a, b: max(jax.tree.leaves(jax.tree.map(  # noqa: E731
      lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))
  assert gap(base, garbled) == 0.0
  assert gap(base, changed) > 0.0
