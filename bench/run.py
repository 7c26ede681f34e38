"""grpojax's benchmarks, one runner: `python bench/run.py NAME [--device D] [--quick] [--json]`.

Each workload is a module in bench/workloads/ (its docstring says what it
measures and against which peer) with `add_arguments(parser)` and
`run(args) -> dict` (and `dry_run(args) -> dict` where it has --dry-run); it
prints its lines as it goes and returns its figures.
Where a peer runs in the same process, the figures hold their ratio.

  python bench/run.py --list                 # the workloads, one line each
  python bench/run.py sampler --quick        # tiny shapes: seconds on a CPU
  python bench/run.py engine --device gpu --json

--device picks the settings a workload takes on that kind of machine (cpu,
gpu or tpu; default: the platform JAX runs on), e.g. Qwen2.5-0.5B's shapes in
bf16 on a GPU against a 27.8M-parameter model on a CPU; flags a workload
defines override them. --quick runs tiny shapes, the test suite's setting
(tests/test_bench_suite.py); where even that compiles for too long, the workload
has --dry-run too: its programs set up and traced (`.lower()`), or its plan listed,
nothing compiled or run. --json prints, last, one JSON object: the workload, the
command, the device, the jax version, the commit and the figures.
bench/device.sh runs the figures only a device can give in one call.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
# Listed in the order RESULTS.md shows them.
WORKLOADS = ("sampler", "step", "roofline", "engine", "stream", "async", "rewards",
             "math_agreement", "device_programs", "plan_figures", "plan_proxy", "long_plans",
             "lora", "trl_side_by_side", "arithmetic_by_size", "tools", "startup", "scale_out",
             "reward_model", "grpo_vs_ppo")


def summary(name: str, width: int = 100) -> str:
  """The first paragraph of a workload's docstring on one line, cut at `width`, read
  without importing it (jax stays unstarted, so `--list` is instant)."""
  with open(os.path.join(BENCH, "workloads", f"{name}.py"), encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  line = " ".join(doc.split("\n\n")[0].split())
  return line if len(line) <= width else line[:width - 3] + "..."


def commit() -> str | None:
  """This checkout's commit (with "+" where its files differ from it), or None outside git."""
  def git(*args):  # read only: no optional locks, the index is never rewritten
    return subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)

  try:
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
      return None
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return None
  return head.stdout.strip() + ("+" if dirty else "")


def record(name: str, argv: list[str], figures: dict) -> dict:
  """What --json prints: the figures and where they come from."""
  import jax

  device = jax.devices()[0]
  return {"workload": name, "command": " ".join(["python bench/run.py", name, *argv]),
          "device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
          "commit": commit(), "figures": figures}


def load(name: str):
  """The workload module `name` (bench/workloads/NAME.py)."""
  if name not in WORKLOADS:
    raise SystemExit(f"workload {name!r} is unknown; known: {', '.join(WORKLOADS)} "
                     "(python bench/run.py --list)")
  for path in (ROOT, BENCH):  # grpojax from this checkout; `common` and `workloads`
    if path not in sys.path:
      sys.path.insert(0, path)
  return importlib.import_module(f"workloads.{name}")


def parser_for(name: str, module) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=f"bench/run.py {name}", description=module.__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--device", choices=("cpu", "gpu", "tpu"),
                      help="the settings for this kind of machine (default: JAX's platform)")
  parser.add_argument("--quick", action="store_true", help="tiny shapes: seconds on a CPU")
  parser.add_argument("--json", action="store_true",
                      help="last line: one JSON object of the figures and their provenance")
  if hasattr(module, "dry_run"):
    parser.add_argument("--dry-run", action="store_true",
                        help="set up and trace the workload's programs, or list its plan, "
                        "without compiling or running them")
  module.add_arguments(parser)
  return parser


def main(argv: list[str] | None = None) -> dict | None:
  """Runs one workload; returns what --json prints (also without --json)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return None
  if argv[0] == "--list":
    for name in WORKLOADS:
      print(f"{name:<19} {summary(name)}")
    return None
  name, rest = argv[0], argv[1:]
  module = load(name)
  args = parser_for(name, module).parse_args(rest)
  if args.device is None:
    import jax

    args.device = jax.default_backend()
  out = record(name, rest, module.dry_run(args) if getattr(args, "dry_run", False)
               else module.run(args))
  if args.json:
    print(json.dumps(out), flush=True)
  return out


if __name__ == "__main__":
  main()
