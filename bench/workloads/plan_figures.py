"""The planner's figures that docs/speed.md and the experiments' docstrings quote.

Each figure is one `python -m grpojax.plan` command (ROWS below), run with the
device's own compiler (`grpojax.targets`: libtpu for a TPU, the CUDA plugin for
a GPU; a row whose compiler is missing is refused, never estimated). `--write`
runs them all and rewrites the marked blocks: docs/speed.md's table between
`<!-- plan-figures -->` and `<!-- /plan-figures -->`, and the sentence between
`[plan-figures]` and `[/plan-figures]` in each experiment's docstring. The
tests run the cheaper rows again and compare them with what is written.

  python bench/plan_figures.py            # print the rows
  python bench/plan_figures.py --write    # and rewrite the blocks

Regenerate after any change to the planner, the model or the programs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import textwrap

# Compile-only: no backend but the CPU starts (the rows compile for their devices),
# unless jax is started already.
if "jax" not in sys.modules:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GSM8K = "experiments/gsm8k_qwen2_5_0_5b.py"
TABLE_DOC = os.path.join(ROOT, "docs", "speed.md")  # the page that holds the table
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  config: str
  overrides: tuple[str, ...]
  device: str
  devices: int = 1

  def command(self) -> str:
    flags = [f"--config {self.config}", *self.overrides, f"--device {self.device}"]
    if self.devices > 1:
      flags.append(f"--devices {self.devices}")
    return "python -m grpojax.plan " + " ".join(flags)


# The shipped GSM8K experiment with the published models' shapes (no weights needed).
ROWS = (
    Row("gsm8k-0.5b-v5e", GSM8K, ("--config.model.arch=qwen2.5-0.5b", "--config.model.path="),
        "tpu-v5e"),
    Row("gsm8k-0.5b-h100", GSM8K, ("--config.model.arch=qwen2.5-0.5b", "--config.model.path="),
        "h100-80gb"),
    Row("gsm8k-7b-8xh100", GSM8K, ("--config.model.arch=qwen2.5-7b", "--config.model.path=",
                                   "--config.mesh.shape.fsdp=8"), "h100-80gb", devices=8),
)
# --quick's: the same experiment at a tiny preset's shapes and batch, for this CPU.
QUICK = Row("gsm8k-tiny-cpu", GSM8K, (
    "--config.model.arch=qwen2_tiny", "--config.model.path=",
    "--config.rollout.prompts_per_step=2", "--config.rollout.group_size=4",
    "--config.rollout.max_prompt_length=32", "--config.rollout.max_completion_length=16",
    "--config.train.micro_batches=1", "--config.model.remat=False",
    "--config.eval.num_prompts=8", "--config.eval.batch_size=8"), "cpu")
# Which rows an experiment's docstring quotes.
DOCSTRINGS = {GSM8K: ("gsm8k-0.5b-h100", "gsm8k-0.5b-v5e")}


def row_config(row: Row):
  """The row's experiment with its overrides, parsed as the planner's command line does
  (an override of a key the config lacks stops here)."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["plan", f"--config={os.path.join(ROOT, row.config)}", *row.overrides]
  fv = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                           sys_argv=argv)
  fv(argv)
  return config.value


def plan_row(row: Row) -> dict:
  """Runs the row's planner command in-process: the planner's JSON result."""
  from grpojax import plan as plan_lib
  from grpojax import targets

  if row.device != "cpu" and not targets.available(row.device):
    install = targets.INSTALL if row.device in targets.TPUS else targets.CUDA_INSTALL
    raise SystemExit(f"{row.name}: {row.device}'s compiler is not installed: {install}")
  return plan_lib.plan(row_config(row), device=row.device, devices=row.devices)


def check_rows(rows) -> dict:
  """--dry-run: each row's command, its config parsed and validated; nothing planned."""
  from grpojax import config as config_lib

  out = {}
  for row in rows:
    config_lib.validate(row_config(row))
    out[row.name] = row.command()
    print(f"{row.name}: {row.command()}", flush=True)
  return {"commands": out}


def figures(result: dict) -> dict:
  """The numbers a row shows: GiB per device (train state included), the fit."""
  p, c = result["programs"], result["choices"]
  gib = lambda key: round(p[key]["total_bytes"] / GiB, 2) if key in p else None  # noqa: E731
  return {"rollout": gib("rollout"), "update": gib("update"), "eval": gib("eval_greedy"),
          "update_at_least": bool(p["update"].get("at_least")),
          "micro_batches": c["micro_batches"], "remat": c["remat"], "fits": result["fits"],
          "compile_s": round(sum(q["compile_s"] for q in p.values()), 1)}


def _gib(x, at_least=False) -> str:
  return "-" if x is None else f"{'>=' if at_least else ''}{x:.2f} GiB"


def table(results: dict[str, dict]) -> str:
  lines = ["| row | device | micro_batches, remat | rollout | update | eval generate | verdict |",
           "|---|---|---|---|---|---|---|"]
  for row in ROWS:
    f = results[row.name]
    where = f"{row.devices} x {row.device}" if row.devices > 1 else row.device
    lines.append(f"| {row.name} | {where} | {f['micro_batches']}, {f['remat']} | "
                 f"{_gib(f['rollout'])} | {_gib(f['update'], f['update_at_least'])} | "
                 f"{_gib(f['eval'])} | {'fits' if f['fits'] else 'does not fit'} |")
  lines.append("")
  lines.append("GiB per device, train state included. Each row is one planner command:")
  lines.append("")
  lines += [f"- {row.name}: `{row.command()}`" for row in ROWS]
  return "\n".join(lines)


def sentence(results: dict[str, dict], names) -> str:
  parts = []
  for name in names:
    row = next(r for r in ROWS if r.name == name)
    f = results[name]
    verdict = "fits" if f["fits"] else "does not fit"
    parts.append(f"{row.device} ({row.devices} device{'s' if row.devices > 1 else ''}): "
                 f"{verdict}, micro_batches={f['micro_batches']}, remat={f['remat']}, update "
                 f"{_gib(f['update'], f['update_at_least'])} per device")
  return "; ".join(parts) + "."


TABLE_BLOCK = re.compile(r"(<!-- plan-figures -->\n)(.*?)(<!-- /plan-figures -->)", re.DOTALL)
DOC_BLOCK = re.compile(r"(\[plan-figures\])(.*?)(\[/plan-figures\])", re.DOTALL)


def read_table() -> dict[str, dict]:
  """The rows docs/speed.md shows, as figures() gives them (for the tests)."""
  block = TABLE_BLOCK.search(open(TABLE_DOC).read())[2]
  out = {}
  for line in block.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) != 7 or cells[0] in ("row", "---"):
      continue
    micro, remat = (x.strip() for x in cells[2].split(","))
    num = lambda s: (None if s == "-"  # noqa: E731
                     else float(s.removeprefix(">=").removesuffix(" GiB")))
    out[cells[0]] = {"rollout": num(cells[3]), "update": num(cells[4]), "eval": num(cells[5]),
                     "update_at_least": cells[4].startswith(">="),
                     "micro_batches": int(micro),
                     "remat": {"True": True, "False": False}.get(remat, remat),
                     "fits": cells[6] == "fits"}
  return out


def write(results: dict[str, dict]) -> None:
  text = open(TABLE_DOC).read()
  if not TABLE_BLOCK.search(text):
    raise SystemExit("docs/speed.md has no <!-- plan-figures --> block")
  open(TABLE_DOC, "w").write(TABLE_BLOCK.sub(lambda m: m[1] + table(results) + "\n" + m[3], text))
  for config, names in DOCSTRINGS.items():
    path = os.path.join(ROOT, config)
    src = open(path).read()
    if not DOC_BLOCK.search(src):
      raise SystemExit(f"{config} has no [plan-figures] block")
    quote = textwrap.fill(f"[plan-figures] {sentence(results, names)} "
                          "[/plan-figures]", width=88)
    open(path, "w").write(DOC_BLOCK.sub(lambda m: quote, src))


def dry_run(args) -> dict:
  return check_rows([QUICK, *ROWS])


def add_arguments(parser) -> None:
  parser.add_argument("--write", action="store_true", help="rewrite docs/speed.md's table and the docstrings")
  parser.add_argument("--rows", default=",".join(r.name for r in ROWS),
                      help="the rows to plan, comma-separated")


def run(args) -> dict:
  rows = [QUICK] if args.quick else [next(r for r in ROWS if r.name == name)
                                     for name in args.rows.split(",")]
  results = {}
  for row in rows:
    results[row.name] = figures(plan_row(row))
    print(row.name, results[row.name], flush=True)
  if args.write:
    if set(results) != {r.name for r in ROWS}:
      raise SystemExit("--write regenerates every row: leave --rows and --quick out")
    write(results)
    print("rewrote docs/speed.md and", ", ".join(DOCSTRINGS))
  return {"rows": results}
