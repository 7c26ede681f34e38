"""One process of the multi-host test (tests/test_train_multihost.py): two GRPO steps
(rollout + update) of the tiny model, each process feeding only its own prompts.

Run as `python tests/multihost_worker.py OUT.json` with JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID set (or none of them: a single process), and
XLA_FLAGS / JAX_PLATFORMS set by the caller before JAX starts. Writes the
per-step metrics, a checksum of the sampled tokens and of the parameters, and
which example ids this process's verifiers saw.
"""

import json
import sys

import jax

# CPU collectives across processes: gloo (already the default in jax 0.10; the
# option may be renamed or gone in other versions, where the default must do).
try:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
except AttributeError:
  pass

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from grpojax import models  # noqa: E402
from grpojax.core import losses  # noqa: E402
from grpojax.models import sharding as sharding_lib  # noqa: E402
from grpojax.parallel import mesh as mesh_lib  # noqa: E402
from grpojax.rewards.runtime.host import HostRewards  # noqa: E402
from grpojax.sampling.strategies import SamplingParams  # noqa: E402
from grpojax.train import rollout as rollout_lib  # noqa: E402
from grpojax.train import state as state_lib  # noqa: E402
from grpojax.train import step as step_lib  # noqa: E402
from grpojax.train import strategy as strategy_lib  # noqa: E402
from reward_helpers import decode_chars  # noqa: E402

G, T, STEPS = 4, 8, 2
MESH = {"data": 1, "fsdp": -1, "tensor": 2}  # fsdp crosses the process boundary
# 4 prompts per step, left-padded; example id = 100 * step + prompt index.
PROMPTS = np.array([[0, 53, 54, 55], [49, 50, 51, 52], [0, 0, 60, 61], [70, 71, 72, 73]],
                   np.int32)
EXAMPLES = {100 * s + i: {"prompt": str(i), "target": "0123"[i]}
            for s in range(STEPS) for i in range(len(PROMPTS))}
SEEN: list[int] = []  # example ids verified in this process


def even_ids(completions, **unused):
  """A dense reward: the fraction of characters with an even code point."""
  return [sum(ord(ch) % 2 == 0 for ch in c) / max(len(c), 1) for c in completions]


def has_target(completions, target, **unused):
  return [1.0 if t in c else 0.0 for c, t in zip(completions, target)]


def lookup(example_id):
  SEEN.append(int(example_id))
  return EXAMPLES[example_id]


def main(out_path):
  distributed = mesh_lib.initialize_distributed()
  mesh = mesh_lib.make_mesh(MESH)
  assert jax.device_count() == 4, jax.devices()

  # Initialised on each host (same seed, same values), then each process copies only
  # the slices its devices hold, as a checkpoint load would.
  model = models.build_model("tiny", seed=0)
  shardings = models.param_shardings(model.config, mesh)
  params = {k: sharding_lib.put(np.asarray(v), shardings[k]) for k, v in model.param_dict().items()}
  tx = optax.sgd(0.5)
  state = state_lib.create_train_state(model.config, params, tx, with_reference=True,
                                       ref_dtype="float32")
  config = rollout_lib.RolloutConfig(group_size=G, max_new_tokens=T,
                                     sampling=SamplingParams(temperature=1.0), eos_ids=(1,),
                                     pad_id=0, with_reference=True, with_old_logps=True)
  loss_config = losses.LossConfig(loss_type="dapo", beta=0.04)

  # This process's prompts: a contiguous block of whole prompts (so whole groups).
  per_process = mesh_lib.rows_per_process(len(PROMPTS), mesh)
  lo = jax.process_index() * per_process
  local = slice(lo, lo + per_process)

  history, param_norm_before = [], float(optax.global_norm(state.params))
  with HostRewards([even_ids, has_target], decode=decode_chars, lookup=lookup,
                   num_workers=0) as host:
    rollout_fn = strategy_lib.make("plain", config, host, num_prompts=len(PROMPTS),
                                   reward_weights=[1.0, 0.5], mesh=mesh)
    for step in range(STEPS):
      batch = mesh_lib.global_batch({
          "prompt_tokens": PROMPTS[local],
          "prompt_mask": (PROMPTS[local] > 0).astype(np.int32),
          "example_ids": 100 * step + np.arange(len(PROMPTS), dtype=np.int32)[local],
      }, mesh)
      rng = jax.random.fold_in(jax.random.key(0), step)
      rollout, metrics = rollout_fn(state, batch, rng)
      tokens = multihost_utils.process_allgather(rollout.tokens, tiled=True)
      state, update_metrics = step_lib.update(state, rollout, rng, loss_config=loss_config,
                                              group_size=G, minibatches=2)
      metrics = dict(metrics, **update_metrics)
      # Metrics are replicated global arrays: every process can read them.
      history.append({k: float(v) for k, v in metrics.items()}
                     | {"tokens_sum": int(np.sum(tokens * np.arange(1, tokens.size + 1)
                                                 .reshape(tokens.shape)))})

  param_norm = float(optax.global_norm(state.params))
  with open(out_path, "w") as f:
    json.dump({"process": jax.process_index(), "processes": jax.process_count(),
               "distributed": distributed, "local_devices": jax.local_device_count(),
               "history": history, "param_norm_before": param_norm_before,
               "param_norm": param_norm, "seen": sorted(set(SEEN))}, f)


if __name__ == "__main__":
  main(sys.argv[1])
