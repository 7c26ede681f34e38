"""README.md and docs/ stay true: every `python -m grpojax.main` command they show
parses and gives a valid config (the smoke one also runs, in test_experiments /
.ci/run), every config key is in docs/configuration.md's table with its default, every
relative link leads to a file, and README stays a newcomer's read."""

import importlib
import re
import shlex
from pathlib import Path

import pytest
from absl import flags
from ml_collections import config_flags

from grpojax import config as config_lib
from grpojax import main
from grpojax.core import losses

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
REFERENCE = (ROOT / "docs" / "configuration.md").read_text()


def _commands():
  """The grpojax.main invocations of the pages' bash blocks, continuation lines joined."""
  for block in re.findall(r"```bash\n(.*?)```", "\n".join(PAGES.values()), re.S):
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
      line = line.split("#")[0]
      if "grpojax.main" in line:
        yield line[line.index("python -m grpojax.main"):].strip()


COMMANDS = list(_commands())


def test_readme_has_the_commands():
  assert "pip install -e . && python -m grpojax.main" in README
  assert ('pip install torch==2.13.0 -e ".[test]" && pytest -q -n 2 --dist loadfile '
          '--durations=25') in README
  assert len(COMMANDS) >= 4


def test_the_readme_is_a_newcomers_read_and_its_links_lead_somewhere():
  # Ten minutes: what it is, the two commands, the default run, porting from TRL, the
  # experiments and where the rest is; depth lives in docs/.
  assert len(README.splitlines()) <= 400
  for page, text in PAGES.items():
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
      if not target.startswith(("http://", "https://", "mailto:")):
        assert (page.parent / target).exists(), f"{page.name} links to {target}: no such file"


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_commands_give_valid_configs(command, monkeypatch, tmp_path):
  monkeypatch.chdir(ROOT)  # the README's paths are relative to the checkout
  # Experiments that point at ~/models/...: give them one.
  monkeypatch.setenv("HOME", str(tmp_path))
  for name in ("Qwen2.5-0.5B-Instruct",):
    (tmp_path / "models" / name).mkdir(parents=True)
    (tmp_path / "models" / name / "config.json").write_text("{}")
  argv = ["grpojax.main"] + shlex.split(command)[3:]  # past "python -m grpojax.main"
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", main._base(argv)[0], flag_values=values,
                                          lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", "workdir", "", flag_values=values)
  flags.DEFINE_multi_string("import", [], "", flag_values=values)
  values(argv)
  # `--import M`: M is the README's own registration example, as the user's module.
  example = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "register_loss" in b)
  monkeypatch.syspath_prepend(str(tmp_path))
  registered = []
  for name in values["import"].value:
    (tmp_path / f"{name}.py").write_text(example)
    before = set(losses.LOSSES.names())
    importlib.import_module(name)
    registered += sorted(set(losses.LOSSES.names()) - before)
  try:
    config_lib.validate(config.value)
  finally:
    for name in registered:
      losses.LOSSES.pop(name)


SHAPES = ("mesh.shape", "parallel.rollout_shape")  # meshes' shapes: one row each


def test_every_config_key_is_in_the_reference():
  section = REFERENCE

  def leaves(cfg, prefix=""):
    for key, value in cfg.items():
      if hasattr(value, "items") and f"{prefix}{key}" not in SHAPES:
        yield from leaves(value, f"{prefix}{key}.")
      else:
        yield f"{prefix}{key}"

  missing = [k for k in leaves(config_lib.get_config()) if f"`{k}`" not in section]
  assert not missing, f"docs/configuration.md lacks {missing}"


def _reference_rows():
  """(key, default as written) for each key of docs/configuration.md's table."""
  for line in REFERENCE.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or not cells[0].startswith("`"):
      continue
    keys = re.findall(r"`([\w.]+)`", cells[0])
    defaults = [d.strip() for d in cells[1].split(",")] if len(keys) > 1 else [cells[1]]
    defaults *= len(keys) if len(defaults) == 1 else 1  # one default for each of them
    assert len(defaults) == len(keys), line
    yield from zip(keys, defaults)


def _as_written(value) -> str:
  if value is None:
    return "unset"
  if isinstance(value, str):
    return f"`{value}`" if value else '`""`'
  if isinstance(value, bool):
    return f"`{value}`"
  return f"{value:g}" if isinstance(value, float) else str(value)


def test_the_references_defaults_are_the_configs():
  # The table is what a command without --config starts from for any task but the
  # embedded one's: they must be the same thing.
  cfg = config_lib.get_config()
  checked = 0
  for key, written in _reference_rows():
    value = cfg
    for part in key.split("."):
      value = value[part]
    if key in SHAPES:  # written as the dict's items
      written, value = written.strip("`"), ", ".join(f"{k}={v}" for k, v in value.items())
    ok = (written == _as_written(value) or written.strip("`") == str(value)
          or (isinstance(value, (int, float)) and not isinstance(value, bool)
              and re.fullmatch(r"[-\d.e]+", written) and float(written) == value))
    assert ok, f"docs/configuration.md says {key} defaults to {written}; get_config() has {value!r}"
    checked += 1
  assert checked > 80
