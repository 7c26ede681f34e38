"""The reward bridge as an effect (io_callback) or as a pure callback: the rollout's time.

`rewards/runtime/host.py` hands each device's rows to the reward functions through a
host callback inside the jitted rollout. They are impure (they log, time out,
run workers), which `jax.experimental.io_callback` says and `jax.pure_callback`
hides: XLA may drop (tests/test_rewards_host.py shows it does), repeat or
reorder a pure one. This times the rollout program with each, the same model,
batch and reward, alternating, best of --reps, on this machine's backend:

  python bench/reward_bridge.py            # tiny model, 8 prompts x 4, T = 16
  python bench/reward_bridge.py --mesh 4   # the rows over 4 (CPU) devices

The alternative the issue names, splitting the rollout program at the reward
boundary, costs what the callback costs (the tokens to the host, the rewards
back) plus a second program launch; it is not timed here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--mesh" in sys.argv:  # fake CPU devices, before jax is imported
  n = sys.argv[sys.argv.index("--mesh") + 1]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={n}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from grpojax import models  # noqa: E402
from grpojax.parallel import mesh as mesh_lib  # noqa: E402
from grpojax.rewards.runtime import host as host_lib  # noqa: E402
from grpojax.sampling.strategies import SamplingParams  # noqa: E402
from grpojax.train import rollout as rollout_lib  # noqa: E402
from grpojax.train import state as state_lib  # noqa: E402


def decode_chars(rows):
  return ["".join(map(chr, row)) for row in rows]  # token id = Unicode code point


def lengths(completions, **unused):
  return [float(len(c)) for c in completions]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--T", type=int, default=16)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--mesh", type=int, default=0, help="rows over this many devices")
  a = parser.parse_args(argv)
  model = models.build_model("tiny", seed=0)
  state = state_lib.create_train_state(model.config, model.param_dict(), optax.sgd(0.1),
                                       with_reference=False)
  mesh = None
  if a.mesh:
    mesh = mesh_lib.make_mesh({"data": a.mesh, "fsdp": 1, "tensor": 1},
                              devices=jax.devices()[:a.mesh])
  V = model.config.vocab_size
  key = jax.random.key(0)
  batch = {"prompt_tokens": jax.random.randint(key, (a.prompts, 8), 2, V, jnp.int32),
           "prompt_mask": jnp.ones((a.prompts, 8), jnp.int32),
           "example_ids": jnp.arange(a.prompts, dtype=jnp.int32)}
  config = rollout_lib.RolloutConfig(group_size=a.group, max_new_tokens=a.T,
                                     sampling=SamplingParams(), eos_ids=(1,), pad_id=0,
                                     with_reference=False, with_old_logps=False)
  runs = {}
  with host_lib.HostRewards([lengths], decode=decode_chars,
                            lookup=lambda i: {"prompt": str(i)}, num_workers=0) as host:
    for kind, callback in (("io_callback", host_lib.io_callback),
                           ("pure_callback", jax.pure_callback)):
      host_lib.io_callback = callback  # the bridge's callback, for this program
      fn = rollout_lib.make_rollout_fn(config, host, mesh=mesh)
      jax.block_until_ready(fn(state, batch, key))  # compile
      runs[kind] = (fn, callback)
    best = dict.fromkeys(runs, float("inf"))
    for rep in range(a.reps):
      for kind, (fn, _) in runs.items():
        t = time.perf_counter()
        jax.block_until_ready(fn(state, batch, jax.random.fold_in(key, rep)))
        best[kind] = min(best[kind], time.perf_counter() - t)
    host_lib.io_callback = runs["io_callback"][1]
  print(f"{jax.devices()[0].device_kind}, {a.mesh or 1} device(s), {a.prompts} x {a.group} rows, "
        f"T = {a.T}, best of {a.reps}: io_callback {best['io_callback'] * 1e3:.2f} ms, "
        f"pure_callback {best['pure_callback'] * 1e3:.2f} ms, io / pure "
        f"{best['io_callback'] / best['pure_callback']:.3f}")


if __name__ == "__main__":
  main()
