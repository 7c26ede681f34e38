"""The engine alone, ragged and full, in this process's settings: for comparing XLA flags
or PRNG implementations across processes on one device, without the lockstep runs of
bench/engine.py (which take three quarters of its time at T = 4096).

  python bench/engine_variants.py --T 4096 --reps 2 --label base
  XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL \
    python bench/engine_variants.py --T 4096 --reps 2 --label cmdbuf
  JAX_DEFAULT_PRNG_IMPL=unsafe_rbg python bench/engine_variants.py --T 4096 --label rbg
  python bench/engine_variants.py --T 4096 --tail-slots 0 --label no-tail   # never narrowed

Each call prints its runs' best seconds and one JSON line last:
{"label": .., "T": .., "tail": widths, "ragged_steps": .., "ragged_tail_steps": ..,
"engine ragged": s, "engine full": s, "ragged_vs_full": ..}.
ragged_vs_full is the issue's ratio: useful tokens/s ragged over full.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from grpojax.sampling import engine as engine_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine as bench  # noqa: E402


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--label", default="")
  parser.add_argument("--model", default=bench.QWEN)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--kernels", default="gpu")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--slots", type=int, default=256)
  parser.add_argument("--page-size", type=int, default=engine_lib.EngineConfig().page_size)
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sigma", type=float, default=1.0)
  parser.add_argument("--tail-slots", default="auto",
                      help="EngineConfig.tail_slots: auto, 0 (none) or widths (64,16)")
  args = parser.parse_args(argv)
  cfg, weights = bench.bench_model(args.model, args.seed, args.dtype, args.kernels)
  tail = (None if args.tail_slots == "auto"
          else tuple(int(n) for n in args.tail_slots.split(",") if int(n)))
  s = bench.Shapes(B=args.prompts, G=args.groups, P=args.prompt_len, S=args.slots,
                   p=args.page_size, pages=0, tail=tail)
  lengths = bench.draw_lengths(args.seed, s.N, args.T, args.sigma)
  runs = bench.RUNS[:2]
  best = bench.timed_runs(cfg, weights, s, args.T, lengths, reps=args.reps, seed=args.seed,
                          runs=runs)
  sec = {run: best[run][0] for run in runs}
  tokens = {"engine ragged": int(lengths.sum()), "engine full": s.N * args.T}
  stats = best["engine ragged"][1]
  out = dict(label=args.label, T=args.T, device=str(jax.devices()[0].device_kind),
             tail=list(s.engine.tail(s.S)), ragged_steps=int(stats.steps),
             ragged_tail_steps=int(stats.tail_steps),
             prng=jax.config.jax_default_prng_impl, xla_flags=os.environ.get("XLA_FLAGS", ""),
             **sec, ragged_vs_full=(tokens["engine ragged"] / sec["engine ragged"])
             / (tokens["engine full"] / sec["engine full"]))
  print(json.dumps(out), flush=True)
  return out


if __name__ == "__main__":
  main()
