"""DAPO's dynamic sampling: the `streaming` rollout (one engine run, groups scored as they
end) against `dynamic` (whole rounds of the engine), on ragged completions where a
fraction of the groups are degenerate (every row the same reward: dropped).

Both pick the same groups (tests/test_train_rollout.py proves it token for token;
this run checks the prompts); this times them. A group is accepted or not by a
table the reward function looks up by example id, drawn with probability
--accept, after --verify-ms of "verification" (a sleep a reward call, however many
rows it holds: verifiers in parallel). Completion lengths are geometric with mean
about T/8: the random model's stop id keeps a fixed logit (common.with_stop_logit).
Three rollouts through the registered strategies, each fed by a source over the
same prompts, R batches at most:
  overlap   `streaming`, groups verified on host threads while the engine decodes
            (the default);
  stream    `streaming` with overlap=False: the loop waits for each group's call;
  rounds    `dynamic`: a batch at a time, each round's groups verified in one call.
Prints each one's seconds (best of --reps) and groups decoded; rounds / stream is
the ratio of the two ways.

Settings by --device: gpu and tpu, Qwen2.5-0.5B's shapes in bf16, 32 prompts x 8,
P=128, T=2048, 256 slots; cpu, the 'small' Llama in float32 on XLA's kernels, 4 x 8,
P=32, T=128, 16 slots; --quick, the 'tiny' preset, 2 x 4, P=8, T=16, 8 slots.
--dry-run: the three programs traced, none compiled or run.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import common
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling import engine as engine_lib
from grpojax.sampling.strategies import SamplingParams
from grpojax.train import rollout as rollout_lib
from grpojax.train import state as state_lib
from grpojax.train import strategy as strategy_lib

# (model, dtype, kernels, B, G, P, T, slots, page size, reps) by setting.
SETTINGS = {"quick": ("tiny", "float32", "xla", 2, 4, 8, 16, 8, 8, 1),
            "cpu": ("small", "float32", "xla", 4, 8, 32, 128, 16, 128, 2),
            "gpu": ("qwen2.5-0.5b", "bfloat16", None, 32, 8, 128, 2048, 256, 128, 2),
            "tpu": ("qwen2.5-0.5b", "bfloat16", None, 32, 8, 128, 2048, 256, 128, 2)}
WAYS = {"overlap": ("streaming", dict(overlap=True)), "stream": ("streaming", dict(overlap=False)),
        "rounds": ("dynamic", {})}


def add_arguments(parser) -> None:
  parser.add_argument("--prompts", type=int, help="B prompts a step")
  parser.add_argument("--T", type=int, help="max completion tokens")
  parser.add_argument("--slots", type=int, help="the engine's decode slots")
  parser.add_argument("--rounds", type=int, default=4, help="batches a step draws at most")
  parser.add_argument("--accept", type=float, default=0.5, help="P(a group is accepted)")
  parser.add_argument("--verify-ms", type=float, default=0.0,
                      help="milliseconds each verification call takes")
  parser.add_argument("--reps", type=int, help="timed rollouts of each; the best counts")
  parser.add_argument("--seed", type=int, default=0)


def rollout_strategy(name: str, config, host, *, prompts: int, rounds: int, **options):
  """The rollout strategy registered as `name`: `(state, source, rng) -> (Rollout,
  metrics)`."""
  return strategy_lib.make(name, config, host, num_prompts=prompts, max_rounds=rounds, **options)


class Batches:
  """A rollout source over fixed prompts [n, P], B at a time, from the first again after
  the last; rewind(back, used) serves again from prompt `used` of the batch `back`
  draws ago."""

  def __init__(self, prompts: np.ndarray, B: int):
    self.prompts, self.B, self.at, self.marks = prompts, B, 0, []

  def next(self) -> dict:
    self.marks.append(self.at)
    rows = np.arange(self.at, self.at + self.B) % len(self.prompts)
    self.at += self.B
    tokens = jnp.asarray(self.prompts[rows], jnp.int32)
    return {"prompt_tokens": tokens, "prompt_mask": jnp.ones_like(tokens),
            "example_ids": jnp.asarray(rows, jnp.int32)}

  def rewind(self, back: int, used: int) -> None:
    self.at = self.marks[-back] + used
    self.marks.clear()


class Setup:
  """The run's model, train state, prompts, accept table, reward host and rollout config."""

  def __init__(self, args):
    name, dtype, kernels, B, G, P, T, S, p, reps = SETTINGS["quick" if args.quick
                                                           else args.device]
    self.B, self.G, self.P, self.T = args.prompts or B, G, P, args.T or T
    self.S, self.R, self.reps = args.slots or S, args.rounds, args.reps or reps
    self.name, self.dtype = name, dtype
    # P(stop) = 8/T a step against V - 1 logits near 0: lengths geometric, mean ~T/8.
    stop, V = min(8 / self.T, 0.5), common.model_config(name).vocab_size
    cfg, weights = common.random_model(name, args.seed, dtype, kernels,
                                       stop_logit=math.log(stop * (V - 1) / (1 - stop)))
    self.kernels = cfg.kernels
    self.state = state_lib.create_train_state(cfg, weights, optax.identity(),
                                              with_reference=False)
    rng = np.random.default_rng(args.seed)
    self.prompts = rng.integers(0, V - 1, (self.R * self.B, P))
    accepted = rng.random(self.R * self.B) < args.accept

    def table_reward(completions, accept, **unused):
      """A reward call: its verification time, then alternating 0/1 rows for an accepted
      example (rewards that differ within its group), 0 for the others."""
      time.sleep(args.verify_ms / 1e3)
      return [float(i % 2) if a else 0.0 for i, a in enumerate(accept)]

    self.host = HostRewards([table_reward], decode=lambda rows: [""] * len(rows),
                            lookup=lambda i: {"prompt": "", "accept": bool(accepted[i])},
                            num_workers=0)
    self.config = rollout_lib.RolloutConfig(
        group_size=G, max_new_tokens=self.T, sampling=SamplingParams(temperature=1.0),
        eos_ids=(V - 1,), pad_id=0, engine=engine_lib.EngineConfig(slots=self.S, page_size=p))

  def strategy(self, way: str):
    name, options = WAYS[way]
    return rollout_strategy(name, self.config, self.host, prompts=self.B, rounds=self.R,
                            **options)


def dry_run(args) -> dict:
  """The three rollouts' programs traced on abstract inputs, none compiled."""
  s = Setup(args)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  for way in WAYS:
    s.strategy(way).lower(s.state, rng, prompt_length=s.P)
    print(f"  {way}: traced", flush=True)
  s.host.close()
  return {"traced": list(WAYS)}


def run(args) -> dict:
  s = Setup(args)
  B, T, reps = s.B, s.T, s.reps
  print(f"{jax.devices()[0].device_kind}: {s.name} model, {s.dtype}, kernels={s.kernels}; "
        f"B={B} x G={s.G}, P={s.P}, T={T}, S={s.S}, up to {s.R} batches, accept "
        f"{args.accept}, verify {args.verify_ms} ms", flush=True)
  out = dict(model=s.name, B=B, G=s.G, T=T, rounds=s.R, accept=args.accept,
             verify_ms=args.verify_ms)
  picked = {}
  key = jax.random.key(args.seed)
  state, prompts = s.state, s.prompts
  for way, (strategy, _) in WAYS.items():
    fn = s.strategy(way)
    jax.block_until_ready(fn(state, Batches(prompts, B), key)[0])  # compiles
    best, metrics = math.inf, None
    for _ in range(reps):
      t = time.perf_counter()
      rollout, metrics = fn(state, Batches(prompts, B), key)
      jax.block_until_ready(rollout)
      best = min(best, time.perf_counter() - t)
    picked[way] = np.asarray(rollout.prompt_tokens)
    groups = int(metrics.get("dynamic_sampling/decoded_groups",
                             B * int(metrics["dynamic_sampling/rounds"])))
    out.update({f"{way}_s": best, f"groups_{way}": groups,
                f"mean_length_{way}": float(np.asarray(rollout.mask).sum(1).mean())})
    print(f"  {way} ({strategy}): {best:.2f} s, {groups} groups begun", flush=True)
  s.host.close()
  assert np.array_equal(picked["stream"], picked["rounds"]), "different groups"
  assert np.array_equal(picked["stream"], picked["overlap"]), "different groups"
  out.update(rounds_vs_stream=out["rounds_s"] / out["stream_s"],
             stream_vs_overlap=out["stream_s"] / out["overlap_s"],
             rounds_vs_overlap=out["rounds_s"] / out["overlap_s"])
  print(f"rounds / stream {out['rounds_vs_stream']:.2f}x, stream / overlap "
        f"{out['stream_vs_overlap']:.2f}x, rounds / overlap {out['rounds_vs_overlap']:.2f}x",
        flush=True)
  return out
