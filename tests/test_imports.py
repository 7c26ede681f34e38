"""The package's imports, read from its source (ast): no module imports another's
private (`_`) names, no import circle, and none upward through the layers that
README's "How the package is built" draws. Imports inside functions count too (a
deferred import hides a circle, it does not remove it)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "grpojax"


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imports(name: str, path: pathlib.Path, modules) -> tuple[set, list]:
  """(the package's modules `name` imports, the private names it takes from them)."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  edges, private, aliases = set(), [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the package, up level - 1
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      if not base.startswith("grpojax"):
        continue
      for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in modules:  # a submodule
          edges.add(full)
          aliases[alias.asname or alias.name] = full
        else:
          edges.add(base)
          if alias.name.startswith("_"):
            private.append(f"{name} imports {base}.{alias.name}")
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("grpojax"):
          edges.add(alias.name)
          aliases[alias.asname or alias.name] = alias.name
  for node in ast.walk(tree):  # module._name
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
        and aliases.get(node.value.id, name) != name):
      private.append(f"{name} reads {aliases[node.value.id]}.{node.attr}")
  return edges & set(modules), private


def _circles(graph: dict[str, set]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return found


# README's layers, bottom first: a module imports from its own layer and those below.
# A name is a module or a package (with everything in it); the most specific wins.
LAYERS = (
    ("foundations", ("grpojax.lazy", "grpojax.registry", "grpojax.targets", "grpojax.parallel",
                     "grpojax.errors")),
    ("maths", ("grpojax.core",)),
    ("rewards", ("grpojax.rewards", "grpojax.sandbox", "grpojax.tools")),
    ("kernels", ("grpojax.ops",)),
    ("model", ("grpojax.models",)),
    ("data", ("grpojax.data",)),
    ("generation", ("grpojax.sampling",)),
    ("the run's parts", ("grpojax.train",)),
    ("wiring", ("grpojax.config", "grpojax.run.settings", "grpojax.train.wiring")),
    ("assembly", ("grpojax.run",)),
    ("loop", ("grpojax.train.loop",)),
    # Nothing below the entry points imports the planner: what the loop shares with it
    # (the assembly, the memory fitting) lives below, in grpojax.run.
    ("planner", ("grpojax.plan",)),
    ("entry points", ("grpojax.main", "grpojax.api", "grpojax.plot", "grpojax.default_experiment", "grpojax")),
)


def _layer(module: str) -> int | None:
  """The index in LAYERS of `module`'s most specific name (the package `grpojax` names
  only its own __init__, so that a new module must be given a layer)."""
  best, found = -1, None
  for rank, (_, names) in enumerate(LAYERS):
    for name in names:
      inside = module == name or (name != "grpojax" and module.startswith(name + "."))
      if inside and len(name) > best:
        best, found = len(name), rank
  return found


def _upward(graph: dict[str, set]) -> list[str]:
  return sorted(f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
                for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


@pytest.fixture(scope="module")
def package():
  modules = _modules()
  graph, private = {}, []
  for name, path in modules.items():
    graph[name], taken = _imports(name, path, modules)
    graph[name].discard(name)
    private += taken
  return graph, private


def test_no_module_takes_another_modules_private_names(package):
  assert package[1] == []


def test_no_import_circle(package):
  assert _circles(package[0]) == []


def test_every_module_has_a_layer(package):
  assert [m for m in package[0] if _layer(m) is None] == []


def test_nothing_imports_upward(package):
  assert _upward(package[0]) == []


def _config_reads(path: pathlib.Path, sections: dict[str, set]) -> list[str]:
  """`x.section.key` reads of the config's keys (e.g. cfg.train.steps), and imports of
  ml_collections, in the file at `path`."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
      found += [f"imports {n}" for n in names if n.startswith("ml_collections")]
    elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
          and isinstance(node.value.value, ast.Name)
          and node.attr in sections.get(node.value.attr, ())):
      found.append(f"reads {node.value.value.id}.{node.value.attr}.{node.attr}")
  return found


def test_below_the_wiring_nothing_reads_the_config(package, tmp_path):
  """The config is read into settings in the wiring layer (run/settings.py), which the
  wiring, the assembly, the loop's setup and the planner above it use; every layer
  below takes the typed settings made from them (RolloutConfig, LossConfig, ...)."""
  from grpojax import config as config_lib
  defaults = config_lib.get_config()
  sections = {k: set(v.keys()) for k, v in defaults.items() if hasattr(v, "keys")}
  wiring = next(i for i, (name, _) in enumerate(LAYERS) if name == "wiring")
  modules = _modules()
  reads = {m: _config_reads(modules[m], sections) for m in package[0] if _layer(m) < wiring}
  assert {m: r for m, r in reads.items() if r} == {}
  # The check sees reads: the loop's setup reads the settings, and a made-up module.
  assert "reads s.sft.steps" in _config_reads(modules["grpojax.train.loop"], sections)
  fake = tmp_path / "fake.py"
  fake.write_text("import ml_collections\ndef f(job):\n  return job.train.steps, job.state.step\n")
  assert _config_reads(fake, sections) == ["imports ml_collections", "reads job.train.steps"]


def test_the_walk_sees_circles_and_private_names(tmp_path):
  """The checks can fail: a made-up circle and a made-up module's private imports."""
  assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _upward({"grpojax.models.hf": {"grpojax.train.loop", "grpojax.ops"},
                  "grpojax.train.wiring": {"grpojax.train.rollout"}}) == [
      "grpojax.models.hf (model) imports grpojax.train.loop (loop)"]
  assert _layer("grpojax.new_module") is None and _layer("grpojax") == len(LAYERS) - 1
  fake = tmp_path / "fake.py"
  fake.write_text("from grpojax.plan import _helper\n"
                  "def f():\n"
                  "  from grpojax.train import loop\n"
                  "  return loop._check_resume_config\n")
  edges, private = _imports("grpojax.fake", fake, _modules())
  assert "grpojax.train.loop" in edges
  assert private == ["grpojax.fake imports grpojax.plan._helper",
                     "grpojax.fake reads grpojax.train.loop._check_resume_config"]


def _lazy_faces() -> dict[str, list[str]]:
  """Each package whose __init__ is a lazy face (grpojax.lazy), with its exports."""
  import importlib
  out = {}
  for name, path in _modules().items():
    if path.name == "__init__.py" and "lazy.attach" in path.read_text():
      out[name] = importlib.import_module(name).__all__
  return out


def _exports(package: str) -> dict[str, list[str]]:
  """The face's map {module: [names]}, as attach() holds it."""
  import importlib
  out = {}
  for name, module in importlib.import_module(package).__getattr__.exports.items():
    out.setdefault(module, []).append(name)
  return out


def test_each_lazy_name_is_its_modules_own():
  """Every name a package's face exports resolves, to the object its module defines,
  and so does every submodule listed by dir(); a name that is neither is an error."""
  import importlib
  faces = _lazy_faces()
  assert {"grpojax", "grpojax.core", "grpojax.models", "grpojax.sampling.engine"} <= set(faces)
  for package, names in faces.items():
    face = importlib.import_module(package)
    for name in names:  # the face's object is the one its module defines
      module = next(m for m, listed in _exports(package).items() if name in listed)
      assert getattr(face, name) is getattr(importlib.import_module(f"{package}.{module}"), name)
    for name in dir(face):
      assert getattr(face, name) is not None, (package, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
      getattr(face, "no_such_name")
  from grpojax.core import losses
  import grpojax
  assert grpojax.LossConfig is losses.LossConfig and grpojax.core.losses is losses


def test_the_package_and_the_help_import_no_jax():
  """`import grpojax`, `python -m grpojax.main --help` and `python -m grpojax.plan --help`
  load neither JAX nor Flax (the seconds that costs: bench/run.py startup); a submodule
  still loads on use."""
  import subprocess
  import sys
  heavy = {"jax", "flax", "optax", "grpojax.config"}
  helps = {}
  for command in (["-c", "import grpojax"], ["-m", "grpojax.main", "--help"],
                  ["-m", "grpojax.plan", "--help"]):
    trace = subprocess.run([sys.executable, "-X", "importtime", *command], capture_output=True,
                           text=True, timeout=120, cwd=PACKAGE.parent)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in trace.stderr.splitlines()
              if line.startswith("import time:")}
    assert "grpojax" in loaded and not heavy & loaded, (command, sorted(heavy & loaded))
    helps[command[-2]] = trace.stdout
  assert "--workdir" in helps["grpojax.main"] and "absl.flags" in loaded
  assert "--memory_gb" in helps["grpojax.plan"] and "h100-80gb" in helps["grpojax.plan"]
  # The same trace sees a heavy import where there is one.
  trace = subprocess.run([sys.executable, "-X", "importtime", "-c", "import grpojax.config"],
                         capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
  assert " jax\n" in trace.stderr
