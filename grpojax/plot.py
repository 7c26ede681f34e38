"""PNG plots of a run's metrics.jsonl: one file per panel plus summary.png.

  python -m grpojax.plot WORKDIR [--out DIR]    # default DIR: WORKDIR/plots
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

from grpojax.train.metrics import METRICS_FILE, read_metrics


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) where `key` was logged with a finite value; eval keys are sparse."""
  steps, values = [], []
  for row in rows:
    value = row.get(key)
    if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
      steps.append(row["step"])
      values.append(value)
  return steps, values


def _keys(rows: list[dict], predicate: Callable[[str], bool]) -> list[str]:
  found = {key for row in rows for key in row if key != "step" and predicate(key)}
  return sorted(found)


def _panels(rows: list[dict]) -> list[tuple[str, str, list[str]]]:
  """(file stem, title, keys) of the panels whose keys appear in the rows."""
  panels = [
      ("reward", "reward", ["reward"] + _keys(
          rows, lambda k: k.startswith("rewards/") and k.endswith("/mean"))),
      # accuracy, pass@k, maj@k, mean@n, of every eval set: all fractions of one scale.
      ("eval", "eval", _keys(rows, lambda k: k.startswith("eval/"))),
      ("kl", "kl", ["kl"]),
      ("entropy", "entropy", ["entropy"]),
      ("completion_length", "completion length (tokens)", ["completions/mean_length"]),
      ("clip_ratio", "clip ratio", _keys(rows, lambda k: k.startswith("clip_ratio/"))),
  ]
  reward = _series(rows, "reward")
  out = []
  for stem, title, keys in panels:
    keys = [key for key in keys if _series(rows, key)[0]
            # A series that is zero throughout (kl with beta 0, clip ratios on-policy)
            # says nothing a panel should show.
            and any(v != 0 for v in _series(rows, key)[1])
            # One reward function: its mean is the reward curve again.
            and not (key.startswith("rewards/") and _series(rows, key) == reward)]
    if keys:
      out.append((stem, title, keys))
  return out


def _draw(ax, rows: list[dict], title: str, keys: list[str]) -> None:
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

  for key in keys:
    steps, values = _series(rows, key)
    # Sparse series (eval every k steps) get markers so single points stay visible.
    marker = "o" if len(steps) < 30 else None
    (line,) = ax.plot(steps, values, label=key, marker=marker, markersize=3)
    if key == "reward":
      std = dict(zip(*_series(rows, "reward_std")))
      band = [(s, v, std[s]) for s, v in zip(steps, values) if s in std]
      if band:
        s, v, d = zip(*band)
        ax.fill_between(s, [a - b for a, b in zip(v, d)], [a + b for a, b in zip(v, d)],
                        color=line.get_color(), alpha=0.2, linewidth=0, label="± reward_std")
  ax.set_title(title)
  ax.set_xlabel("step")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.grid(True, alpha=0.3)
  if len(keys) > 1 or keys == ["reward"]:
    ax.legend(fontsize="small")


def plot_metrics(workdir: str, out_dir: str | None = None) -> list[str]:
  """Writes the panels present in `workdir/metrics.jsonl` as PNGs; returns their paths.

  Call it on one process only (the files are shared). Returns [] when no panel's
  keys were logged.
  """
  # matplotlib is heavy: imported only when plotting. Figure + the Agg canvas keep
  # pyplot's global state and the user's backend untouched.
  # pylint: disable=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  rows = read_metrics(workdir)
  panels = _panels(rows)
  if not panels:
    return []
  out_dir = out_dir or os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)

  def save(fig, name: str) -> str:
    FigureCanvasAgg(fig)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    return path

  paths = []
  for stem, title, keys in panels:
    fig = Figure(figsize=(6, 4))
    # Fixed margins: tight_layout costs a second draw of every figure.
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.92)
    _draw(fig.add_subplot(1, 1, 1), rows, title, keys)
    paths.append(save(fig, stem + ".png"))

  ncols = min(3, len(panels))
  nrows = math.ceil(len(panels) / ncols)
  fig = Figure(figsize=(5 * ncols, 3.5 * nrows))
  for i, (_, title, keys) in enumerate(panels):
    _draw(fig.add_subplot(nrows, ncols, i + 1), rows, title, keys)
  fig.tight_layout()
  paths.append(save(fig, "summary.png"))
  return paths


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grpojax.plot",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("workdir", help="run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None, help="output directory (default: WORKDIR/plots)")
  args = parser.parse_args(argv)
  if not os.path.exists(os.path.join(args.workdir, METRICS_FILE)):
    print(f"no {METRICS_FILE} in {args.workdir!r}: is it a grpojax workdir?", file=sys.stderr)
    return 1
  paths = plot_metrics(args.workdir, args.out)
  if not paths:
    print(f"nothing to plot: {args.workdir}/{METRICS_FILE} has none of reward, eval/accuracy, "
          "kl, entropy, completions/mean_length, clip_ratio/*", file=sys.stderr)
  for path in paths:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
