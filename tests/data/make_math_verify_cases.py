"""Builds math_verify_cases.json: Math-Verify's own gold/prediction/verdict tests as data.

    python tests/data/make_math_verify_cases.py [MIRROR] [--out PATH]

MIRROR is a git repository of huggingface/Math-Verify (bare is fine; default
the mirror below). Its tests/*.py at HEAD are imported from a temp dir (they
import each other as `tests.*`), and each parametrized test whose arguments
include gold, pred and a verdict gives one case per argument tuple, with the
settings that the test passes to its comparison helper and `mv`, what the
installed Math-Verify returns when the test's own comparison is evaluated.
"""

import argparse
import ast
import importlib
import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap

DEFAULT_MIRROR = "/work/.mirror/huggingface+Math-Verify/repo"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_verify_cases.json")
REPO_URL = "https://github.com/huggingface/Math-Verify"
VERDICT_NAMES = ("expected", "result")
HELPERS = ("compare_strings", "verify")
SETTINGS = ("match_types", "precision", "strict", "allow_set_relation_comp")
ALIASES = {"float_rounding": "precision"}  # verify's name for compare_strings' precision
_UNKNOWN = object()


def git(mirror, *args):
  return subprocess.run(["git", "-C", mirror, *args], check=True, capture_output=True,
                        text=True).stdout


def export_tests(mirror, dest):
  """Writes HEAD's tests/*.py under dest/tests; returns their file names."""
  os.makedirs(os.path.join(dest, "tests"))
  names = []
  for path in git(mirror, "ls-tree", "-r", "--name-only", "HEAD", "tests").split():
    if not path.endswith(".py") or path.count("/") != 1:
      continue
    with open(os.path.join(dest, path), "w") as f:
      f.write(git(mirror, "show", f"HEAD:{path}"))
    names.append(os.path.basename(path))
  return sorted(names)


def mit_notice(source):
  """The MIT notice at the top of test_all.py, comment markers stripped."""
  lines = []
  for line in source.splitlines():
    if line.strip() and not line.startswith("#"):
      break
    lines.append(line[1:].strip())
  # Paragraphs joined back into lines, as the licence text has them.
  return "\n\n".join(" ".join(p.split("\n")) for p in "\n".join(lines).strip().split("\n\n"))


def verdict_assert(fn, argnames):
  """(left expression, verdict name) of the test's `assert <expr> == <verdict>`."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
  for node in ast.walk(tree):
    if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)
        and isinstance(node.test.comparators[0], ast.Name)
        and node.test.comparators[0].id in argnames):
      return node.test.left, node.test.comparators[0].id
  return None, None


def helper_call(expr):
  for node in ast.walk(expr):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in HELPERS:
      return node
  return None


def settings_of(call, helper, args):
  """The comparison settings of one case: passed literals, the case's own
  parameters, else the helper's defaults; None where not determinable."""
  passed = {}
  for kw in call.keywords:
    key = ALIASES.get(kw.arg, kw.arg)
    if isinstance(kw.value, ast.Name) and kw.value.id in args:
      passed[key] = args[kw.value.id]
    else:
      try:
        passed[key] = ast.literal_eval(kw.value)
      except ValueError:
        passed[key] = _UNKNOWN
  defaults = {ALIASES.get(k, k): p.default for k, p in inspect.signature(helper).parameters.items()
              if p.default is not inspect.Parameter.empty}
  out = {}
  for key in SETTINGS:
    value = passed.get(key, defaults.get(key, _UNKNOWN))
    out[key] = None if value is _UNKNOWN else value
  return out


def as_verdict(value):
  # verify returns a bool; the tests compare it with 0/1, so keep 0/1.
  return int(value) if isinstance(value, (bool, int)) else None


def cases_of(module, file):
  """(cases, tests, skipped) of one imported test module."""
  cases, tests, skipped = [], {}, {}
  functions = sorted(inspect.getmembers(module, inspect.isfunction),
                     key=lambda kv: kv[1].__code__.co_firstlineno)  # source order
  for name, fn in functions:
    if not name.startswith("test_") or fn.__module__ != module.__name__:
      continue
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
    if len(marks) != 1:
      skipped[name] = "not parametrized" if not marks else "several parametrize marks"
      continue
    argnames, argvalues = marks[0].args[:2]
    if isinstance(argnames, str):
      argnames = [a.strip() for a in argnames.split(",") if a.strip()]
    verdicts = [a for a in VERDICT_NAMES if a in argnames]
    if "gold" not in argnames or "pred" not in argnames or not verdicts:
      skipped[name] = f"arguments {','.join(argnames)} are not gold/pred/verdict"
      continue
    left, verdict = verdict_assert(fn, argnames)
    call = helper_call(left) if left is not None else None
    if call is None:
      skipped[name] = "no `assert <comparison> == <verdict>` found"
      continue
    helper = module.__dict__[call.func.id]
    expr = compile(ast.Expression(left), f"{file}:{name}", "eval")
    tests[name] = {"call": ast.unparse(left), "cases": len(argvalues)}
    for i, values in enumerate(argvalues):
      values = getattr(values, "values", values)  # pytest.param(...) holds them in .values
      args = dict(zip(argnames, values))
      try:
        mv = as_verdict(eval(expr, module.__dict__, dict(args)))
      except Exception as e:  # noqa: BLE001: a case Math-Verify fails on is still a case
        print(f"  {file}::{name}[{i}] raised {type(e).__name__}: {e}", file=sys.stderr)
        mv = None
      # The test's own run, as a check that the comparison above is the one it asserts.
      try:
        fn(**args)
        passed = True
      except AssertionError:
        passed = False
      if passed != (mv == args[verdict]):
        raise RuntimeError(f"{file}::{name}[{i}]: the test {'passes' if passed else 'fails'} "
                           f"but its comparison gave {mv!r} against {args[verdict]!r}")
      cases.append({"id": f"{file}::{name}[{i}]", "file": file, "test": name, "index": i,
                    "gold": args["gold"], "pred": args["pred"], "expected": args[verdict],
                    "settings": settings_of(call, helper, args), "mv": mv})
  return cases, tests, skipped


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("mirror", nargs="?", default=DEFAULT_MIRROR)
  ap.add_argument("--out", default=OUT)
  args = ap.parse_args()
  commit = git(args.mirror, "rev-parse", "HEAD").strip()

  cases, files, skipped_files = [], {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    names = export_tests(args.mirror, tmp)
    # Their `from tests.test_all import ...` must find these files, not this
    # project's own tests directory.
    sys.path.insert(0, tmp)
    for mod in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
      del sys.modules[mod]
    with open(os.path.join(tmp, "tests", "test_all.py")) as f:
      notice = mit_notice(f.read())
    for file in names:
      if file == "__init__.py":
        continue
      try:
        module = importlib.import_module(f"tests.{file[:-3]}")
      except Exception as e:  # noqa: BLE001: record it and go on with the other files
        skipped_files[file] = f"import failed: {type(e).__name__}: {e}"
        continue
      got, tests, skipped = cases_of(module, file)
      if got:
        files[file] = {"cases": len(got), "tests": tests, "skipped_tests": skipped}
        cases += got
      else:
        skipped_files[file] = "no gold/pred/verdict parametrized tests: " + "; ".join(
            f"{k}: {v}" for k, v in skipped.items())
    sys.path.remove(tmp)

  header = {
      "source": f"{REPO_URL} tests/*.py",
      "commit": commit,
      "copyright": "Copyright (c) 2024 The HuggingFace Team",
      "license": ("MIT, as stated at the top of the source's tests/test_all.py (notice below); "
                  "the repository's own LICENCE file is Apache-2.0"),
      "license_notice": notice,
      "note": ("Math-Verify's test data, kept with attribution. expected: the test's verdict "
               "as written; mv: what math-verify returned here, the test's own way; settings: "
               "what the test passes to its comparison helper (null: not determinable)."),
      "math_verify_version": importlib.metadata.version("math-verify"),
      "generator": "tests/data/make_math_verify_cases.py",
      "total": len(cases),
      "mv_reproduces": sum(c["mv"] == c["expected"] for c in cases),
      "files": files,
      "skipped_files": skipped_files,
  }
  # One case per line, so that a regenerated file diffs case by case.
  with open(args.out, "w") as f:
    f.write('{"header": ' + json.dumps(header, indent=1, ensure_ascii=False) + ',\n "cases": [\n')
    f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
    f.write("\n]}\n")
  print(f"{len(cases)} cases from {len(files)} files; math-verify {header['math_verify_version']} "
        f"reproduces {header['mv_reproduces']}; wrote {args.out}")
  for file, info in files.items():
    print(f"  {file}: {info['cases']}")
  for file, why in skipped_files.items():
    print(f"  skipped {file}: {why}")


if __name__ == "__main__":
  main()
