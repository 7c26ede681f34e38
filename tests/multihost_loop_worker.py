"""One process of tests/test_train_loop_multihost.py: the whole training loop
(`loop.train`) on the tiny arithmetic config with dynamic sampling, and a dense
reward added so that groups differ and the steps move the policy from the start.

Run as `python tests/multihost_loop_worker.py WORKDIR OUT.json` with
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set (or none of them:
a single process), and XLA_FLAGS / JAX_PLATFORMS set by the caller before JAX
starts. Writes the prompts this process's verifiers saw to OUT.json.
"""

import json
import os
import sys

import jax

# CPU collectives across processes: gloo (see tests/multihost_worker.py).
try:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
except AttributeError:
  pass

from grpojax.data import tasks  # noqa: E402
from grpojax.rewards.base import TIMED_OUT  # noqa: E402
from grpojax.train import loop  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments"))
import arithmetic_tiny  # noqa: E402

TASK = "arithmetic_dense"
SEEN: list[str] = []  # prompts verified in this process, once per completion


def digits(prompts, completions, **unused):
  """The fraction of digits: a dense reward for an untrained policy."""
  SEEN.extend(prompts)
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def odd_times_out(completions, **unused):
  """TIMED_OUT for a completion of odd length (0 otherwise): each process counts its own
  rows' timeouts on its host, and the run's must be the one-process run's."""
  return [TIMED_OUT if len(c) % 2 else 0.0 for c in completions]


def register_task() -> None:
  base = tasks.get_task("arithmetic")
  tasks.register_task(tasks.Task(
      name=TASK, default_dataset=base.default_dataset, columns=base.columns, prompt=base.prompt,
      reward_fns=base.reward_fns + (digits, odd_times_out), is_correct=base.is_correct,
      sft_target=base.sft_target, load=base.load))


def config():
  c = arithmetic_tiny.get_config("smoke")
  c.task.name = TASK
  c.train.steps = 2
  c.train.eval_every = 0  # eval at the start and the end only: one eval program
  c.train.save_every = 1
  c.sft.steps = 0
  c.rollout.prompts_per_step = 4  # 2 per process; fsdp over all the devices
  c.rollout.group_size = 4
  # About one group in four has equal rewards: steps draw extra batches, and the kept
  # groups move between processes.
  c.rollout.dynamic_sampling = True
  c.eval.num_prompts = 8
  c.eval.batch_size = 8
  c.eval.k = 0
  return c


def main(workdir, out_path):
  register_task()
  summary = loop.train(config(), workdir)
  with open(out_path, "w") as f:
    json.dump({"process": jax.process_index(), "processes": jax.process_count(),
               "devices": jax.device_count(), "step": summary["step"],
               "seen": sorted(SEEN)}, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
