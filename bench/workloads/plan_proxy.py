"""How far the planner's XLA:CPU proxy is from each device's own compiler, program by program.

A plan for a device whose compiler is not installed compiles the same programs
for XLA:CPU on as many fake CPU devices, and says so in one line
(`grpojax.plan`'s note). This workload plans plan_figures' rows both ways, each
in its own process (the proxy's with no compiler in reach: an empty
$GRPOJAX_COMPILERS, no $TPU_LIBRARY_PATH nor $GRPOJAX_CUDA_PLUGIN), and prints
each program's GiB per device (train state included) and the proxy's error,
(proxy - device) / device. The peer is the device's own compiler. `--write`
rewrites docs/devices.md's table between `<!-- plan-proxy -->` and
`<!-- /plan-proxy -->`; grpojax/plan.py's PROXY_ERROR quotes its range.
--dry-run: the commands, nothing compiled. Needs both compilers
(`python -m grpojax.plan --install-compilers`); minutes per row on a CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from workloads import plan_figures

ROOT = plan_figures.ROOT
DOC = os.path.join(ROOT, "docs", "devices.md")
BLOCK = re.compile(r"(<!-- plan-proxy -->\n)(.*?)(<!-- /plan-proxy -->)", re.DOTALL)
PLAN = os.path.join(ROOT, "grpojax", "plan.py")
CONSTANT = re.compile(r"^PROXY_ERROR = \(.*\)$", re.MULTILINE)
RANGE = re.compile(r"The proxy's error ranges from ([-+]\d+)% to ([-+]\d+)%")
PROGRAMS = ("rollout", "update", "eval_greedy")
GiB = 2**30


def add_arguments(parser) -> None:
  parser.add_argument("--write", action="store_true", help="rewrite docs/devices.md's table")
  parser.add_argument("--rows", default=",".join(r.name for r in plan_figures.ROWS),
                      help="plan_figures' rows to compare, comma-separated")


def _plan(row, proxy: bool) -> dict:
  """The row's planner command in a process of its own: its JSON result."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # the command's --devices says how many
  flags = []
  with tempfile.TemporaryDirectory() as empty:
    if proxy:
      for key in ("TPU_LIBRARY_PATH", "GRPOJAX_CUDA_PLUGIN"):
        env.pop(key, None)
      env["GRPOJAX_COMPILERS"] = empty
      flags = [f"--devices={row.devices}"]  # as many fake CPU devices as the device's
    command = row.command().split()[1:] + flags + ["--json"]
    out = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=3600)
  lines = out.stdout.strip().splitlines()
  if not lines or not lines[-1].startswith("{"):
    raise SystemExit(f"{row.name}: {' '.join(command)} failed: {out.stderr.strip()[-1500:]}")
  result = json.loads(lines[-1])
  if (result["choices"]["backend"] == "cpu") != proxy:
    raise SystemExit(f"{row.name}: the {'proxy' if proxy else 'device'} plan compiled for "
                     f"{result['choices']['backend']}")
  return result


def fit(result: dict) -> str:
  """The choices the plan's fit made (they follow its compiler's bytes, so the two
  sides of a row may differ): micro-batches, remat, the KV pool."""
  c = result["choices"]
  pages = re.search(r"kv_pages=(\w+)", c["fit"] or "")
  return (f"micro_batches={c['micro_batches']}, remat={c['remat']}"
          + (f", kv_pages={pages[1]}" if pages else ""))


def compare(device: dict, proxy: dict) -> dict:
  """{program: (device GiB, proxy GiB, error)} and {"fit": (device's, proxy's)}; a
  program the device's compiler refused (its figure a lower bound) or the proxy lacks
  is left out."""
  out = {"fit": (fit(device), fit(proxy))}
  for key in PROGRAMS:
    d, p = device["programs"].get(key), proxy["programs"].get(key)
    if d is None or p is None or d.get("at_least"):
      continue
    out[key] = (d["total_bytes"] / GiB, p["total_bytes"] / GiB,
                (p["total_bytes"] - d["total_bytes"]) / d["total_bytes"])
  return out


def _errors(results: dict[str, dict]) -> list[float]:
  return [v[2] for programs in results.values() for k, v in programs.items() if k != "fit"]


def table(results: dict[str, dict]) -> str:
  lines = ["| row | program | device's compiler | XLA:CPU proxy | proxy error |",
           "|---|---|---|---|---|"]
  for name, programs in results.items():
    for key, (d, p, err) in ((k, v) for k, v in programs.items() if k != "fit"):
      lines.append(f"| {name} | {key} | {d:.2f} GiB | {p:.2f} GiB | {err:+.0%} |")
  errors = _errors(results)
  lines += ["", f"The proxy's error ranges from {min(errors):+.0%} to {max(errors):+.0%}. "
            "GiB per device, train state included; each row is plan_figures' command, "
            "planned with and without the device's compiler (`python bench/run.py plan_proxy"
            " --write`). Each side fits the run by its own compiler's bytes:"]
  lines += [f"{name}: {programs['fit'][0]} (device), {programs['fit'][1]} (proxy)."
            for name, programs in results.items()]
  return "\n".join(lines)


def write(results: dict[str, dict]) -> None:
  """docs/devices.md's table, and plan.py's PROXY_ERROR to its range (rounded as shown)."""
  text = open(DOC, encoding="utf-8").read()
  if not BLOCK.search(text):
    raise SystemExit("docs/devices.md has no <!-- plan-proxy --> block")
  text = BLOCK.sub(lambda m: m[1] + table(results) + "\n" + m[3], text)
  open(DOC, "w", encoding="utf-8").write(text)
  low, high = documented_range(text)
  source = open(PLAN, encoding="utf-8").read()
  open(PLAN, "w", encoding="utf-8").write(
      CONSTANT.sub(f"PROXY_ERROR = ({low}, {high})", source, count=1))


def documented_range(text: str) -> tuple[float, float]:
  """The range docs/devices.md's table states, as fractions."""
  m = RANGE.search(text)
  if m is None:
    raise ValueError("docs/devices.md states no proxy error range")
  return int(m[1]) / 100, int(m[2]) / 100


def dry_run(args) -> dict:
  commands = {}
  for row in plan_figures.ROWS:
    plan_figures.row_config(row)
    commands[row.name] = [row.command(), f"{row.command()} --devices={row.devices} "
                          "(no compiler in reach: XLA:CPU)"]
    print(f"{row.name}: {commands[row.name][0]}", flush=True)
  return {"commands": commands}


def run(args) -> dict:
  if args.quick:
    return dry_run(args)
  rows = [next(r for r in plan_figures.ROWS if r.name == name) for name in args.rows.split(",")]
  results = {}
  for row in rows:
    results[row.name] = compare(_plan(row, proxy=False), _plan(row, proxy=True))
    for key, value in results[row.name].items():
      if key == "fit":
        print(f"{row.name:18s} fit: device {value[0]}; proxy {value[1]}", flush=True)
        continue
      d, p, err = value
      print(f"{row.name:18s} {key:12s} device {d:7.2f} GiB  proxy {p:7.2f} GiB  {err:+.1%}",
            flush=True)
  errors = _errors(results)
  if args.write:  # the rows compared (--rows: the 7B row takes an hour on 2 cores)
    write(results)
    print("rewrote docs/devices.md and grpojax/plan.py's PROXY_ERROR")
  return {"rows": {name: {k: list(v) for k, v in programs.items()}
                   for name, programs in results.items()},
          "min_error": min(errors), "max_error": max(errors)}
