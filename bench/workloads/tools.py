"""Tool turns in the rollout engine: the same rows with and without a tool of fixed
latency, and whether the slots keep decoding while tools run.

Each row draws its completion as the engine bench's ragged workload does (the random
model's stop id keeps a fixed logit: lengths geometric, mean about T/8). With tools,
every stop the row draws while it has calls left is a tool call: the row is held in
its slot, a host thread sleeps --tool-ms (the tool) and answers with --response
forced tokens, and the row draws on (sampling/engine/turns.py; the host is
grpojax.tools.ToolRunner with its answer replaced by the sleep). Three runs of one
engine over the same prompts and keys:
  plain     no tools: each row ends at its first stop;
  instant   tools that answer at once (the hook's own cost: holds, hand-offs, polls);
  latency   tools that take --tool-ms each, on host threads while the loop decodes;
  blocking  the same tools run one after another inside the loop's hand-off, which
            waits for them (as a trainer that stops generating to run its tools).
Prints each run's seconds (best of --reps), decode steps, slot use (the share of
slot-steps that drew a token: tokens drawn after the first / (S x steps)) and the
policy's tokens per second. The figures that matter: latency's slot use and
tokens/s against instant's (rows whose tools have answered go on decoding while
others' tools run). A held row keeps its slot: with fewer slots than rows
(--slots) the rows waiting for slots wait on the tools too.

Settings by --device: gpu and tpu, Qwen2.5-0.5B's shapes in bf16, 32 prompts x 8,
P=128, T=2048; cpu, the 'small' Llama in float32 on XLA's kernels, 4 x 8, P=32,
T=256; --quick, the 'tiny' preset, 2 x 4, P=8, T=48; a slot per row (the engine's
default) unless --slots.
--dry-run: the programs traced, none compiled or run.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np

import common
from grpojax.sampling import engine as engine_lib
from grpojax.sampling.engine.turns import TurnHook
from grpojax.sampling.strategies import SamplingParams
from grpojax.tools import ToolRunner

# (model, dtype, kernels, B, G, P, T, slots, page size, reps) by setting.
SETTINGS = {"quick": ("tiny", "float32", "xla", 2, 4, 8, 48, 0, 8, 1),
            "cpu": ("small", "float32", "xla", 4, 8, 32, 256, 0, 64, 2),
            "gpu": ("qwen2.5-0.5b", "bfloat16", None, 32, 8, 128, 2048, 0, 128, 2),
            "tpu": ("qwen2.5-0.5b", "bfloat16", None, 32, 8, 128, 2048, 0, 128, 2)}
RUNS = ("plain", "instant", "latency", "blocking")


def add_arguments(parser) -> None:
  parser.add_argument("--prompts", type=int, help="B prompts")
  parser.add_argument("--T", type=int, help="max completion tokens (tool tokens included)")
  parser.add_argument("--slots", type=int, help="the engine's decode slots (0: one per row)")
  parser.add_argument("--tool-ms", type=float, default=50.0, help="milliseconds a call takes")
  parser.add_argument("--response", type=int, default=8, help="tokens of a tool's answer")
  parser.add_argument("--calls", type=int, default=2, help="tool turns a row takes at most")
  parser.add_argument("--reps", type=int, help="timed runs of each; the best counts")
  parser.add_argument("--seed", type=int, default=0)


class SleepingTools(ToolRunner):
  """A ToolRunner whose every call sleeps `seconds` and answers with `response` ids."""

  def __init__(self, seconds: float, response: list[int]):
    super().__init__(None, [lambda: None], threads=64)
    self.latency_s, self.response = seconds, response

  def _answer(self, row, turn, length, budget):
    time.sleep(self.latency_s)
    with self._lock:
      self.calls += 1
    return self.response if length + len(self.response) <= budget else None


class BlockingTools(SleepingTools):
  """SleepingTools whose calls run in the hand-off itself, one after another: the
  loop waits for them."""

  def submit(self, first_row, rows, *args):
    time.sleep(self.latency_s * int(np.sum(np.asarray(rows) >= 0)))
    seconds, self.latency_s = self.latency_s, 0.0
    try:
      return super().submit(first_row, rows, *args)
    finally:
      self.latency_s = seconds


class Setup:
  def __init__(self, args):
    name, dtype, kernels, B, G, P, T, S, p, reps = SETTINGS["quick" if args.quick
                                                           else args.device]
    self.B, self.G, self.P, self.T = args.prompts or B, G, P, args.T or T
    self.S, self.reps, self.name, self.dtype = args.slots or S, args.reps or reps, name, dtype
    stop, V = min(8 / self.T, 0.5), common.model_config(name).vocab_size
    self.cfg, self.weights = common.random_model(
        name, args.seed, dtype, kernels, stop_logit=math.log(stop * (V - 1) / (1 - stop)))
    rng = np.random.default_rng(args.seed)
    self.tokens = jax.numpy.asarray(rng.integers(0, V - 1, (self.B, P)), jax.numpy.int32)
    self.eos = (V - 1,)
    response = [int(t) for t in rng.integers(1, V - 1, args.response)]
    self.hosts = {"instant": SleepingTools(0.0, response),
                  "latency": SleepingTools(args.tool_ms / 1e3, response),
                  "blocking": BlockingTools(args.tool_ms / 1e3, response)}
    self.engine = engine_lib.EngineConfig(slots=self.S, page_size=p)
    self.S = self.engine.sizes(self.B * G, self.T)[0]
    self.hooks = {run: TurnHook(host=h, eos=self.eos, max_calls=args.calls,
                                response_tokens=args.response, handoff=self.S)
                  for run, h in self.hosts.items()}

  def generate(self, run: str, key):
    hook = self.hooks.get(run)
    kw = {} if hook is None else {"hook": hook}
    if hook is not None:
      hook.host.begin()
    return engine_lib.generate(self.cfg, self.weights, self.tokens, jax.numpy.ones_like(self.tokens),
                               rng=key, num_samples=self.G, max_new_tokens=self.T,
                               sampling=SamplingParams(temperature=1.0), eos_ids=self.eos,
                               pad_id=0, engine=self.engine, with_stats=True, **kw)

  def close(self):
    for h in self.hosts.values():
      h.close()


def dry_run(args) -> dict:
  s = Setup(args)
  key = jax.eval_shape(lambda: jax.random.key(0))
  for run in RUNS:
    jax.eval_shape(lambda k, run=run: s.generate(run, k), key)
    print(f"  {run}: traced", flush=True)
  s.close()
  return {"traced": list(RUNS)}


def run(args) -> dict:
  s = Setup(args)
  print(f"{jax.devices()[0].device_kind}: {s.name} model, {s.dtype}, kernels={s.cfg.kernels}; "
        f"B={s.B} x G={s.G}, P={s.P}, T={s.T}, S={s.S}; tools: {args.tool_ms} ms, "
        f"{args.response} tokens, up to {args.calls} calls a row", flush=True)
  out = dict(model=s.name, B=s.B, G=s.G, T=s.T, slots=s.S, tool_ms=args.tool_ms,
             response=args.response, calls=args.calls)
  key = jax.random.key(args.seed)
  tokens = {}
  for run in RUNS:
    jax.block_until_ready(s.generate(run, key))  # compiles
    best, res = math.inf, None
    for _ in range(s.reps):
      t = time.perf_counter()
      res = s.generate(run, key)
      jax.block_until_ready(res)
      best = min(best, time.perf_counter() - t)
    sample, stats = res
    policy = np.asarray(sample.mask if sample.loss_mask is None else sample.loss_mask).sum()
    tokens[run] = np.asarray(sample.tokens)
    steps = int(stats.steps)
    # Every token but a row's first (the prefill's) is one slot's draw in one step.
    use = (np.asarray(sample.mask).sum() - s.B * s.G) / max(s.S * steps, 1)
    calls = s.hosts[run].calls if run in s.hosts else 0  # the last run's
    out.update({f"{run}_s": best, f"{run}_steps": steps, f"{run}_slot_use": float(use),
                f"{run}_tokens_per_s": float(policy) / best, f"{run}_calls": calls})
    print(f"  {run}: {best:.3f} s, {steps} steps, slot use {use:.3f}, "
          f"{float(policy) / best:.0f} policy tokens/s, {calls} calls", flush=True)
  s.close()
  # The tools' latency changes when rows draw, never what they draw.
  for run in ("latency", "blocking"):
    assert np.array_equal(tokens["instant"], tokens[run]), f"{run} changed the rows"
  out.update(latency_vs_instant_tokens_per_s=out["latency_tokens_per_s"]
             / out["instant_tokens_per_s"],
             latency_vs_blocking_tokens_per_s=out["latency_tokens_per_s"]
             / out["blocking_tokens_per_s"])
  print(f"latency / instant tokens/s {out['latency_vs_instant_tokens_per_s']:.2f}x, latency / "
        f"blocking {out['latency_vs_blocking_tokens_per_s']:.2f}x", flush=True)
  return out
