"""The GPU attention kernels (grpojax.ops.pallas_gpu) against the XLA blockwise
reference (ops.xla.blockwise_attention, block 512), both compiled for an H100
on this CPU through the CUDA PJRT plugin (grpojax.targets): nothing runs.

One attention layer's forward and backward (jax.grad of the outputs' sum) for
one row, Nq=14 query heads over K=2 kv heads, H=64, bf16, causal, at S = 1024,
2048, 4096, 8192. Per program: compile seconds, temporary bytes
(memory_analysis), kernels launched per call, and matmul FLOPs. XLA's are read
from its optimized HLO (targets.read_program: every dot, loop bodies times
their trips); the Pallas kernels' dots are inside Triton custom calls, which
the HLO does not show, so theirs are counted from the kernels' tile schedule
(every tile a program visits, masked or not). For scale, the [Nq, S, S]
float32 scores a materialised attention would hold.

  GRPOJAX_CUDA_PLUGIN=DIR/jax_plugins/xla_cuda12/xla_cuda_plugin.so JAX_PLATFORMS=cpu \
      python bench/attention_gpu.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from grpojax import targets
from grpojax.ops import pallas_gpu, xla

B, NQ, K, H = 1, 14, 2, 64
LENGTHS = (1024, 2048, 4096, 8192)
XLA_BLOCK = 512
MiB = 2**20


def kernel_flops(T: int, S: int) -> float:
  """Matmul FLOPs of the kernels' forward and backward: 2·H per row-key pair per
  dot (forward 2 dots, dq 3, dk/dv 4), over each program's visited tiles."""
  tiles = pallas_gpu._Tiles(*pallas_gpu.FORWARD_TILES, *pallas_gpu.DQ_TILES,  # noqa: SLF001
                            *pallas_gpu.DKV_TILES)
  Tp = -(-T // tiles.q_multiple) * tiles.q_multiple
  Sp = -(-S // tiles.k_multiple) * tiles.k_multiple
  offset = S - T

  def rows_by_keys(bq, bk):  # query tiles over the key tiles they reach (causal bound)
    return sum(min(-(-(offset + (i + 1) * bq) // bk), Sp // bk) * bq * bk for i in range(Tp // bq))

  def keys_by_rows(bk, bq):  # key tiles over the query tiles from the first that sees them
    return sum((Tp // bq - max(j * bk - offset, 0) // bq) * bq * bk for j in range(Sp // bk))

  pairs = (2 * rows_by_keys(tiles.fwd_q, tiles.fwd_k) + 3 * rows_by_keys(tiles.dq_q, tiles.dq_k)
           + 4 * keys_by_rows(tiles.dkv_k, tiles.dkv_q))
  return 2.0 * H * B * NQ * pairs


def compile_layer(attention, S: int, device):
  sharding = jax.sharding.SingleDeviceSharding(device)
  q = jax.ShapeDtypeStruct((B, S, NQ, H), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16, sharding=sharding)
  valid = jax.ShapeDtypeStruct((B, S), jnp.bool_, sharding=sharding)

  def loss(q, k, v, kv_valid):
    return jnp.sum(attention(q, k, v, kv_valid, H**-0.5).astype(jnp.float32))

  start = time.perf_counter()
  # jax 0.11's Pallas Triton lowering reads the GPU it targets from the default device.
  with jax.default_device(device), targets.quiet_stderr():
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile()
  return compiled, time.perf_counter() - start


def main():
  if not targets.available("h100-80gb"):
    print(f"no CUDA plugin here: {targets.CUDA_INSTALL}")
    return
  device = targets.devices("h100-80gb", chips=1)[0]
  programs = {
      "pallas_gpu": lambda q, k, v, m, s: pallas_gpu.attention(q, k, v, m, s, block=1024),
      f"xla block {XLA_BLOCK}": lambda q, k, v, m, s: xla.blockwise_attention(q, k, v, m, s,
                                                                             XLA_BLOCK),
  }
  print(f"H100 (compiled on this CPU): one layer's forward + backward, B={B} Nq={NQ} K={K} "
        f"H={H} bf16, causal")
  header = (f"{'S':>6} {'program':<14} {'compile s':>9} {'temp MiB':>9} {'kernels':>8} "
            f"{'matmul GFLOP':>13} {'scores MiB':>11}")
  print(header)
  print("-" * len(header))
  for S in LENGTHS:
    for name, attention in programs.items():
      compiled, seconds = compile_layer(attention, S, device)
      temp = compiled.memory_analysis().temp_size_in_bytes
      program = targets.read_program(compiled)
      if name == "pallas_gpu":
        flops = f"{kernel_flops(S, S) / 1e9:.1f} (tiles)"
      else:
        flops = f"{program.matmul_flops / 1e9:.1f}"
      print(f"{S:>6} {name:<14} {seconds:>9.1f} {temp / MiB:>9.1f} {program.kernels:>8} "
            f"{flops:>13} {NQ * S * S * 4 / MiB:>11.0f}")


if __name__ == "__main__":
  main()
