"""Test setup: 8 fake CPU devices, so sharding is exercised without accelerators."""

import atexit
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
