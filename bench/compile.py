"""Compile time of `generate` (trace + lower, then XLA compile) on abstract weights.

No weights are materialised: the parameters are `jax.ShapeDtypeStruct`s, so a
Qwen2.5-0.5B-shaped program compiles on a laptop. Prints one line per layer
count, so growth with depth shows directly.

  python bench/compile.py                       # Qwen2.5-0.5B shapes, 16 x 8 rows, P=128, T=256, bf16
  python bench/compile.py --layers 2,8,24       # the same at several depths
  python bench/compile.py --preset tiny --rows 2x2 --prompt 8 --new 16
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from grpojax import ops
from grpojax.models import config as config_lib
from grpojax.models import transformer
from grpojax.sampling import sampler, strategies


def compile_seconds(cfg, B: int, G: int, P: int, T: int) -> tuple[float, float]:
  """(trace + lower seconds, compile seconds) of one `generate` program."""
  weights = {n: jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.param_dtype))
             for n, (shape, _) in transformer.param_specs(cfg).items()}
  prompts = jax.ShapeDtypeStruct((B, P), jnp.int32)
  fn = lambda w, p, m, rng: sampler.generate_from_params(  # noqa: E731
      cfg, w, p, m, rng=rng, num_samples=G, max_new_tokens=T,
      sampling=strategies.SamplingParams(1.0), eos_ids=(0,), pad_id=0)
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(weights, prompts, jax.ShapeDtypeStruct((B, P), jnp.int32),
                              jax.random.key(0))
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t0, time.perf_counter() - t1


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="qwen2.5-0.5b")
  ap.add_argument("--layers", default="", help="comma-separated layer counts (default: the preset's)")
  ap.add_argument("--rows", default="16x8", help="B x G")
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new", type=int, default=256)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--kernels", default="xla", choices=ops.BACKENDS)
  args = ap.parse_args()
  B, G = (int(x) for x in args.rows.split("x"))
  base = config_lib.get_preset(args.preset, dtype=args.dtype, kernels=args.kernels)
  base = ops.resolve(base)
  depths = [int(x) for x in args.layers.split(",")] if args.layers else [base.num_layers]
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.preset}, {B}x{G} rows, "
        f"P={args.prompt}, T={args.new}, {args.dtype}, kernels={base.kernels}")
  for L in depths:
    lower_s, compile_s = compile_seconds(base.replace(num_layers=L), B, G, args.prompt, args.new)
    print(f"layers={L:3d}  lower {lower_s:6.2f} s  compile {compile_s:6.2f} s  "
          f"total {lower_s + compile_s:6.2f} s")


if __name__ == "__main__":
  main()
