"""The Colab quick start runs top to bottom in smoke mode (CPU, no install, no hub) and
shows the summary table and the plots; the committed notebook carries no outputs."""

import importlib.util
import json
import os
import time

import nbformat
import pytest
from nbclient import NotebookClient
from grpojax.run.settings import read as read_settings


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "colab", "grpojax_tpu_quickstart.ipynb")
# The LoRA/QLoRA variant: the quick start's install, devices and helper cells, then one
# LoRA experiment. Not run here (its smoke variant is the GSM8K smoke with adapters, which
# tests/test_lora.py trains end to end); its cells are compiled and its experiments loaded.
LORA_NOTEBOOK = os.path.join(ROOT, "colab", "grpojax_tpu_lora_quickstart.ipynb")
NOTEBOOKS = [NOTEBOOK, LORA_NOTEBOOK]


def _code_cells(nb):
  return [cell for cell in nb.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_notebook_has_no_outputs(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for cell in _code_cells(nb):
    assert not cell.outputs and cell.execution_count is None, (
        f"{cell.id} has outputs: clear them before committing")


def test_lora_notebook_cells_compile_and_name_its_experiment(monkeypatch):
  nb = nbformat.read(LORA_NOTEBOOK, as_version=4)
  for cell in _code_cells(nb):
    compile(cell.source, cell.id, "exec")  # no IPython magics: plain Python
  monkeypatch.delenv("GRPOJAX_SMOKE", raising=False)
  settings = {}
  exec(_code_cells(nb)[0].source, settings)  # noqa: S102 -- the first cell: settings only
  name, model = settings["EXPERIMENT"], settings["MODEL"]
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments",
                                                                   f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert os.path.basename(module.get_config().model.path) == model  # the download it makes
  assert read_settings(module.get_config("smoke")).model.lora.enabled


@pytest.mark.slow
def test_notebook_runs_in_smoke_mode(tmp_path, monkeypatch):
  if importlib.util.find_spec("ipykernel") is None:
    pytest.fail("ipykernel is missing, so no kernel can run the notebook: pip install -e '.[test]'")
  # The kernel inherits this environment. One CPU device, not conftest's 8 fake ones:
  # compiling for 8 took ~1.6x the CPU time here, and sharding is tested elsewhere.
  flags = os.environ.get("XLA_FLAGS", "").split()
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      f for f in flags if not f.startswith("--xla_force_host_platform_device_count")))
  monkeypatch.setenv("GRPOJAX_SMOKE", "1")
  monkeypatch.setenv("GRPOJAX_REPO", ROOT)
  monkeypatch.delenv("GRPOJAX_OFFLINE", raising=False)
  nb = nbformat.read(NOTEBOOK, as_version=4)

  start = time.time()
  # Raises CellExecutionError, with the cell's traceback, if any cell fails.
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  print(f"notebook ran in {time.time() - start:.1f}s")

  outputs = [out for cell in _code_cells(nb) for out in cell.outputs]
  stdout = "".join(out.text for out in outputs
                   if out.output_type == "stream" and out.name == "stdout")
  assert "install skipped" in stdout
  assert "skipped downloading Qwen2.5-0.5B-Instruct" in stdout
  # The GSM8K config is built (its keys exist) but not trained on offline.
  assert ("skipped training on GSM8K" in stdout
          or "gsm8k_qwen2_5_0_5b.py is not in this checkout" in stdout)
  for row in ("eval/accuracy (start of GRPO)", "eval/accuracy (end)", "reward (last step)"):
    assert row in stdout
  images = [out for out in outputs
            if out.output_type == "display_data" and "image/png" in out.data]
  assert images, "no plot shown inline"

  workdir = tmp_path / "runs" / "arithmetic"
  with open(workdir / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps and steps[-1] == 4  # arithmetic_tiny.py:smoke's train.steps
  assert (workdir / "plots" / "summary.png").exists()
