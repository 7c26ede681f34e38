"""The planner's figures quoted in docs/speed.md and the experiments' docstrings are
the planner's: one row is planned again by the device's own compiler (the
plan_figures workload's own planning) and compared, and every quote agrees with
that page's table.

Regenerate them with `python bench/run.py plan_figures --write`.
"""

import dataclasses
import os
import sys

import pytest

from grpojax import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import run as bench_run  # noqa: E402  bench/run.py

figures_lib = bench_run.load("plan_figures")


def test_every_row_is_in_the_speed_page_with_its_command():
  shown = figures_lib.read_table()
  assert set(shown) == {row.name for row in figures_lib.ROWS}
  readme = open(figures_lib.TABLE_DOC).read()
  for row in figures_lib.ROWS:
    assert f"`{row.command()}`" in readme
    f = shown[row.name]
    assert f["update"] > 0 and f["rollout"] > 0 and f["micro_batches"] >= 1


def test_the_docstrings_quote_the_speed_pages_rows():
  shown = figures_lib.read_table()
  for config, names in figures_lib.DOCSTRINGS.items():
    src = open(os.path.join(ROOT, config)).read()
    quoted = " ".join(figures_lib.DOC_BLOCK.search(src)[2].split())  # as wrapped
    assert quoted == figures_lib.sentence(shown, names)


@pytest.mark.slow
@pytest.mark.skipif(not targets.available("h100-80gb"),
                    reason=f"no CUDA plugin: {targets.CUDA_INSTALL}")
def test_the_h100_row_is_what_the_planner_says_now(monkeypatch):
  """The 0.5B GSM8K run on one H100, planned again at the choice the table shows, with
  no memory budget to fit it to: its rollout and update are compiled once each and
  their verdict held against the device's memory, as the row's was (fitting it again
  would compile the update once more to check the choice, five more times to search;
  the v5e's row, under full remat, takes the TPU compiler minutes). The eval generate
  column is left out: it is the rollout's engine at eval's batch, and its compile
  (about 50 s here) would add a third to the test."""
  row = next(r for r in figures_lib.ROWS if r.name == "gsm8k-0.5b-h100")
  shown = figures_lib.read_table()[row.name]
  pinned = dataclasses.replace(row, overrides=row.overrides + (
      f"--config.train.micro_batches={shown['micro_batches']}",
      f"--config.model.remat={shown['remat']}", "--config.train.memory_budget=0",
      "--config.eval.num_prompts=0"))
  monkeypatch.setattr(sys, "argv", ["plan"])
  now = figures_lib.figures(figures_lib.plan_row(pinned))
  assert now["eval"] is None  # not planned
  for key in ("rollout", "update", "update_at_least", "micro_batches", "remat", "fits"):
    assert now[key] == shown[key], key
