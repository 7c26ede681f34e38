"""Test setup: 8 fake CPU devices, so sharding is exercised without accelerators."""

import atexit
import collections
import json
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere in the test session.
# The tests' programs are small and run once or twice: compiling them is most of the
# suite's time. XLA's CPU backend without LLVM's optimisations compiles them about
# a quarter faster, and with its older elemental emitters for fusions instead of the
# MLIR fusion emitters about twice as fast again (the update of the tiny model:
# 11.7 s -> 4.8 s; the same HLO, only its CPU code is generated another way).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest -n 2 runs two sessions at once, and libtpu (loaded only to compile for a TPU
# here) refuses a second process without this.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# One persistent XLA compilation cache for the session, inherited by the tests'
# subprocesses: runs of the same programs (a resumed loop, the CLI, a second
# process of a multi-host pair) load them instead of compiling again.
_xla_cache = tempfile.mkdtemp(prefix="grpojax-tests-xla-cache-")
atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _xla_cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Whole files go to the two processes (`--dist loadfile`) in the order they are handed
# out: xdist's default, files with more tests first, left the few heaviest files
# (the TPU and H100 compiles, multi-host pairs) for the end, where one process
# ran them while the other sat idle. Here the heaviest files go first (longest
# processing time first), by each file's seconds in tests/durations.json; a file
# not in it weighs its test count. `GRPOJAX_WRITE_DURATIONS=1 pytest -n 2 --dist
# loadfile` rewrites the file from the run. Only the order changes, never a verdict.
_DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
_seconds: dict[str, float] = {}


def _file_weights() -> dict[str, float]:
  try:
    with open(_DURATIONS) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's controller: keep our order
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  weights = _file_weights()
  counts = collections.Counter(item.nodeid.split("::")[0] for item in items)
  weight = lambda f: weights.get(f, counts[f])  # noqa: E731
  # sorted() is stable: a file's tests keep their order, and files stay whole.
  items[:] = sorted(items, key=lambda item: -weight(item.nodeid.split("::")[0]))


def pytest_runtest_logreport(report):
  path = report.nodeid.split("::")[0]
  _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
  if os.environ.get("GRPOJAX_WRITE_DURATIONS") != "1" or hasattr(session.config, "workerinput"):
    return  # a worker's reports also reach the controller, which writes the file
  with open(_DURATIONS, "w") as f:
    json.dump({k: round(v, 1) for k, v in sorted(_seconds.items())}, f, indent=0)
    f.write("\n")
