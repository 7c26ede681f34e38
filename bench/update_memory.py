"""The GRPO update's memory on a device, read from its compiled program: the shipped
GSM8K experiment (32 prompts x 8, P=256, beta 0.04, bf16) at a published model's
shapes (Qwen2.5-0.5B unless --arch), on one device or FSDP over --fsdp of them, and
a chosen completion length, micro-batch count, remat and attention kernels,
compiled on this CPU by the device's own compiler (grpojax.targets).

Prints the compiler's heap peak (what a TPU's compiler checks against HBM), the
sum arguments + outputs + temporaries - aliased, and their parts, in GiB per
device. `--extra_gib X` adds an X GiB argument: past the device's memory, a TPU's
compiler refuses the program and says what it needs, which is how the heap peak
was checked against the compiler's own accounting (bench/RESULTS.md).

  python bench/update_memory.py --device tpu-v5e --length 4096
  python bench/update_memory.py --device h100-80gb --length 4096 --kernels gpu
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--device", default="tpu-v5e")
  ap.add_argument("--length", type=int, default=4096, help="rollout.max_completion_length")
  ap.add_argument("--micro_batches", type=int, default=32)
  ap.add_argument("--remat", default="True", choices=["True", "False", "dots"])
  ap.add_argument("--kernels", default="xla", help="model.kernels: xla, tpu or gpu")
  ap.add_argument("--extra_gib", type=float, default=0.0)
  ap.add_argument("--arch", default="qwen2.5-0.5b", help="model.arch preset")
  ap.add_argument("--fsdp", type=int, default=1, help="devices, the weights sharded over them")
  ap.add_argument("--chunk_size", type=int, default=1024, help="log-prob chunk, in tokens")
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from grpojax import config as config_lib
  from grpojax import plan, targets
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.train import step, wiring

  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import gsm8k_qwen2_5_0_5b as experiment

  cfg = experiment.get_config()
  cfg.model.arch, cfg.model.path = args.arch, ""
  cfg.mesh.shape.fsdp = args.fsdp
  cfg.rollout.max_completion_length = args.length
  remat = {"True": True, "False": False}.get(args.remat, args.remat)
  model_cfg = wiring.model_config(cfg, wiring.run_tokenizer(cfg)).replace(kernels=args.kernels,
                                                                        remat=remat)
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict(), devices=targets.devices(args.device, args.fsdp))
  state = plan.abstract_state(cfg, model_cfg, mesh)
  rollout = plan.abstract_rollout(cfg, mesh)
  r = cfg.rollout
  kw = dict(loss_config=config_lib.loss_config(cfg), group_size=r.group_size, num_iterations=1,
            minibatches=1, temperature=1.0, grad_accum_steps=1,
            micro_batches=args.micro_batches, chunk_size=args.chunk_size)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  extra = jax.ShapeDtypeStruct((int(args.extra_gib * GiB) // 4,), jnp.float32,
                               sharding=NamedSharding(mesh, PartitionSpec()))

  def update(state, rollout, rng, extra):
    new_state, metrics = step.update(state, rollout, rng, **kw)
    return new_state, metrics, jnp.sum(extra)

  fn = jax.jit(update, donate_argnums=(0,))
  try:
    with targets.compiling(mesh):
      compiled = fn.lower(state, rollout, rng, extra).compile()
  except jax.errors.JaxRuntimeError as e:
    print(f"refused: {str(e).splitlines()[0][:300]}")
    return
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
           - m.alias_size_in_bytes)
  print(f"{args.arch} {args.fsdp} x {args.device} T={args.length} micro_batches={args.micro_batches} remat={remat} "
        f"kernels={args.kernels} extra={args.extra_gib} GiB: heap peak "
        f"{m.peak_memory_in_bytes / GiB:.2f}, sum {total / GiB:.2f} (arguments "
        f"{m.argument_size_in_bytes / GiB:.2f}, outputs {m.output_size_in_bytes / GiB:.2f}, "
        f"temporaries {m.temp_size_in_bytes / GiB:.2f}, aliased {m.alias_size_in_bytes / GiB:.2f}),"
        f" train state {plan.bytes_per_device(state) / GiB:.2f} GiB")


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for the device, runs nothing
  sys.path.insert(0, ROOT)
  main()
