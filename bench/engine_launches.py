"""Kernels a decode step launches: the engine's and the lockstep's, compiled for a device.

On an H200, a decode step of either costs about 7 us a kernel beyond its bytes
(bench/RESULTS.md, "The rollout engine on an H200"), so a step's kernel count is its
fixed cost. This compiles both samplers' programs at Qwen2.5-0.5B's shapes in bf16
(B=32 x G=8, P=128, T=4096; the engine with S=256 slots and pages of 128) for a
target by its own compiler (grpojax.targets: an H100 by default) and prints each
decode loop's kernels per trip (`targets.read_program`'s loops; the engine's at S slots,
then at each narrower width of its tail, EngineConfig.tail_slots), with the kernels of
`paged_decode_step` alone.

  python bench/engine_launches.py [--target h100-80gb] [--stream]
  python bench/engine_launches.py --list --layers 2   # paged_decode_step's kernels, in order
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp

from grpojax import models, plan, targets
from grpojax.models import transformer
from grpojax.sampling import engine as engine_lib
from grpojax.sampling import sampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import QWEN, SAMPLING, _on, _paged  # noqa: E402

KERNELS = {"h100-80gb": "gpu", "tpu-v5e": "tpu"}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="h100-80gb", choices=sorted(KERNELS))
  parser.add_argument("--layers", type=int, default=0, help="fewer layers (0: the model's)")
  parser.add_argument("--stream", action="store_true",
                      help="also DAPO's streaming engine (stream_program, 4 batches of B)")
  parser.add_argument("--list", action="store_true",
                      help="print paged_decode_step's kernels in launch order")
  a = parser.parse_args(argv)
  cfg = models.get_preset(QWEN).replace(dtype="bfloat16", param_dtype="bfloat16",
                                        kernels=KERNELS[a.target])
  if a.layers:
    cfg = cfg.replace(num_layers=a.layers)
  device = targets.devices(a.target, chips=1)[0]
  B, G, P, T, S, p = 32, 8, 128, 4096, 256, 128
  params = {n: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for n, (shape, _) in models.param_specs(cfg).items()}
  tokens = jax.ShapeDtypeStruct((B, P), jnp.int32)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  stop = jax.ShapeDtypeStruct((B * G,), jnp.int32)
  args = _on(device, (params, tokens, tokens, rng, stop))
  kw = dict(sampling=SAMPLING, num_samples=G, max_new_tokens=T, eos=(cfg.vocab_size - 1,),
            pad_id=0, stop_at=args[4])
  engine = engine_lib.EngineConfig(slots=S, page_size=p)
  lowerings = {
      "engine": lambda: engine_lib.generate_program.lower(cfg, *args[:4], engine=engine, **kw),
      "lockstep": lambda: sampler.generate_program.lower(cfg, *args[:4], mesh=None, **kw),
  }
  if a.stream:
    R = 4
    batch = jax.ShapeDtypeStruct((R, B, P), jnp.int32)
    sargs = _on(device, (batch, batch, jax.ShapeDtypeStruct((R, B), jnp.int32),
                         jax.ShapeDtypeStruct((R, B * G), jnp.int32)))

    def score(ids, toks, mask, valid):  # a stand-in for the host's: shapes only
      return jnp.zeros((toks.shape[0], 1)), jnp.zeros((1,), jnp.int32), valid

    lowerings["stream"] = lambda: engine_lib.stream_program.lower(
        cfg, args[0], *sargs[:3], args[3], engine=engine,
        stream=engine_lib.Stream(score=score, groups=B, rewards=1),
        **dict(kw, stop_at=sargs[3]))
  weights, paged = _paged(cfg, B=B, G=G, P=P, S=S, M=engine.sizes(B * G, T)[1], p=p)
  step = (jax.ShapeDtypeStruct((S,), jnp.int32),)
  lowerings["paged_decode_step"] = lambda: jax.jit(
      functools.partial(transformer.paged_decode_step, cfg), donate_argnums=(2,)).lower(
          *_on(device, (weights, *step, paged)))
  print(f"{QWEN} bf16, kernels={cfg.kernels}, compiled for {a.target}: B={B} x G={G}, P={P}, "
        f"T={T}, S={S}")
  if a.list:
    lowerings = {"paged_decode_step": lowerings["paged_decode_step"]}
  for name, lower in lowerings.items():
    with jax.default_device(device):
      _, _, compiled = plan.measure(lower, quiet=True)
    program = targets.read_program(compiled)
    # The engine's decode loops come last: S slots, then each narrower width of its tail.
    loops = 1 + len(engine.tail(S)) if name in ("engine", "stream") else 1
    per_step = (" / ".join(str(k) for _, k in program.loops[-loops:])
                if name != "paged_decode_step" else str(program.kernels))
    print(f"  {name:<18} {per_step:>5} kernels a decode step; {program.kernel_bytes / 2**30:.1f} "
          f"GiB moved a call (loops at their bound)", flush=True)
    if a.list:
      print_kernels(compiled)


def print_kernels(compiled) -> None:
  """The entry computation's kernels in order: name, output shape, fusion kind or call
  target (a decode step's layers repeat one pattern)."""
  comps, entry = targets.computations(compiled.as_text())
  for inst, shape, op, _, attrs in comps[entry]:
    if op in ("fusion", "custom-call"):
      how = re.search(r'kind=(\w+)|custom_call_target="([^"]+)"', attrs)
      print(f"    {inst[:36]:<36} {shape[:44]:<44} {(how[1] or how[2]) if how else op}")


if __name__ == "__main__":
  main()
