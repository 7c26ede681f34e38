"""The planner's figures quoted in README.md and the experiments' docstrings are
the planner's: one row is planned again by the device's own compiler and
compared, and every quote agrees with the README's table.

Regenerate them with `python bench/plan_figures.py --write`.
"""

import importlib.util
import os
import sys

import pytest

from grpojax import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("plan_figures",
                                               os.path.join(ROOT, "bench", "plan_figures.py"))
figures_lib = importlib.util.module_from_spec(_spec)
sys.modules["plan_figures"] = figures_lib  # its dataclasses look their module up
_spec.loader.exec_module(figures_lib)


def test_every_row_is_in_the_readme_with_its_command():
  shown = figures_lib.read_readme()
  assert set(shown) == {row.name for row in figures_lib.ROWS}
  readme = open(figures_lib.README).read()
  for row in figures_lib.ROWS:
    assert f"`{row.command()}`" in readme
    f = shown[row.name]
    assert f["update"] > 0 and f["rollout"] > 0 and f["micro_batches"] >= 1


def test_the_docstrings_quote_the_readmes_rows():
  shown = figures_lib.read_readme()
  for config, names in figures_lib.DOCSTRINGS.items():
    src = open(os.path.join(ROOT, config)).read()
    quoted = " ".join(figures_lib.DOC_BLOCK.search(src)[2].split())  # as wrapped
    assert quoted == figures_lib.sentence(shown, names)


@pytest.mark.slow
@pytest.mark.skipif(not targets.available("h100-80gb"),
                    reason=f"no CUDA plugin: {targets.CUDA_INSTALL}")
def test_the_h100_row_is_what_the_planner_says_now(monkeypatch):
  """The 0.5B GSM8K run on one H100, planned again at the choice the table shows
  (fitting it again would compile the update five more times; the v5e's row,
  under full remat, takes the TPU compiler minutes)."""
  row = next(r for r in figures_lib.ROWS if r.name == "gsm8k-0.5b-h100")
  shown = figures_lib.read_readme()[row.name]
  pinned = dataclasses_replace(row, shown)
  monkeypatch.setattr(sys, "argv", ["plan"])
  now = figures_lib.figures(figures_lib.plan_row(pinned))
  for key in ("rollout", "update", "eval", "update_at_least", "micro_batches", "remat", "fits"):
    assert now[key] == shown[key], key


def dataclasses_replace(row, shown):
  import dataclasses

  return dataclasses.replace(row, overrides=row.overrides + (
      f"--config.train.micro_batches={shown['micro_batches']}",
      f"--config.model.remat={shown['remat']}"))
