"""What a decode step costs when almost no attention is left: one row runs to T, the
other N - 1 stop at their second token, so nearly every step of a run has one live row.

Per step (the run's seconds over its T - 1 steps), at Qwen2.5-0.5B's shapes in bf16
with random weights, B=32 x G=8, P=128, S slots (--slots, comma-separated):
  engine gpu    `engine.generate`, kernels="gpu" (the Triton paged kernel)
  engine xla    the same on XLA's paged attention
  generate      today's lockstep, which reads every row's whole buffer every step
and the floor of such a step: the weights read once over the copy bandwidth. The gap
between a step and that floor is what the step pays besides bytes (launches, the
sampler, the serial page loop of the one long row).

  python bench/engine_overhead.py [--T 4096] [--reps 2] [--slots 256,16] [--no-generate]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.sampling import engine as engine_lib
from grpojax.sampling import sampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import QWEN, SAMPLING, bench_model, copy_bandwidth  # noqa: E402


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--model", default=QWEN)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--slots", default="256", help="the engine's, comma-separated")
  parser.add_argument("--kernels", default="gpu,xla", help="the engine's, comma-separated")
  parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                      help="also time the lockstep")
  a = parser.parse_args(argv)
  B, G, P, T = a.prompts, a.groups, 128, a.T
  N = B * G
  bandwidth = copy_bandwidth(2**31 if jax.default_backend() != "cpu" else 2**26)
  stop = np.full(N, 2, np.int32)
  stop[0] = T
  rows = []
  runs = [(f"engine {k} S={S}", k, int(S)) for k in a.kernels.split(",") if k
          for S in a.slots.split(",")]
  runs += [("generate", None, N)] if a.generate else []
  for name, kernels, S in runs:
    cfg, weights = bench_model(a.model, 0, a.dtype, kernels)
    V = cfg.vocab_size
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, V - 1, (B, P)), jnp.int32)
    kw = dict(rng=jax.random.key(0), num_samples=G, max_new_tokens=T, sampling=SAMPLING,
              eos_ids=(V - 1,), pad_id=0)
    conf = engine_lib.EngineConfig(slots=S, page_size=128)

    def call(stop_at):
      stop_at = jnp.asarray(stop_at, jnp.int32)
      t = time.perf_counter()
      if name.startswith("engine"):
        out = engine_lib.generate(cfg, weights, prompts, jnp.ones_like(prompts), engine=conf,
                                  stop_at=stop_at, **kw)
      else:
        out = sampler.generate_from_params(cfg, weights, prompts, jnp.ones_like(prompts),
                                           stop_at=stop_at, **kw)
      got = np.asarray(out.lengths)
      seconds = time.perf_counter() - t
      assert np.array_equal(got, np.asarray(stop_at)), "rows did not stop where forced"
      return seconds

    call(np.full(N, 2, np.int32))
    best = min(call(stop) for _ in range(a.reps))
    weight_bytes = sum(int(w.nbytes) for w in weights.values())
    rows.append((name, best / (T - 1), weight_bytes / bandwidth))
    print(f"{name}: {best:.2f} s, {1e3 * best / (T - 1):.3f} ms a step", flush=True)
    weights = None  # freed before the next model
  print(f"\n{jax.devices()[0].device_kind}, copy bandwidth {bandwidth / 1e9:,.0f} GB/s, T={T}, "
        f"one row of {N} running")
  print(f"  {'run':<20} {'ms/step':>8} {'floor ms':>9} {'x floor':>8}")
  for name, step, floor in rows:
    print(f"  {name:<20} {1e3 * step:>8.3f} {1e3 * floor:>9.3f} {step / floor:>8.1f}")


if __name__ == "__main__":
  main()
