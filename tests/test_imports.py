"""The package's imports, read from its source (ast): no module imports another's
private (`_`) names, and no import circle, counting imports inside functions too
(a deferred import hides a circle, it does not remove it)."""

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


def test_the_walk_sees_circles_and_private_names(tmp_path):
  """The checks can fail: a made-up circle and a made-up module's private imports."""
  assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  fake = tmp_path / "fake.py"
  fake.write_text("from grpojax.plan import _helper\n"
                  "def f():\n"
                  "  from grpojax.train import loop\n"
                  "  return loop._check_resume_config\n")
  edges, private = _imports("grpojax.fake", fake, _modules())
  assert "grpojax.train.loop" in edges
  assert private == ["grpojax.fake imports grpojax.plan._helper",
                     "grpojax.fake reads grpojax.train.loop._check_resume_config"]
