"""Full-sequence attention's forward + backward compiled for a TPU v5e on this CPU:
the splash kernel (grpojax.ops.pallas_tpu) against the XLA blockwise reference
(grpojax.ops.xla.blockwise_attention, block 512), by sequence length.

Qwen2.5-0.5B's attention, one row by default (--rows): 14 query heads over 2 kv
heads, H = 64, bf16, all keys valid, T = S (causal); `jax.grad` of the sum of
the outputs with respect to q, k and v. Compiled by libtpu (grpojax.targets):
nothing runs. Per implementation:
  temp   `memory_analysis().temp_size_in_bytes`: temporaries in HBM. Buffers
         that XLA's memory-space assignment places in the v5e's on-chip VMEM
         (128 MiB; `S(1)` in the optimized HLO) are not counted, hence the
         zeros of small programs; --rows 16 shows the scaling.
  GFLOP  matmul FLOPs of forward + backward. The reference's are read from its
         optimized HLO (`targets.read_program`: every dot, loop bodies times
         their trips; `cost_analysis()` counts a loop body once). The Mosaic
         kernels are opaque to XLA (no HLO body, no cost estimate: their
         `cost_analysis()` flops are ~0), so the splash figure is counted from
         its block schedule: blocks the causal mask leaves visible (splash skips
         the rest) x 2·bq·bkv·H per matmul, 2 matmuls in the forward, 4 in the
         dK/dV kernel, 3 in the dQ kernel. The reference computes every block
         (7 matmuls each: its masks are data, not a schedule).
For scale, [S, S] f32 scores of all heads: B·Nq·S²·4 bytes.

  TPU_LIBRARY_PATH=/tmp/tpulib/libtpu/libtpu.so python bench/attention_tpu.py
  python bench/attention_tpu.py --rows 16 --lengths 2048,8192 --heads 14x2 --head-dim 128
"""

from __future__ import annotations

import argparse
import os
import time

# Compile-only: no backend but the CPU starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpojax import targets  # noqa: E402
from grpojax.ops import pallas_tpu, xla  # noqa: E402

MiB = 2**20


def compile_grad(attn, B: int, S: int, Nq: int, K: int, H: int, target: str):
  """jax.grad (q, k, v) of sum(attn(q, k, v, kv_valid)) compiled for `target`."""
  bf16 = jnp.bfloat16
  device = targets.devices(target, chips=1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in
          (((B, S, Nq, H), bf16), ((B, S, K, H), bf16), ((B, S, K, H), bf16),
           ((B, S), jnp.bool_))]
  loss = lambda q, k, v, valid: jnp.sum(attn(q, k, v, valid).astype(jnp.float32))  # noqa: E731
  with targets.quiet_stderr():
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


def splash_flops(S: int, Nq: int, H: int, block: int) -> float:
  """Matmul FLOPs of the splash kernels' forward + backward at T = S: visible
  blocks (from the kernel's own block mask) x 9 matmuls of 2·bq·bkv·H."""
  b = pallas_tpu.block_size(S, block)
  layout = pallas_tpu._Layout(S, S, b, b, False)  # noqa: SLF001
  kernel = pallas_tpu._kernel(layout)  # noqa: SLF001 -- one block table for every head
  visible = int(np.count_nonzero(np.asarray(kernel.fwd_mask_info.block_mask)))
  return visible * Nq * 9 * 2 * b * b * H


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="1024,2048,4096,8192")
  parser.add_argument("--rows", type=int, default=1, help="B")
  parser.add_argument("--heads", default="14x2", help="query heads x kv heads")
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--block", type=int, default=1024, help="model.attention_block (the hint)")
  parser.add_argument("--ref-block", type=int, default=512, help="the reference's block")
  parser.add_argument("--target", default="tpu-v5e")
  args = parser.parse_args()
  if not targets.available(args.target):
    raise SystemExit(f"cannot compile for {args.target}: {targets.INSTALL}")
  Nq, K = (int(x) for x in args.heads.split("x"))
  H = args.head_dim
  scale = H**-0.5
  kernels = {
      "splash": lambda q, k, v, m: pallas_tpu.attention(q, k, v, m, scale, block=args.block),
      "xla": lambda q, k, v, m: xla.blockwise_attention(q, k, v, m, scale, args.ref_block),
  }
  B = args.rows
  print(f"{args.target}: forward + backward of {B} row(s), Nq={Nq} K={K} H={H} bf16, "
        f"splash block hint {args.block}, xla block {args.ref_block}")
  head = (f"{'S':>6} {'block':>5} {'[S,S] f32':>10} | {'splash temp':>11} {'GFLOP':>7} "
          f"{'Mosaic':>6} {'s':>5} | {'xla temp':>9} {'GFLOP':>7} {'s':>5}")
  print(head)
  print("-" * len(head))
  for S in (int(s) for s in args.lengths.split(",")):
    row = {}
    for name, attn in kernels.items():
      start = time.perf_counter()
      compiled = compile_grad(attn, args.rows, S, Nq, K, H, args.target)
      row[name] = (compiled.memory_analysis().temp_size_in_bytes,
                   time.perf_counter() - start, compiled)
    (s_temp, s_sec, s_comp), (x_temp, x_sec, x_comp) = row["splash"], row["xla"]
    s_flops = B * splash_flops(S, Nq, H, args.block)
    x_flops = targets.read_program(x_comp).matmul_flops
    scores = B * Nq * S * S * 4
    print(f"{S:>6} {pallas_tpu.block_size(S, args.block):>5} {scores / MiB:>6.0f} MiB | "
          f"{s_temp / MiB:>7.1f} MiB {s_flops / 1e9:>7.1f} {targets.mosaic_kernels(s_comp):>6} "
          f"{s_sec:>5.1f} | {x_temp / MiB:>5.1f} MiB {x_flops / 1e9:>7.1f} {x_sec:>5.1f}")
  print("temp: memory_analysis().temp_size_in_bytes; GFLOP: matmul FLOPs, forward + backward "
        "(splash: visible blocks x 9 matmuls; xla: read_program of its HLO); Mosaic: kernels "
        "in the program; s: trace + compile seconds.")


if __name__ == "__main__":
  main()
