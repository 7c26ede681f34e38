"""Carried rollouts against synchronous ones on ragged lengths: decode steps per trained
token, slot occupancy, staleness and the trained-length bias, for max_staleness 1, 2, 4
in each partial mode.

Axes: B groups a rollout returns, G samples per prompt, S decode slots, E batches
carried, T = max_new_tokens, K rollouts.

Rows: the engine bench's ragged workload. Row j of prompt i ends at a length drawn
from a lognormal with median T/8 and sigma --sigma, clipped to [1, T], forced
through the carried program's `stop_at` hook (the random model never draws that
stop id itself: common.with_stop_logit). A prompt keeps its rows' lengths however
often they are resumed or restarted.

Each setting runs K rollouts of B groups (the policy version is the rollout's
number: one update between rollouts): synchronous (max_staleness 0: every
rollout drains its B groups, the plain strategy), and carried (E batches held
beside the returned one, S = B*G slots) at each staleness and partial mode.
Figures per setting, over the K rollouts:
  steps/token   decode steps per trained token (the engine's steps, summed, over the
                returned rows' tokens); vs_sync: the synchronous figure over this one
  occupancy     the fraction of decode steps with all S slots busy
  length_bias   the trained rows' mean length over the mean length of every row that
                ended (whether trained or thrown away), minus 1
  staleness     mean and max policy versions of the trained tokens
  wasted        tokens thrown away (rows restarted), over the trained ones
  prefill       prompt and prefix tokens prefilled per trained token (recompute's cost)

--e2e, instead: K training steps end to end (rollout through the registered strategy,
then `train.step.update`, plain SGD), synchronous (`plain`) against carried
(max_staleness 2, one batch carried, loss.decoupled), the random model's stop id at
a fixed logit (lengths geometric, mean about T/8: common.with_stop_logit), the first
step of each (compiles) left out: trained tokens a second, their ratio, and the
carried run's occupancy and staleness. --quick: the tiny model, T = 32; --device
gpu: Qwen2.5-0.5B's shapes in bf16, 32 x 8 rows, P = 128, T = 4,096, 256 slots.

The schedule is the engine's, replayed in numpy (`replay`: admission lowest row
first, one token a step per busy slot, each rollout stopped once B groups are
complete, the oldest B returned): a step's count does not depend on the model. At
--quick and on --check the real program (`engine.carry.resume_program`, the tiny
model, CPU) runs the same rollouts and its steps, full steps, returned groups and
lengths must equal the replay's, rollout for rollout; the figures at T = 4,096
(--device gpu, the engine bench's Qwen2.5-0.5B shapes: B = 32 x G = 8, S = 256) are
then the replay's. Seconds are not measured: on a device, each step's cost is the
engine bench's (bench/RESULTS.md); the replay gives how many steps there are.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

SETTINGS = {
    "quick": dict(prompts=2, groups=4, T=32, rollouts=8, extra=1, check=True),
    "cpu": dict(prompts=32, groups=8, T=4096, rollouts=64, extra=1, check=False),
    "gpu": dict(prompts=32, groups=8, T=4096, rollouts=64, extra=1, check=False),
}
SETTINGS["tpu"] = SETTINGS["gpu"]
STALENESS = (1, 2, 4)
PARTIAL = ("recompute", "keep", "restart")


def add_arguments(parser) -> None:
  parser.add_argument("--prompts", type=int, help="B, groups a rollout returns")
  parser.add_argument("--groups", type=int, help="G samples per prompt")
  parser.add_argument("--T", type=int, help="max_new_tokens")
  parser.add_argument("--rollouts", type=int, help="K rollouts per setting")
  parser.add_argument("--extra", type=int, help="E batches carried beside the returned one")
  parser.add_argument("--sigma", type=float, default=1.0,
                      help="of the lognormal lengths (median T/8), in log space")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--check", action="store_true",
                      help="run the real program too and check the replay against it")
  parser.add_argument("--e2e", action="store_true",
                      help="training steps end to end (rollout + update), timed, instead")
  parser.add_argument("--steps", type=int, help="with --e2e: K timed steps of each")


@dataclasses.dataclass
class Rollout:
  """One rollout of the replay: steps, full_steps, the returned prompts (ids, in order)
  and their rows' lengths, tokens prefilled (prompts and prefixes)."""

  steps: int
  full_steps: int
  returned: list
  lengths: np.ndarray
  prefilled: int


def draw_lengths(seed: int, prompts: int, G: int, T: int, sigma: float) -> np.ndarray:
  """[prompts, G] completion lengths: lognormal with median T/8, in [1, T]."""
  x = np.random.default_rng(seed).lognormal(np.log(T / 8), sigma, (prompts, G))
  return np.clip(np.round(x), 1, T).astype(np.int32)


def replay(target: np.ndarray, *, B: int, G: int, T: int, S: int, extra: int,
           max_staleness: int, partial: str, rollouts: int, P: int = 0):
  """The carried engine's schedule: (list of Rollout, totals dict). target [prompts, G]
  each row's length (prompt i is the i-th drawn). extra=0 is the synchronous rollout.
  partial "recompute" / "restart": each rollout starts with every slot idle and every
  unfinished row drawing its next token from its prefill; "keep": the rows in slots
  stay there, and only the rows that start (new or restarted) draw one."""
  groups = []  # the pool: [prompt id, L [G], v0 [G], ended [G], versions [G, T]]
  drawn, out = 0, []
  totals = dict(trained=0, wasted=0, ended_rows=0, ended_tokens=0, age_sum=0, age_max=0,
                steps=0, full_steps=0, prefilled=0)

  def add(n):
    nonlocal drawn
    for _ in range(n):
      groups.append([drawn, np.zeros(G, int), np.zeros(G, int), np.zeros(G, bool),
                     np.zeros((G, T), int)])
      drawn += 1

  add(B * extra)
  keep = partial == "keep"
  slots = []  # (group, row) decoding; "keep" carries them from one rollout to the next
  for version in range(rollouts):
    add(B)
    prefilled = 0
    for g in groups:  # staleness, or partial="restart"
      _, L, v0, ended, _ = g
      reset = (L > 0) & ((partial == "restart") | (version - v0 > max_staleness))
      totals["wasted"] += int(L[reset].sum())
      L[reset], ended[reset] = 0, False
      slots = [(h, j) for h, j in slots if h is not g or not reset[j]]

    def draw(g, j) -> bool:
      """Row j of group g draws a token; whether it ended."""
      pid, L, v0, ended, versions = g
      if L[j] == 0:
        v0[j] = version
      versions[j, L[j]] = version
      L[j] += 1
      if L[j] >= target[pid, j]:
        ended[j] = True
        totals["ended_rows"] += 1
        totals["ended_tokens"] += int(L[j])
      return bool(ended[j])

    # The prefill: every unfinished row draws its first token of this rollout ("keep":
    # the rows that start).
    if not keep:
      slots = []
    for g in groups:
      for j in np.flatnonzero(~g[3] & ((g[1] == 0) | (not keep))):
        prefilled += P + g[1][j]
        draw(g, j)
    busy = {(id(g), j) for g, j in slots}
    pending = [(g, j) for g in groups for j in range(G)
               if not g[3][j] and (id(g), j) not in busy]
    steps, full = 0, 0

    def complete():
      return sum(bool(g[3].all()) for g in groups)

    while (pending or slots) and complete() < B:
      while len(slots) < S and pending:
        slots.append(pending.pop(0))
      steps += 1
      full += len(slots) == S
      slots = [(g, j) for g, j in slots if not draw(g, j)]
    done = [gi for gi, g in enumerate(groups) if g[3].all()][:B]
    chosen = [groups[gi] for gi in done]
    groups[:] = [g for gi, g in enumerate(groups) if gi not in set(done)]
    lengths = np.stack([g[1].copy() for g in chosen])
    for pid, L, _, _, versions in chosen:
      for j in range(G):
        age = version - versions[j, :L[j]]
        totals["age_sum"] += int(age.sum())
        totals["age_max"] = max(totals["age_max"], int(age.max()))
    totals["trained"] += int(lengths.sum())
    totals["steps"] += steps
    totals["full_steps"] += full
    totals["prefilled"] += prefilled
    out.append(Rollout(steps, full, [g[0] for g in chosen], lengths, prefilled))
  return out, totals


def figures(totals: dict) -> dict:
  trained = max(totals["trained"], 1)
  return {"steps_per_token": totals["steps"] / trained,
          "occupancy": totals["full_steps"] / max(totals["steps"], 1),
          "length_bias": (totals["trained"] / max(totals["trained_rows"], 1))
          / max(totals["ended_tokens"] / max(totals["ended_rows"], 1), 1e-9) - 1.0,
          "staleness_mean": totals["age_sum"] / trained, "staleness_max": totals["age_max"],
          "wasted_per_token": totals["wasted"] / trained,
          "prefill_per_token": totals["prefilled"] / trained}


def check(target: np.ndarray, runs: list, *, B: int, G: int, T: int, S: int, extra: int,
          max_staleness: int, partial: str, seed: int, log) -> None:
  """Runs `carry.resume_program` on the tiny model over the same rollouts and raises
  unless its steps, full steps, returned prompts and lengths are the replay's."""
  import jax
  import jax.numpy as jnp

  import common
  from grpojax.sampling import engine as engine_lib
  from grpojax.sampling.engine import carry
  from grpojax.sampling.strategies import SamplingParams

  cfg, weights = common.random_model("tiny", seed)
  V, P = cfg.vocab_size, 4
  prompts = np.random.default_rng(seed).integers(2, V - 1, (target.shape[0], P))
  kw = dict(sampling=SamplingParams(temperature=1.0), num_samples=G, max_new_tokens=T,
            eos=(V - 1,), pad_id=0, engine=engine_lib.EngineConfig(slots=S, page_size=8),
            groups=B)
  rng = jax.random.key(seed)

  def batch(first, n):
    ids = np.arange(first, first + n)
    return carry.fresh(jnp.asarray(prompts[ids], jnp.int32), jnp.ones((n, P), jnp.int32),
                       jnp.asarray(ids, jnp.int32), jax.random.fold_in(rng, first),
                       num_samples=G, max_new_tokens=T, pad_id=0)

  pool, drawn = None, 0
  if extra:
    pool, drawn = batch(0, B * extra), B * extra
  for version, want in enumerate(runs):
    new = batch(drawn, B)
    drawn += B
    flags = dict(max_staleness=jnp.int32(max_staleness), restart=jnp.bool_(partial == "restart"))
    if isinstance(pool, carry.Kept):
      full = carry.kept_with(pool, new.prompt_tokens, new.prompt_mask, new.example_ids,
                             jax.random.fold_in(rng, drawn - B))
      go = functools.partial(carry.keep_program, fresh_from=full.prompt_tokens.shape[0] - B)
    else:
      full = new if pool is None else carry.join(pool, new)
      go = carry.keep_start if partial == "keep" else carry.resume_program
    stop = jnp.asarray(target[np.asarray(full.example_ids)].reshape(-1), jnp.int32)
    out, got, kept, stats, _ = go(cfg, weights, full, jnp.int32(version), width=T - 1,
                                  stop_at=stop, **flags, **kw)
    seen = (int(stats.steps), int(stats.full_steps), [int(i) for i in got.example_ids])
    if seen != (want.steps, want.full_steps, want.returned) or not np.array_equal(
        np.asarray(out.lengths).reshape(B, G), want.lengths):
      replayed = (want.steps, want.full_steps, want.returned)
      raise AssertionError(f"rollout {version}: the program's (steps, full steps, prompts) "
                           f"{seen} are not the replay's {replayed}")
    pool = kept if extra or partial == "keep" else None
  log(f"  checked: the program's {len(runs)} rollouts are the replay's")


# (model, dtype, B, G, P, T, slots, page size, steps) of --e2e by setting.
E2E = {"quick": ("tiny", "float32", 2, 4, 8, 32, 8, 8, 6),
       "cpu": ("small", "float32", 4, 8, 32, 256, 32, 128, 8),
       "gpu": ("qwen2.5-0.5b", "bfloat16", 32, 8, 128, 4096, 256, 128, 8)}
E2E["tpu"] = E2E["gpu"]


def end_to_end(args, log) -> dict:
  """K training steps, synchronous against carried: trained tokens a second."""
  import math
  import time

  import jax
  import jax.numpy as jnp
  import optax

  import common
  from grpojax.core import losses
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.sampling import engine as engine_lib
  from grpojax.sampling.strategies import SamplingParams
  from grpojax.train import rollout as rollout_lib
  from grpojax.train import state as state_lib
  from grpojax.train import step as step_lib
  from grpojax.train import strategy as strategy_lib

  name, dtype, B, G, P, T, S, page, K = E2E["quick" if args.quick else args.device]
  B, G, T, K = args.prompts or B, args.groups or G, args.T or T, args.steps or K
  V = common.model_config(name).vocab_size
  stop = min(8 / T, 0.5)  # P(stop) a step against logits near 0: geometric, mean ~T/8
  cfg, weights = common.random_model(name, args.seed, dtype,
                                     stop_logit=math.log(stop * (V - 1) / (1 - stop)))
  prompts = np.random.default_rng(args.seed).integers(0, V - 1, (B * (2 * K + 4), P))

  class Batches:
    def __init__(self):
      self.at = 0

    def next(self):
      rows = np.arange(self.at, self.at + B) % len(prompts)
      self.at += B
      tokens = jnp.asarray(prompts[rows], jnp.int32)
      return {"prompt_tokens": tokens, "prompt_mask": jnp.ones_like(tokens),
              "example_ids": jnp.asarray(rows, jnp.int32)}

    def rewind(self, back, used):
      raise AssertionError("nothing is given back")

  def alternate(completions, **unused):
    """Rewards 0, 1, 0, 1, ...: every group's differ."""
    return [float(i % 2) for i in range(len(completions))]

  host = HostRewards([alternate],
                     decode=lambda rows: [""] * len(rows), lookup=lambda i: {"prompt": ""},
                     num_workers=0)
  out = {"model": name, "B": B, "G": G, "T": T, "S": S, "steps": K}
  log(f"--e2e: {name} ({dtype}), B={B} x G={G}, P={P}, T={T}, S={S}, {K} timed steps each")
  try:
    for way, options, decoupled in (("sync", {}, False),
                                    ("carried", dict(max_staleness=2, carried_batches=1), True)):
      config = rollout_lib.RolloutConfig(
          group_size=G, max_new_tokens=T, sampling=SamplingParams(temperature=1.0),
          eos_ids=(V - 1,), pad_id=0, engine=engine_lib.EngineConfig(slots=S, page_size=page),
          **options)
      strategy = strategy_lib.make("carried" if options else "plain", config, host,
                                   num_prompts=B)
      state = state_lib.create_train_state(cfg, weights, optax.sgd(1e-3), with_reference=False)
      loss = losses.LossConfig(decoupled=decoupled)
      source, tokens, seconds, metrics = Batches(), 0, 0.0, []
      for k in range(K + 1):
        t = time.perf_counter()
        rollout, m = strategy(state, source, jax.random.fold_in(jax.random.key(args.seed), k))
        state, _ = step_lib.update(state, rollout, jax.random.key(k), loss_config=loss,
                                   group_size=G)
        jax.block_until_ready(state.step)
        if k:  # the first step compiles
          seconds += time.perf_counter() - t
          tokens += int(np.asarray(rollout.loss_mask).sum())
          metrics.append({key: float(v) for key, v in m.items()})
      rate = tokens / seconds
      out[f"{way}_tokens_per_s"] = rate
      line = f"  {way}: {rate:,.0f} trained tokens/s ({tokens} in {seconds:.2f} s)"
      if options:
        for key in ("carry/occupancy", "carry/staleness/mean", "carry/length_bias"):
          out[key.replace("carry/", "carried_").replace("/", "_")] = float(
              np.mean([m[key] for m in metrics]))
        line += (f", occupancy {out['carried_occupancy']:.1%}, staleness "
                 f"{out['carried_staleness_mean']:.2f}")
      log(line)
  finally:
    host.close()
  out["vs_sync"] = out["carried_tokens_per_s"] / out["sync_tokens_per_s"]
  log(f"carried / sync: {out['vs_sync']:.2f}x trained tokens a second")
  return out


def run(args) -> dict:
  log = functools.partial(print, flush=True)
  if args.e2e:
    return end_to_end(args, log)
  d = SETTINGS["quick" if args.quick else args.device]
  d = dict(d, **{k: getattr(args, k) for k in ("prompts", "groups", "T", "rollouts", "extra")
                 if getattr(args, k) is not None})
  B, G, T, K, E = d["prompts"], d["groups"], d["T"], d["rollouts"], d["extra"]
  S = B * G
  target = draw_lengths(args.seed, B * (K + E + 1), G, T, args.sigma)
  log(f"B={B} x G={G}, S={S}, T={T}, {K} rollouts, lengths lognormal (median T/8, sigma "
      f"{args.sigma}), seed {args.seed}; carried: {E} batch(es) beside the returned one")
  settings = [(0, "recompute")] + [(s, p) for p in PARTIAL for s in STALENESS]
  rows, sync = [], None
  for staleness, partial in settings:
    runs, totals = replay(target, B=B, G=G, T=T, S=S, extra=E if staleness else 0,
                          max_staleness=staleness, partial=partial, rollouts=K)
    totals["trained_rows"] = K * B * G
    f = figures(totals)
    if staleness == 0:
      sync = f
    f["vs_sync"] = sync["steps_per_token"] / f["steps_per_token"]
    if d["check"] or args.check:
      check(target, runs, B=B, G=G, T=T, S=S, extra=E if staleness else 0,
            max_staleness=staleness, partial=partial, seed=args.seed, log=log)
    name = "sync" if staleness == 0 else f"staleness {staleness} {partial}"
    log(f"{name:<24} steps/token {f['steps_per_token']:.4f} ({f['vs_sync']:.2f}x sync)  "
        f"occupancy {f['occupancy']:.1%}  length bias {f['length_bias']:+.1%}  staleness "
        f"{f['staleness_mean']:.2f} (max {f['staleness_max']})  wasted "
        f"{f['wasted_per_token']:.2f}/token  prefill {f['prefill_per_token']:.2f}/token")
    rows.append({"staleness": staleness, "partial": None if staleness == 0 else partial, **f})
  return {"B": B, "G": G, "S": S, "T": T, "rollouts": K, "extra": E, "sigma": args.sigma,
          "settings": rows}
