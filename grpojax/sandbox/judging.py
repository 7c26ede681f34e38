"""How a run's tests are judged, decided in the trainer before the sandbox starts.

The tests are trusted (they come from the dataset); the program is not. So
everything that decides a verdict is read here from the tests' source, the
task's setup code and entry point, and the program's *source* (never from
anything the program does when it runs):

- **Evidence.** The tests are compiled with each `assert` statement and each
  call of an `assert*` function (`self.assertEqual`, `np.testing.assert_allclose`)
  counted as it completes; a run whose tests finish with no check counted
  fails ("no test ran"). Tests under `if __name__ == "__main__":` run (the
  tests are the main module), a HumanEval-style `check(candidate)` that
  nothing calls is called on the entry point, pytest-style `test_*`
  functions that nothing calls are called, and unittest cases run when the
  tests do not call `unittest.main()` themselves.
- **Names.** Each global name the tests use resolves, in this order: the
  task's entry point is the program's object, always (even `max` or
  `sorted`); a name the task's setup code defines is setup's; a name used
  as a module (`numpy.allclose`, `np.allclose`, `sp.simplify`) is the real
  module (the program's own `import ... as` says which, else the name, else
  the usual aliases np, pd, plt, nx), imported in the tests' interpreter;
  a builtin is the builtin and a name of `math` (`isclose`, `sqrt`) is
  math's, whatever the program binds; every other name is the program's
  own object (the functions the task asks for). Without a declared entry
  point, tests that use no such other name (`assert max(1, 2) == 2`) take
  the builtin or math names the program defines with `def` or `class` as
  the task's: declare `entry_point` to settle it.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib.util
import json
import math
import symtable
import sys
from collections.abc import Sequence

# Module aliases so common that tests use them without importing (trusting the
# program's import); any other alias follows the program's own import statement.
ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "nx": "networkx"}
_MATH = frozenset(n for n in dir(math) if not n.startswith("_"))
_BUILTINS = frozenset(dir(builtins))
COUNTER = "__checked__"  # the tests' interpreter binds it to its check counter


class TestsError(ValueError):
  """The tests (or the task's setup code or entry point) cannot be judged as given."""


# ----------------------------------------------------------------- walking

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _module_scope(nodes):
  """The nodes that run in the module's own scope: not inside a def, class or lambda."""
  stack = list(nodes)[::-1]
  while stack:
    node = stack.pop()
    yield node
    if isinstance(node, _SCOPES):
      # Decorators, defaults and bases run in the module's scope; the body does not.
      stack.extend(getattr(node, "decorator_list", []))
      if isinstance(node, ast.ClassDef):
        stack.extend(node.bases + [k.value for k in node.keywords])
      elif not isinstance(node, ast.Lambda):
        stack.extend(node.args.defaults + [d for d in node.args.kw_defaults if d is not None])
      continue
    stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _called_name(call: ast.Call) -> str:
  f = call.func
  return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _bound_at_module_level(source: str, name: str) -> set[str]:
  table = symtable.symtable(source, name, "exec")
  return {s.get_name() for s in table.get_symbols()
          if s.is_assigned() or s.is_imported() or s.is_namespace()}


def _global_uses(source: str) -> set[str]:
  """Names the code reads from its module's globals (any scope) that it never binds there."""
  top = symtable.symtable(source, "<tests>", "exec")
  bound = {s.get_name() for s in top.get_symbols()
           if s.is_assigned() or s.is_imported() or s.is_namespace()}
  used = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
  stack = list(top.get_children())
  while stack:
    table = stack.pop()
    used |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
    stack.extend(table.get_children())
  return used - bound


class _CountChecks(ast.NodeTransformer):
  """`assert x` -> `assert x; __checked__()`, `a.assertEqual(...)` -> `__checked__(a.assertEqual(...))`."""

  def visit_Assert(self, node):
    self.generic_visit(node)
    count = ast.Expr(ast.Call(ast.Name(COUNTER, ast.Load()), [], []))
    return [node, ast.copy_location(count, node)]

  def visit_Call(self, node):
    self.generic_visit(node)
    if _called_name(node).startswith("assert"):
      return ast.copy_location(ast.Call(ast.Name(COUNTER, ast.Load()), [node], []), node)
    return node


# ----------------------------------------------------------------- the program

@dataclasses.dataclass(frozen=True)
class ProgramNames:
  """What the program's source binds at module level, read without running it."""

  imports: dict  # name -> ("module", dotted) | ("from", module, attribute)
  defined: frozenset  # names bound by def, class or assignment
  functions: tuple  # top-level def names, in order
  classes: frozenset


def program_names(program: str) -> ProgramNames:
  try:
    tree = ast.parse(program)
  except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
    return ProgramNames({}, frozenset(), (), frozenset())  # it fails to run anyway
  imports, defined, functions, classes = {}, set(), [], set()
  for node in _module_scope(tree.body):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.asname:
          imports[a.asname] = ("module", a.name)
        else:
          top = a.name.split(".")[0]
          imports[top] = ("module", top)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      for a in node.names:
        if a.name != "*":
          imports[a.asname or a.name] = ("from", node.module, a.name)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      defined.add(node.name)
      if isinstance(node, ast.ClassDef):
        classes.add(node.name)
      elif node.name not in functions:
        functions.append(node.name)
    elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
      defined.add(node.id)
  return ProgramNames(imports, frozenset(defined), tuple(functions), frozenset(classes))


# ----------------------------------------------------------------- entry points

_ENTRY_NODES = (ast.Expression, ast.Name, ast.Attribute, ast.Call, ast.Load)


def parse_entry_points(entry_point) -> tuple[tuple[str, ast.Expression], ...]:
  """(root name, expression) of each declared entry point: a name (`add`), or
  LeetCode's form, an attribute path with argument-less calls (`Solution().twoSum`)."""
  if entry_point is None or entry_point == "":
    return ()
  items = [entry_point] if isinstance(entry_point, str) else list(entry_point)
  out = []
  for text in items:
    if not isinstance(text, str):
      raise TestsError(f"entry_point must be a name or names, got {text!r:.80}")
    try:
      expr = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
      raise TestsError(f"entry_point {text!r:.80} is not a name or an attribute path") from None
    node = expr.body
    for sub in ast.walk(expr):
      if not isinstance(sub, _ENTRY_NODES) or (isinstance(sub, ast.Call)
                                               and (sub.args or sub.keywords)):
        raise TestsError(f"entry_point {text!r:.80} must be a name or an attribute path "
                         "like Solution().method")
    while not isinstance(node, ast.Name):
      node = node.func if isinstance(node, ast.Call) else node.value
    out.append((node.id, expr))
  return tuple(out)


# ----------------------------------------------------------------- the plan

@functools.lru_cache(maxsize=256)
def _tests_facts(tests: str, setup: str | None):
  """Everything about the tests that does not depend on the program (cached: a
  group's G programs share their tests)."""
  try:
    tree = ast.parse(tests, "<tests>")
    setup_code = None if setup is None else compile(setup, "<setup>", "exec")
    free = _global_uses(tests)
    setup_names = set() if setup is None else _bound_at_module_level(setup, "<setup>")
  except (SyntaxError, ValueError) as e:
    raise TestsError(f"the tests or the task's setup code do not compile: {e}") from None
  static_checks = sum(isinstance(n, ast.Assert) or (isinstance(n, ast.Call)
                                                    and _called_name(n).startswith("assert"))
                      for n in ast.walk(tree))
  as_module = {n.value.id for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
  called_here = {_called_name(n) for n in _module_scope(tree.body) if isinstance(n, ast.Call)}
  top_defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  check = any(f.name == "check" and f.args.args for f in top_defs) and "check" not in called_here
  test_functions = tuple(
      f.name for f in top_defs
      if f.name.startswith("test") and f.name not in called_here
      and len(f.args.args) + len(f.args.posonlyargs) == len(f.args.defaults)
      and len(f.args.kwonlyargs) == sum(d is not None for d in f.args.kw_defaults))
  unittest = (any(isinstance(n, ast.ClassDef) and any(
      (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")).endswith("TestCase")
      for b in n.bases) for n in tree.body) and "main" not in called_here)
  code = compile(ast.fix_missing_locations(_CountChecks().visit(tree)), "<tests>", "exec")
  return dict(code=code, setup=setup_code, free=frozenset(free - setup_names),
              setup_names=frozenset(setup_names), as_module=frozenset(as_module),
              check=check, test_functions=test_functions, unittest=unittest,
              static_checks=static_checks, empty=not tree.body)


def _module_for(name: str, program: ProgramNames):
  """How a name used as a module resolves: the program's import says which module."""
  how = program.imports.get(name)
  if how is not None:
    return how
  if name in ALIASES:
    return ("module", ALIASES[name])
  if name in sys.stdlib_module_names or _importable(name):
    return ("module", name)
  return None


@functools.lru_cache(maxsize=1024)
def _importable(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def judge_plan(tests: str, *, setup: str | None = None, entry_point=None,
               program: str = "", data: dict | None = None) -> dict:
  """The tests' interpreter's instructions (`_sandbox_wire.run_tests`) for one run.

  data: values bound in the tests' globals by name (APPS's cases).
  Raises TestsError for tests that cannot be judged (empty, not Python).
  """
  facts = _tests_facts(tests, setup)
  entries = parse_entry_points(entry_point)
  prog = program_names(program)
  names, plain = {}, []
  for name in sorted(facts["free"]):
    if name.startswith("__") or name in (data or {}):
      continue  # __name__, __file__, ...: the tests' module's own; the counter; APPS's data
    if name in {e for e, _ in entries}:
      how = ("program",)
    elif name in facts["as_module"] and (module := _module_for(name, prog)) is not None:
      how = module
    elif name in _BUILTINS:
      how = ("builtin",)
    elif name in _MATH:
      how = ("from", "math", name)
    else:
      how = ("program",)
      plain.append(name)
    names[name] = how
  why_none = ("the tests are empty" if facts["empty"] else
              "the tests contain no assert statement or assert* call"
              if facts["static_checks"] == 0 else
              "their checks are in code that never ran, such as a function nothing calls")
  candidate = None
  if facts["check"]:
    if entries:
      candidate = entries[0][1]
    else:
      own = [f for f in prog.functions if f not in facts["setup_names"]] or list(prog.functions)
      if len(own) == 1:
        candidate = ast.Expression(ast.Name(own[0], ast.Load()))
        entries = ((own[0], candidate),)
      else:
        why_none = ("the tests define check(candidate) but nothing calls it, and the task "
                    "names no entry point (entry_point=) while the program defines "
                    f"{len(own)} functions")
  elif not entries and not plain:
    # Nothing only the program could provide: the task is about a name that is also
    # a builtin or math's (def max(a, b) tested as max(1, 2)).
    for name, how in names.items():
      if how[0] in ("builtin", "from") and name in prog.defined - prog.imports.keys():
        names[name] = ("program",)
  for name, _ in entries:
    names[name] = ("program",)
  return dict(code=facts["code"], setup=facts["setup"], names=names, data=data or {},
              check=None if candidate is None else compile(
                  ast.fix_missing_locations(candidate), "<entry_point>", "eval"),
              test_functions=facts["test_functions"], unittest=facts["unittest"],
              why_none=why_none)


# ----------------------------------------------------------------- APPS

def apps_cases(spec) -> tuple[str | None, dict | None, list[dict] | None]:
  """APPS/TACO's `input_output` (a dict or its JSON text): call-based cases
  `{"fn_name", "inputs", "outputs"}` become (fn_name, data, None); stdin/stdout
  cases `{"inputs", "outputs"}` become (None, None, io cases); anything else None."""
  if isinstance(spec, str):
    text = spec.strip()
    if not text.startswith("{"):
      return None, None, None
    try:
      spec = json.loads(text)
    except ValueError:
      return None, None, None
  if not (isinstance(spec, dict) and {"inputs", "outputs"} <= spec.keys()):
    return None, None, None
  inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
  if len(inputs) != len(outputs):
    raise TestsError(f"{len(inputs)} inputs but {len(outputs)} outputs")
  if spec.get("fn_name"):
    return str(spec["fn_name"]), {"inputs": inputs, "outputs": outputs}, None

  def text_of(x):
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)
  return None, None, [{"input": text_of(i), "output": text_of(o)} for i, o in zip(inputs, outputs)]


# APPS's comparison: a tuple result compares as a list, and an expected value
# wrapped in a one-element list matches its element.
APPS_TESTS = """
for __i, (__args, __want) in enumerate(zip(__apps_inputs__, __apps_outputs__)):
    __got = __apps_entry__(*__args)
    if isinstance(__got, tuple):
        __got = list(__got)
    assert __got == __want or (isinstance(__want, list) and len(__want) == 1
                               and __got == __want[0]), f"case {__i}: got {__got!r:.200}"
"""


def apps_entry(fn_name: str, program: str, entry_point=None) -> str:
  """The call-based case's entry: the declared one, else `fn_name` where the program
  defines it, else `Solution().fn_name` (LeetCode-style APPS/TACO problems)."""
  if entry_point:
    return entry_point if isinstance(entry_point, str) else entry_point[0]
  prog = program_names(program)
  if fn_name not in prog.defined and "Solution" in prog.classes:
    return f"Solution().{fn_name}"
  return fn_name


def reference_entry_points(reference: str, tests) -> tuple[str, ...]:
  """The functions and classes a reference solution defines that the tests use: the
  task's entry points, for datasets that name none (MBPP gives its solution as `code`)."""
  source = tests if isinstance(tests, str) else "\n".join(t for t in tests if isinstance(t, str))
  try:
    used = _tests_facts(source, None)["free"]
  except TestsError:
    return ()
  ref = program_names(reference)
  return tuple(sorted((ref.defined - ref.imports.keys()) & used))


def normalise_entry(entry_point) -> tuple | str | None:
  """A hashable form of entry_point for caching."""
  if entry_point is None or isinstance(entry_point, str):
    return entry_point
  if isinstance(entry_point, Sequence):
    return tuple(entry_point)
  raise TestsError(f"entry_point must be a name or names, got {entry_point!r:.80}")
