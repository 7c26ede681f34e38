"""Seconds per GRPO step of the default experiment on P processes (jax.distributed) against one process holding the same devices: what scale-out costs, and how far the layouts' metrics agree.

Each layout runs `python -m grpojax.main` (the embedded default experiment, no SFT,
no eval) for --steps steps on a mesh of --devices devices: first one process with
all of them (the peer), then --processes processes of devices/processes each,
joined through JAX's coordination service and gloo collectives on this host's
CPU. The figure is the median `step_time` of the steps after the first (which
compiles), and its ratio to the peer's; the agreement is the largest relative
difference of the first step's reward, loss and KL between the layouts (the same
samples, a reduction over processes in another order: docs/devices.md). --quick:
2 steps of the `:smoke` variant on 2 devices, 2 processes of 1. CPU only: on a
device host the layouts differ in interconnect, which this does not model.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGREE = ("reward", "loss", "kl")


def add_arguments(parser) -> None:
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--devices", type=int, default=4, help="devices of the mesh in all")
  parser.add_argument("--processes", type=int, default=2)


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
             XLA_FLAGS=common.xla_flags(devices), **extra)
  return env


def layout(processes: int, devices: int, steps: int, quick: bool, workdir: str) -> dict:
  """Runs one layout to the end; its wall seconds and metrics rows (process 0's file)."""
  from grpojax.train import metrics as metrics_lib

  argv = [sys.executable, "-m", "grpojax.main", "--workdir", workdir,
          f"--config.train.steps={steps}", "--config.sft.steps=0", "--config.eval.num_prompts=0",
          "--config.train.log_every=1", f"--config.train.save_every={steps}"]
  if quick:
    argv[3:3] = ["--config", os.path.join(ROOT, "grpojax", "default_experiment.py") + ":smoke"]
  port = _port()
  envs = [_env(devices // processes) if processes == 1 else
          _env(devices // processes, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i))
          for i in range(processes)]
  start = time.perf_counter()
  procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True) for env in envs]
  errors = [p.communicate(timeout=3600)[1] for p in procs]
  wall = time.perf_counter() - start
  for p, err in zip(procs, errors):
    if p.returncode:
      raise RuntimeError(f"{processes} x {devices // processes}: a process exited "
                         f"{p.returncode}:\n{err[-3000:]}")
  return {"wall_s": wall, "rows": [r for r in metrics_lib.read_metrics(workdir) if r["step"] >= 1]}


def run(args) -> dict:
  steps, devices, processes = (2, 2, 2) if args.quick else (args.steps, args.devices,
                                                             args.processes)
  if devices % processes or steps < 2:
    raise SystemExit(f"--devices={devices} must split over --processes={processes}, "
                     f"and --steps >= 2 (the first compiles)")
  figures = {"steps": steps, "devices": devices, "processes": processes}
  results = {}
  root = tempfile.mkdtemp(prefix="grpojax-scale-out-")
  try:
    for p in (1, processes):
      name = f"{p}x{devices // p}"
      results[name] = out = layout(p, devices, steps, args.quick, os.path.join(root, name))
      times = [r["step_time"] for r in out["rows"][1:]]
      figures[f"{name}_step_s"] = statistics.median(times)
      figures[f"{name}_wall_s"] = out["wall_s"]
      print(f"{p} process(es) x {devices // p} device(s): {figures[f'{name}_step_s']:.2f} s "
            f"per step after the first, {out['wall_s']:.0f} s in all", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  one, many = f"1x{devices}", f"{processes}x{devices // processes}"
  figures["step_ratio"] = figures[f"{many}_step_s"] / figures[f"{one}_step_s"]
  first = [results[k]["rows"][0] for k in (one, many)]
  figures["first_step_max_rel_diff"] = max(
      abs(first[1][k] - first[0][k]) / max(abs(first[0][k]), 1e-12) for k in AGREE)
  print(f"{many} against {one}: {figures['step_ratio']:.2f}x the seconds per step; the first "
        f"step's {', '.join(AGREE)} agree to {figures['first_step_max_rel_diff']:.1e} relative",
        flush=True)
  return figures
