"""The planner at reasoning lengths: the GSM8K experiment's shapes (32 prompts x 8, P=256,
beta 0.04, bf16) at T = 1k / 2k / 4k / 8k for Qwen2.5-0.5B, 1.5B and 7B on one TPU v5e,
one TPU v6e and one H100, each compiled by the device's own compiler.

Each row is one `python -m grpojax.plan` command (printed with the table), with
`micro_batches` and `remat` fitted ("auto") and `rollout.generation_chunks =
T / 1024`: 256 rows x 1,024 completion slots of KV cache at a time. Eval and SFT
are left out (`eval.num_prompts=0`, `sft.steps=0`): the table is the training
step's. A row whose train state alone is over the budget compiles nothing.

  python bench/run.py long_plans                        # every row, a markdown table
  python bench/run.py long_plans --models 0.5b --lengths 4096 --devices tpu-v5e

--device changes nothing: --devices names the compilers. --quick: qwen2_tiny, 2 x 4
rows, P=32, T=16, planned for this CPU. --dry-run: the rows' configs checked, nothing
planned.
"""

from __future__ import annotations

import json
import time

from workloads import plan_figures

GiB = 2**30
MODELS = ("0.5b", "1.5b", "7b")
DEVICES = ("tpu-v5e", "tpu-v6e", "h100-80gb")
LENGTHS = (1024, 2048, 4096, 8192)


def add_arguments(parser) -> None:
  parser.add_argument("--models", default=",".join(MODELS), help="Qwen2.5 sizes")
  parser.add_argument("--devices", default=",".join(DEVICES))
  parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))


def row(arch: str, device: str, T: int, *more: str) -> plan_figures.Row:
  return plan_figures.Row(f"{arch}-{device}-{T}", plan_figures.GSM8K, (
      f"--config.model.arch={arch}", "--config.model.path=",
      f"--config.rollout.max_completion_length={T}",
      f"--config.rollout.generation_chunks={max(1, T // 1024)}",
      "--config.eval.num_prompts=0", "--config.sft.steps=0", *more), device)


def summary(result: dict) -> dict:
  p, c = result["programs"], result["choices"]
  gib = lambda k: None if k not in p else (  # noqa: E731
      round(p[k]["total_bytes"] / GiB, 2), bool(p[k].get("at_least")))
  return {"fits": result["fits"], "micro_batches": c["micro_batches"], "remat": c["remat"],
          "state": round(c["state_bytes"] / GiB, 2), "rollout": gib("rollout"),
          "update": gib("update"), "kernels": c["kernels"], "reason": result["reason"]}


def cell(x) -> str:
  return "-" if x is None else f"{'>= ' if x[1] else ''}{x[0]:.2f}"


def cells(args) -> list[tuple]:
  """(arch, device, T, *more overrides) of each row."""
  if args.quick:  # a tiny batch too, and the update's choice fitted over two candidates
    return [("qwen2_tiny", "cpu", 16, "--config.rollout.prompts_per_step=2",
             "--config.rollout.group_size=4", "--config.rollout.max_prompt_length=32",
             "--config.model.remat=False")]
  return [(f"qwen2.5-{m}", d, int(T)) for m in args.models.split(",")
          for d in args.devices.split(",") for T in args.lengths.split(",")]


def dry_run(args) -> dict:
  return plan_figures.check_rows([row(*cell) for cell in cells(args)])


def run(args) -> dict:
  lines = ["| model | device | T | choice | state | rollout | update | verdict |",
           "|---|---|---|---|---|---|---|---|"]
  commands, rows = [], []
  for arch, device, T, *more in cells(args):
    r = row(arch, device, T, *more)
    t0 = time.perf_counter()
    s = summary(plan_figures.plan_row(r))
    s.update(row=r.name, seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps(s), flush=True)
    rows.append(s)
    choice = ("state over budget" if s["update"] is None
              else f"mb {s['micro_batches']}, remat {s['remat']}")
    lines.append(f"| {arch} | {device} | {T:,} | {choice} | {s['state']:.2f} | "
                 f"{cell(s['rollout'])} | {cell(s['update'])} | "
                 f"{'fits' if s['fits'] else 'does not fit'} |")
    commands.append(f"- {r.name}: `{r.command()}`")
  print("\n".join(lines + ["", "GiB per device, train state included. Commands:", ""] + commands))
  return {"rows": rows}
