"""The planner at reasoning lengths: the GSM8K experiment's shapes (32 prompts x 8,
P=256, beta 0.04, bf16) at T = 1k / 2k / 4k / 8k for Qwen2.5-0.5B, 1.5B and 7B on
one TPU v5e, one TPU v6e and one H100, each compiled by the device's own compiler.

Each row is one `python -m grpojax.plan` command (printed with the table), with
`micro_batches` and `remat` fitted ("auto") and `rollout.generation_chunks =
T / 1024`: 256 rows x 1,024 completion slots of KV cache at a time. Eval and SFT
are left out (`eval.num_prompts=0`, `sft.steps=0`): the table is the training
step's. A row whose train state alone is over the budget compiles nothing.

  python bench/long_plans.py                        # every row, a markdown table
  python bench/long_plans.py --models 0.5b --lengths 4096 --devices tpu-v5e
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
MODELS = ("0.5b", "1.5b", "7b")
DEVICES = ("tpu-v5e", "tpu-v6e", "h100-80gb")
LENGTHS = (1024, 2048, 4096, 8192)


def row(model: str, device: str, T: int):
  from plan_figures import GSM8K, Row

  return Row(f"{model}-{device}-{T}", GSM8K, (
      f"--config.model.arch=qwen2.5-{model}", "--config.model.path=",
      f"--config.rollout.max_completion_length={T}",
      f"--config.rollout.generation_chunks={max(1, T // 1024)}",
      "--config.eval.num_prompts=0", "--config.sft.steps=0"), device)


def summary(result: dict) -> dict:
  p, c = result["programs"], result["choices"]
  gib = lambda k: None if k not in p else (  # noqa: E731
      round(p[k]["total_bytes"] / GiB, 2), bool(p[k].get("at_least")))
  return {"fits": result["fits"], "micro_batches": c["micro_batches"], "remat": c["remat"],
          "state": round(c["state_bytes"] / GiB, 2), "rollout": gib("rollout"),
          "update": gib("update"), "kernels": c["kernels"], "reason": result["reason"]}


def cell(x) -> str:
  return "-" if x is None else f"{'>= ' if x[1] else ''}{x[0]:.2f}"


def main() -> None:
  from plan_figures import plan_row

  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--devices", default=",".join(DEVICES))
  ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
  ap.add_argument("--jsonl", default="", help="also append each row's summary to this file")
  args = ap.parse_args()
  lines = ["| model | device | T | choice | state | rollout | update | verdict |",
           "|---|---|---|---|---|---|---|---|"]
  commands = []
  for model in args.models.split(","):
    for device in args.devices.split(","):
      for T in map(int, args.lengths.split(",")):
        r = row(model, device, T)
        t0 = time.perf_counter()
        s = summary(plan_row(r))
        s.update(row=r.name, seconds=round(time.perf_counter() - t0, 1))
        print(json.dumps(s), flush=True)
        if args.jsonl:
          with open(args.jsonl, "a") as f:
            f.write(json.dumps(s) + "\n")
        choice = ("state over budget" if s["update"] is None
                  else f"mb {s['micro_batches']}, remat {s['remat']}")
        verdict = "fits" if s["fits"] else "does not fit"
        lines.append(f"| {model} | {device} | {T:,} | {choice} | {s['state']:.2f} | "
                     f"{cell(s['rollout'])} | {cell(s['update'])} | {verdict} |")
        commands.append(f"- {r.name}: `{r.command()}`")
  print("\n".join(lines + ["", "GiB per device, train state included. Commands:", ""] + commands))


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for the rows' devices, runs nothing
  sys.path.insert(0, ROOT)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main()
