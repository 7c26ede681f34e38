"""grpojax.plot: PNGs from a synthetic metrics.jsonl, through the function and the CLI."""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from grpojax import plot  # pylint: disable=wrong-import-position

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_metrics(workdir, *, with_eval=True):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(20):
      row = {"step": step, "reward": step / 20, "reward_std": 0.1, "kl": 0.01 * step,
             "entropy": None if step == 3 else 1.0 - step / 40,  # a NaN written as null
             "completions/mean_length": 30.0 + step,
             "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01}
      if with_eval and step % 10 == 0:
        row.update({"eval/accuracy": step / 40, "eval/pass@4": step / 30})
      f.write(json.dumps(row) + "\n")


def _assert_pngs(paths):
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == PNG_SIGNATURE, path
    assert os.path.getsize(path) > 1000, path


def test_plot_metrics_writes_every_panel(tmp_path):
  workdir = str(tmp_path)
  _write_metrics(workdir)
  paths = plot.plot_metrics(workdir)
  names = [os.path.basename(p) for p in paths]
  assert names == ["reward.png", "eval.png", "kl.png", "entropy.png",
                   "completion_length.png", "clip_ratio.png", "summary.png"]
  assert all(os.path.dirname(p) == os.path.join(workdir, "plots") for p in paths)
  _assert_pngs(paths)


def test_panels_skip_absent_keys(tmp_path):
  workdir = str(tmp_path)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(3):
      f.write(json.dumps({"step": step, "reward": 1.0, "step_time": 2.0}) + "\n")
  paths = plot.plot_metrics(workdir, str(tmp_path / "out"))
  assert [os.path.basename(p) for p in paths] == ["reward.png", "summary.png"]
  _assert_pngs(paths)

  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "step_time": 2.0, "kl": math.inf}) + "\n")
  assert plot.plot_metrics(workdir, str(tmp_path / "none")) == []


def test_cli(tmp_path):
  workdir, out = str(tmp_path / "run"), str(tmp_path / "figs")
  _write_metrics(workdir, with_eval=False)
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "grpojax.plot", workdir, "--out", out],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr
  paths = result.stdout.split()
  assert "eval.png" not in {os.path.basename(p) for p in paths}
  assert os.path.join(out, "summary.png") in paths
  _assert_pngs(paths)


def test_panels_drop_flat_zero_and_duplicate_series():
  """With beta 0 and on-policy steps, kl and the clip ratios are zero throughout; with
  one reward function its mean is the reward curve again: no panel or line for them."""
  rows = [{"step": s, "reward": 0.1 * s, "rewards/exact_answer/mean": 0.1 * s, "kl": 0.0,
           "clip_ratio/region_mean": 0.0, "entropy": 1.0 - 0.1 * s} for s in range(4)]
  assert plot._panels(rows) == [("reward", "reward", ["reward"]),
                                ("entropy", "entropy", ["entropy"])]
  rows[2]["kl"] = 0.01  # a real kl curve stays
  rows[1]["rewards/exact_answer/mean"] = 0.5  # and so does a reward that differs
  assert [p[0] for p in plot._panels(rows)] == ["reward", "kl", "entropy"]
  assert plot._panels(rows)[0][2] == ["reward", "rewards/exact_answer/mean"]
