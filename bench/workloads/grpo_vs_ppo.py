"""GRPO against PPO with a learned critic on the same samples per step: device memory by the target compilers, and learning on the arithmetic task.

--part memory: `grpojax.plan.compare` (the planner's `--compare ppo`) of the shipped
GSM8K experiment (P = 256, T = 512, 32 prompts x 8; beta 0.04) at Qwen2.5 shapes on
one chip of each device, compiled by that device's own compiler (libtpu, the CUDA
plugin: `python -m grpojax.plan --install-compilers`; a device whose compiler is
missing is skipped, never estimated): the train state, the rollout's and the
update's bytes per device (with the resident state) each way, their ratio, and the
largest of the shapes that fits each way. PPO is the same run with
advantage.estimator=gae, 256 prompts x 1, the critic from the policy, the KL in
the reward. Eval and SFT are off (neither changes between the two). --lora r: both
ways with rank-r adapters on every projection (the critic then is adapters and a
head on the policy's frozen base, not a second decoder).

--part learning: the embedded default experiment (2-digit addition, tiny model, 300
SFT steps) for --steps GRPO steps, GRPO (G = 8, 32 prompts) against PPO (G = 1, 256
prompts, advantage.estimator=gae, the same learning rate), --seeds seeds each:
reward against samples drawn and against wall seconds, and held-out greedy
accuracy at the end.

--quick: memory of the tiny default on this CPU (XLA:CPU; 4 prompts), learning of
two steps of the `:smoke` variant, one seed.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GSM8K = os.path.join(ROOT, "experiments", "gsm8k_qwen2_5_0_5b.py")
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
DEVICES = ("tpu-v5e", "h100-80gb")
GiB = 2**30


def add_arguments(parser) -> None:
  parser.add_argument("--part", choices=("memory", "learning", "both"), default="both")
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--devices", default=",".join(DEVICES))
  parser.add_argument("--lora", type=int, default=0,
                      help="memory: LoRA rank r (targets all) both ways: the critic is its "
                      "own adapters and head on the policy's frozen base")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--seeds", type=int, default=3)


def _memory_row(cfg, device: str) -> dict:
  from grpojax import plan as plan_lib

  both = plan_lib.compare(cfg, device=device, devices=1)
  row = {}
  for way in ("grpo", "ppo"):
    p = both[way]
    row[way] = {"fits": p["fits"], "state_GiB": p["choices"]["state_bytes"] / GiB,
                "micro_batches": p["choices"]["micro_batches"], "remat": p["choices"]["remat"],
                **{f"{k}_GiB": v["total_bytes"] / GiB for k, v in p["programs"].items()}}
  row["ratios"] = both["ratios"]
  return row


def memory(args) -> dict:
  from grpojax import config as config_lib
  from grpojax import targets

  out = {}
  if args.quick:
    from grpojax import default_experiment

    cfg = default_experiment.get_config("smoke")
    cfg.rollout.prompts_per_step, cfg.eval.num_prompts, cfg.sft.steps = 4, 0, 0
    out["tiny@cpu"] = _memory_row(cfg, "cpu")
  else:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_experiment", GSM8K)
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    for device in args.devices.split(","):
      if not targets.available(device):
        print(f"{device}: its compiler is not installed here (python -m grpojax.plan "
              "--install-compilers): skipped")
        continue
      for shape in args.shapes.split(","):
        cfg = experiment.get_config()
        cfg.model.arch, cfg.model.path = shape, ""
        cfg.eval.num_prompts, cfg.sft.steps = 0, 0
        cfg.model.lora.rank = args.lora
        config_lib.validate(cfg)
        start = time.perf_counter()
        out[f"{shape}@{device}"] = row = _memory_row(cfg, device)
        print(f"{shape} on one {device} ({time.perf_counter() - start:.0f} s of compiles): "
              + "; ".join(f"{way} {'fits' if row[way]['fits'] else 'does not fit'}, state "
                          f"{row[way]['state_GiB']:.2f}, rollout "
                          f"{row[way].get('rollout_GiB', float('nan')):.2f}, update "
                          f"{row[way].get('update_GiB', float('nan')):.2f} GiB (micro_batches "
                          f"{row[way]['micro_batches']}, remat {row[way]['remat']})"
                          for way in ("grpo", "ppo")), flush=True)
  if args.lora:
    print(f"both ways with LoRA rank {args.lora} on every projection (model.lora.rank)")
  print(f"{'shape@device':<26}{'way':>6}{'fits':>6}{'state':>8}{'rollout':>9}{'update':>9}"
        f"{'micro':>7}  (GiB per device, with the resident state)")
  for key, row in out.items():
    for way in ("grpo", "ppo"):
      r = row[way]
      print(f"{key:<26}{way:>6}{str(r['fits']):>6}{r['state_GiB']:>8.2f}"
            f"{r.get('rollout_GiB', float('nan')):>9.2f}{r.get('update_GiB', float('nan')):>9.2f}"
            f"{r['micro_batches']:>7}")
    print(f"{'':<26}{'ppo/grpo':>6}  " + ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items()))
  largest = {}
  for device in {k.split("@")[1] for k in out}:
    for way in ("grpo", "ppo"):
      fitting = [k.split("@")[0] for k, row in out.items()
                 if k.endswith("@" + device) and row[way]["fits"]]
      largest[f"{way}@{device}"] = fitting[-1] if fitting else None
  print("largest shape that fits one chip: " + ", ".join(f"{k}: {v}" for k, v in largest.items()))
  return {"rows": out, "largest": largest, "lora_rank": args.lora}


def _one_run(workdir: str, extra: list[str], steps: int, seed: int, quick: bool) -> dict:
  out = common.run_main(workdir, [
      f"--config.train.steps={steps}", f"--config.train.seed={seed}",
      "--config.train.log_every=1", f"--config.train.save_every={steps}",
      f"--config.train.eval_every={steps}", "--config.train.loggers=", *extra],
      quick=quick, timeout=7200)
  steps_rows = [r for r in out["rows"] if r["step"] >= 1 and "reward" in r]
  end = [r for r in out["rows"] if "eval/accuracy" in r]
  return {"wall_s": out["wall_s"],
          "reward": [r["reward"] for r in steps_rows],
          "step_time": [r.get("step_time", float("nan")) for r in steps_rows],
          "accuracy_start": end[0]["eval/accuracy"] if end else None,
          "accuracy_end": end[-1]["eval/accuracy"] if end else None}


def learning(args) -> dict:
  from grpojax import default_experiment

  cfg = default_experiment.get_config("smoke" if args.quick else None)
  steps, seeds = (2, 1) if args.quick else (args.steps, args.seeds)
  samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  arms = {"grpo": [],
          "ppo": ["--config.advantage.estimator=gae", "--config.rollout.group_size=1",
                  f"--config.rollout.prompts_per_step={samples}"]}
  out = {}
  root = tempfile.mkdtemp(prefix="grpojax-grpo-vs-ppo-")
  for name, extra in arms.items():
    out[name] = [_one_run(os.path.join(root, f"{name}-{seed}"), extra, steps, seed, args.quick)
                 for seed in range(seeds)]
  print(f"{samples} samples per step, {steps} steps, {seeds} seed(s)")
  window = max(1, steps // 10)
  print(f"{'way':<6}{'reward (first ' + str(window) + ')':>20}{'reward (last ' + str(window) + ')':>20}"
        f"{'acc start':>11}{'acc end':>9}{'step s':>8}{'wall s':>8}")
  summary = {}
  for name, runs in out.items():
    first = np.mean([np.mean(r["reward"][:window]) for r in runs])
    last = np.mean([np.mean(r["reward"][-window:]) for r in runs])
    acc = [r["accuracy_end"] for r in runs if r["accuracy_end"] is not None]
    acc0 = [r["accuracy_start"] for r in runs if r["accuracy_start"] is not None]
    step_s = np.mean([np.median(r["step_time"][1:] or r["step_time"]) for r in runs])
    wall = np.mean([r["wall_s"] for r in runs])
    summary[name] = dict(reward_first=float(first), reward_last=float(last),
                         accuracy_start=float(np.mean(acc0)) if acc0 else None,
                         accuracy_end=float(np.mean(acc)) if acc else None,
                         accuracy_end_seeds=acc, step_s=float(step_s), wall_s=float(wall))
    print(f"{name:<6}{first:>20.3f}{last:>20.3f}{np.mean(acc0) if acc0 else float('nan'):>11.3f}"
          f"{np.mean(acc) if acc else float('nan'):>9.3f}{step_s:>8.3f}{wall:>8.0f}")
  # Reward against samples and wall seconds, seed-mean, every `window` steps.
  for name, runs in out.items():
    curve = np.mean([r["reward"] for r in runs], axis=0)
    print(f"{name} reward every {window} steps ({window * samples} samples): "
          + " ".join(f"{np.mean(curve[i:i + window]):.2f}" for i in range(0, len(curve), window)))
  return {"samples_per_step": samples, "steps": steps, "seeds": seeds, "summary": summary,
          "curves": {k: [r["reward"] for r in v] for k, v in out.items()}}


def run(args) -> dict:
  figures = {}
  if args.part in ("memory", "both"):
    figures["memory"] = memory(args)
  if args.part in ("learning", "both"):
    figures["learning"] = learning(args)
  return figures
