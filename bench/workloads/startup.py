"""Seconds from a command to its first answer: `import grpojax`, `python -m grpojax.main --help`, a config error, against `import jax`.

Each command runs in a fresh interpreter, `--repeats` times (the median is kept;
the first run also warms the file cache). The peer is the floor any JAX program
pays, `python -c "import jax"`, so the figures hold each command's ratio to it:
below 1 means the command answers before JAX could have loaded. --quick: one
repeat each, no warm-up, the unknown field left out. The CPU alone works here;
--device changes nothing.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = {
    "import_jax": ["-c", "import jax"],  # the peer
    "import_grpojax": ["-c", "import grpojax"],
    "main_help": ["-m", "grpojax.main", "--help"],
    "config_error": ["-m", "grpojax.main", "--config.loss.loss_type=no_such_loss"],
    "unknown_field": ["-m", "grpojax.main", "--config.train.no_such_field=1"],
}


def add_arguments(parser) -> None:
  parser.add_argument("--repeats", type=int, default=5)


def seconds(argv: list[str], repeats: int) -> float:
  """The median wall time of `python ARGV` in a fresh interpreter."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, timeout=300,
                   check=False)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run(args) -> dict:
  repeats = 1 if args.quick else args.repeats
  names = [n for n in COMMANDS if not (args.quick and n == "unknown_field")]
  if not args.quick:
    seconds([*COMMANDS["import_jax"]], 1)  # the file cache, warmed
  figures = {}
  for name in names:
    figures[f"{name}_s"] = s = seconds(COMMANDS[name], repeats)
    print(f"{name:16s} {s:6.2f} s   python {' '.join(COMMANDS[name])}", flush=True)
  floor = figures["import_jax_s"]
  for name in names[1:]:
    figures[f"{name}_vs_jax"] = figures[f"{name}_s"] / floor
  print("ratio to `import jax`: " + ", ".join(
      f"{n} {figures[f'{n}_vs_jax']:.2f}x" for n in names[1:]))
  return figures
