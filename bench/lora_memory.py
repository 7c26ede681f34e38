"""LoRA and QLoRA memory per device, from the targets' own compilers (issue 35).

For Qwen2.5-0.5B, 3B and 7B shapes (`model.arch`, no weights needed) x {full
fine-tuning, LoRA, QLoRA nf4} x {h100-80gb, tpu-v5e}, one `python -m
grpojax.plan` each, at one fixed run shape (SHAPE below, the same for every
cell), on one device. Prints a table: the train state's bytes per device, the
worst compiled program's total bytes per device (its peak plus the train state
that stays beside it) and whether the run fits.

Each cell compiles with the device's own compiler on this machine (libtpu for
the v5e, the CUDA PJRT plugin for the H100: `grpojax.targets`; set
TPU_LIBRARY_PATH and GRPOJAX_CUDA_PLUGIN); a cell whose compiler is missing is
refused, never estimated on XLA:CPU. The update is planned at its most frugal
setting (one group per micro-batch, full remat), so that the verdict is "fits
at all"; the run's own "auto" fit would pick the fastest setting that fits.
Where the train state alone is over train.memory_budget (90% of the device's
memory), the run would stop at startup: the cell is recorded without compiling
(--compile-all compiles anyway, as the planner does below the device's whole
memory), and the worst "program" is the train state itself.

  python bench/lora_memory.py --out /tmp/lora_memory.jsonl            # all cells
  python bench/lora_memory.py --out X --devices tpu-v5e --models 3b   # some
  python bench/lora_memory.py --table X                               # the table only

Cells already in --out are not planned again (a long run resumes); each cell
is appended as one JSON line as soon as it is done.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
CONFIG = "experiments/gsm8k_qwen2_5_0_5b.py"

# The run shape of every cell: GSM8K's recipe (beta 0.04 k3, so full fine-tuning
# keeps a bf16 reference copy; LoRA's reference is its own base) at reasoning
# length: 16 prompts x 8 = 128 rows, 256 prompt + 2,048 completion tokens,
# generated in 4 chunks of 32 rows (rollout.generation_chunks); the update at one
# group (8 rows) per micro-batch with full remat. No eval program: its batch is a free
# choice (the experiments pick one that fits).
SHAPE = ("--config.model.path=", "--config.rollout.prompts_per_step=16",
         "--config.rollout.group_size=8", "--config.rollout.max_prompt_length=256",
         "--config.rollout.max_completion_length=2048", "--config.rollout.generation_chunks=4",
         "--config.train.micro_batches=16", "--config.model.remat=True",
         "--config.eval.num_prompts=0")
RANK = 16
MODELS = {"0.5b": "qwen2.5-0.5b", "3b": "qwen2.5-3b", "7b": "qwen2.5-7b"}
MODES = {"full": (),
         "lora": (f"--config.model.lora.rank={RANK}",),
         "qlora-nf4": (f"--config.model.lora.rank={RANK}", "--config.model.lora.quantize=nf4")}
DEVICES = ("h100-80gb", "tpu-v5e")


def overrides(model: str, mode: str) -> tuple[str, ...]:
  return (f"--config.model.arch={MODELS[model]}", *SHAPE, *MODES[mode])


def command(model: str, mode: str, device: str) -> str:
  return " ".join(["python -m grpojax.plan", f"--config {CONFIG}", *overrides(model, mode),
                   f"--device {device}"])


def _over_budget(cfg, model: str, mode: str, device: str) -> dict | None:
  """The row of a cell whose train state alone is over train.memory_budget (90% of the
  device), without compiling: the run would stop before its first step, as plan.fit
  says (the planner itself still compiles the programs when the state is under the
  device's whole memory, minutes each at 7B). None when the state is within it."""
  import math

  from grpojax import plan as plan_lib
  from grpojax import targets
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.train import wiring

  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict(), devices=targets.devices(device, chips=1))
  model_cfg = wiring.model_config(cfg, wiring.run_tokenizer(cfg))
  state = plan_lib.abstract_state(cfg, model_cfg, mesh)
  state_bytes, memory = plan_lib.bytes_per_device(state), plan_lib.DEVICES[device]
  budget = plan_lib.memory_budget(cfg, memory)
  if state_bytes <= budget:
    return None
  n_params = sum(math.prod(x.shape) for n, x in state.model_params.items()
                 if not plan_lib.lora_lib.is_adapter(n))
  return {"model": model, "mode": mode, "device": device, "command": command(model, mode, device),
          "backend": mesh.devices.flat[0].platform, "parameters": n_params,
          "trainable": sum(math.prod(x.shape) for x in state.params.values()),
          "state_bytes": state_bytes, "worst": "train state", "worst_bytes": state_bytes,
          "worst_at_least": False, "programs": {}, "device_memory_bytes": memory, "fits": False,
          "reason": (f"the train state alone takes {state_bytes / GiB:.2f} GiB per device, over "
                     f"train.memory_budget's {budget / GiB:.2f} GiB: the run stops at startup "
                     "(programs not compiled)"), "seconds": 0.0}


def plan_cell(model: str, mode: str, device: str, compile_all: bool = False) -> dict:
  """One planner command, in this process: the row of the table. compile_all: compile
  the programs even where the train state alone is over the budget."""
  from absl import flags
  from ml_collections import config_flags

  from grpojax import plan as plan_lib
  from grpojax import targets

  if not targets.available(device):
    install = targets.INSTALL if device in targets.TPUS else targets.CUDA_INSTALL
    raise SystemExit(f"{device}'s compiler is not installed: {install}")
  argv = ["plan", f"--config={os.path.join(ROOT, CONFIG)}", *overrides(model, mode)]
  fv = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                           sys_argv=argv)
  fv(argv)
  t0 = time.perf_counter()
  if not compile_all:
    row = _over_budget(config.value, model, mode, device)
    if row is not None:
      return row
  result = plan_lib.plan(config.value, device=device, devices=1)
  seconds = time.perf_counter() - t0
  if result["note"]:  # XLA:CPU's proxy: not the target's figures
    raise SystemExit(f"{model} {mode} {device}: {result['note']}")
  programs, c = result["programs"], result["choices"]
  worst = max(programs, key=lambda k: programs[k]["total_bytes"], default=None)
  return {"model": model, "mode": mode, "device": device, "command": command(model, mode, device),
          "backend": c["backend"], "parameters": c["parameters"], "trainable": c["trainable"],
          "state_bytes": c["state_bytes"], "worst": worst or "train state",
          "worst_bytes": programs[worst]["total_bytes"] if worst else c["state_bytes"],
          "worst_at_least": bool(worst and programs[worst].get("at_least")),
          "programs": {k: {"total_bytes": p["total_bytes"], "peak_bytes": p["peak_bytes"],
                           "at_least": bool(p.get("at_least")), "compile_s": p["compile_s"]}
                       for k, p in programs.items()},
          "device_memory_bytes": result["device_memory_bytes"], "fits": result["fits"],
          "reason": result["reason"], "seconds": round(seconds, 1)}


def read(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict]) -> str:
  """One row per model and mode: the train state (the same on either device), then per
  device the worst program, its total GiB per device and the verdict."""
  cells = {(r["model"], r["mode"], r["device"]): r for r in rows}
  head = "| model | mode | trainable | train state |" + "".join(
      f" {d}: worst program | total | verdict |" for d in DEVICES)
  lines = [head, "|---" * head.count(" |") + "|"]
  for model in MODELS:
    for mode in MODES:
      here = [cells.get((model, mode, d)) for d in DEVICES]
      first = next((r for r in here if r), None)
      if first is None:
        continue
      line = (f"| {model.upper()} | {mode} | {first['trainable'] / 1e6:,.1f}M | "
              f"{first['state_bytes'] / GiB:.2f} GiB |")
      for r in here:
        if r is None:
          line += " not run | | |"
          continue
        over = ">=" if r["worst_at_least"] else ""
        line += (f" {r['worst']} | {over}{r['worst_bytes'] / GiB:.2f} GiB | "
                 f"{'fits' if r['fits'] else '**does not fit**'} |")
      lines.append(line)
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="JSON lines file: cells done are read, new ones appended")
  parser.add_argument("--table", help="print the table of this JSON lines file and exit")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--devices", default=",".join(DEVICES))
  parser.add_argument("--compile-all", action="store_true",
                      help="compile the programs even where the train state alone is over "
                      "train.memory_budget (the planner's own behaviour; minutes at 7B)")
  args = parser.parse_args()
  if args.table:
    print(table(read(args.table)))
    return
  if not args.out:
    parser.error("--out or --table")
  done = {(r["model"], r["mode"], r["device"]) for r in read(args.out)}
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=False).stdout.strip()
  for model in args.models.split(","):
    for mode in args.modes.split(","):
      for device in args.devices.split(","):
        if (model, mode, device) in done:
          continue
        print(f"== {command(model, mode, device)}", flush=True)
        row = plan_cell(model, mode, device, args.compile_all)
        row["commit"] = commit
        print(f"   {row['reason']} ({row['seconds']:.0f} s)", flush=True)
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
  print(table(read(args.out)))


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the targets; start no other backend
  sys.path.insert(0, ROOT)
  main()
