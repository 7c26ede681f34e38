"""Compile for an accelerator this machine does not have.

XLA's TPU and NVIDIA compilers run on any x86 host. Their topologies give
compile-only devices for a `Mesh`, so `jax.jit(f).lower(abstract
args).compile()` produces the target's own program: its `memory_analysis()`
is the target's, not XLA:CPU's proxy, and its optimized HLO lists the kernels
it launches. Nothing runs: only compiles.

Both install with one command, `python -m grpojax.plan --install-compilers`,
beside the venv rather than in it (`compilers_dir()`), where they are found
with no variable to set.

- TPU (`tpu-v5e`, `tpu-v6e`): libtpu, found as JAX finds it:
  `$TPU_LIBRARY_PATH`, else the `libtpu` package (`pip install "jax[tpu]"`),
  else `compilers_dir()`'s. `cost_analysis()` gives FLOPs, bytes accessed and
  `optimal_seconds`, the compiler's runtime estimate.
- NVIDIA (`h100-80gb`, `h200-141gb`, `a100-40gb`, `a100-80gb`): the CUDA PJRT
  plugin alone, none of NVIDIA's libraries and no driver. The device is
  described by a target config (`gpu_target_config`), so the compiler emits
  that GPU's PTX (sm_90a for the H100) without one. `$GRPOJAX_CUDA_PLUGIN`
  names its `xla_cuda_plugin.so`, else `compilers_dir()`'s is used, else an
  installed `jax[cuda12]`'s. `cost_analysis()` is None here; kernel
  configurations are the untuned defaults (autotuning needs the device), and
  ptxas, which turns PTX into machine code, runs only where the host has a
  CUDA toolkit on its PATH or in /usr/local/cuda (then the executable holds an
  sm_90a cubin; without one the program stops at PTX).

Without the compiler, `available()` is False and `devices()` raises
TargetUnavailable with the install line.

    devs = targets.devices("tpu-v5e", chips=4)          # a v5e 2x2 slice
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    compiled = jax.jit(f).lower(*abstract_args).compile()
    targets.kernels(compiled)                           # fusions + custom calls
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import importlib.util
import os
import re
import sys

import jaxlib  # (its version only: JAX itself loads where a program is built)
import numpy as np

# Planner device names -> libtpu topology prefix and the accelerator type that
# keeps libtpu's start-up quiet on a host that is no TPU VM.
TPUS = {"tpu-v5e": ("v5e", "v5litepod"), "tpu-v6e": ("v6e", "v6e")}
# Chips of a single-host slice -> its grid.
_GRIDS = {1: (1, 1), 4: (2, 2), 8: (2, 4)}
INSTALL_COMMAND = "python -m grpojax.plan --install-compilers"
# Sizes as installed (jax 0.10.2): libtpu 684 MB, the CUDA plugin 458 MB.
INSTALL = (f"{INSTALL_COMMAND} (libtpu and the CUDA plugin, 1.1 GB beside the venv; or "
           'pip install "jax[tpu]")')
CUDA_INSTALL = (f"{INSTALL_COMMAND} (the CUDA plugin and libtpu, 1.1 GB beside the venv; "
                'or pip install "jax[cuda12]")')
# What --install-compilers puts where: (folder under compilers_dir(), the library in it).
_TPU_LIBRARY = ("tpu", os.path.join("libtpu", "libtpu.so"))
_CUDA_LIBRARY = ("cuda", os.path.join("jax_plugins", "xla_cuda12", "xla_cuda_plugin.so"))


def compilers_dir() -> str:
  """Where `--install-compilers` puts the device compilers: $GRPOJAX_COMPILERS,
  else ~/.cache/grpojax/compilers/jaxlib-<version> (a jaxlib needs its own
  version of each). Not the venv: a libtpu that JAX finds there makes every
  program of the venv probe for a TPU at start-up."""
  return os.environ.get("GRPOJAX_COMPILERS") or os.path.join(
      os.path.expanduser("~"), ".cache", "grpojax", "compilers", f"jaxlib-{jaxlib.__version__}")


def _installed(library: tuple[str, str]) -> str | None:
  path = os.path.join(compilers_dir(), *library)
  return path if os.path.isfile(path) else None


def compiler_packages() -> dict[str, str]:
  """{"tpu": libtpu's pip requirement (the version jax[tpu] pins), "cuda": the
  CUDA plugin's (jaxlib's own version)}."""
  from importlib import metadata

  libtpu = next((r.split(";")[0].strip() for r in metadata.requires("jax") or ()
                 if r.startswith("libtpu")), "libtpu")
  return {"tpu": libtpu, "cuda": f"jax-cuda12-pjrt=={jaxlib.__version__}"}


def install_compilers(say=print) -> dict[str, str | None]:
  """pip-installs each device compiler (compiler_packages) into its folder of
  compilers_dir(), with no dependencies: nothing of the venv changes. Returns
  {"tpu" | "cuda": the installed library, or None where pip failed (`say` was
  told pip's last line)}. An installed one is kept."""
  import subprocess

  found = {}
  for (kind, library), requirement in zip((_TPU_LIBRARY, _CUDA_LIBRARY),
                                          compiler_packages().values()):
    folder = os.path.join(compilers_dir(), kind)
    if _installed((kind, library)):
      say(f"{kind}: {requirement} already in {folder}")
      found[kind] = _installed((kind, library))
      continue
    say(f"{kind}: installing {requirement} into {folder} (pip, a few minutes)")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", folder, requirement], capture_output=True, text=True)
    found[kind] = _installed((kind, library)) if done.returncode == 0 else None
    if found[kind] is None:
      last = (done.stderr.strip().splitlines() or ["no library installed"])[-1]
      say(f"{kind}: not installed: {last}")
  return found


@dataclasses.dataclass(frozen=True)
class GPU:
  """What XLA's GPU compiler needs to know of a device it cannot query: the
  vendor's published figures (the numbers in XLA's own target specs)."""

  name: str  # the device string the driver reports
  sm: tuple[int, int]  # compute capability
  accelerated: bool  # sm_90a: Hopper's wgmma/TMA instructions
  cores: int  # streaming multiprocessors
  fpus_per_core: int
  clock_ghz: float
  memory_bytes: int
  bandwidth: int  # HBM bytes per second
  l2_bytes: int
  shared_per_core: int
  shared_optin: int  # shared memory a block may opt in to


GPUS = {
    "h100-80gb": GPU("NVIDIA H100 80GB HBM3", (9, 0), True, 132, 128, 1.98, 84942979072,
                     3352320000000, 52428800, 233472, 232448),
    "h200-141gb": GPU("NVIDIA H200 141GB HBM3e", (9, 0), True, 132, 128, 1.98, 151397597184,
                      4800000000000, 52428800, 233472, 232448),
    "a100-80gb": GPU("NVIDIA A100-SXM4-80GB", (8, 0), False, 108, 64, 1.41, 85100068864,
                     2039040000000, 41943040, 167936, 166912),
    "a100-40gb": GPU("NVIDIA A100-SXM4-40GB", (8, 0), False, 108, 64, 1.41, 42331013120,
                     1555200000000, 41943040, 167936, 166912),
}


GiB = 2**30
# Planner device names -> memory per device (None: this machine's RAM), the budgets
# `python -m grpojax.plan --device NAME` fits a run to: the GPUs' HBM as their drivers
# report it (an "80GB" H100 holds 79.1 GiB).
DEVICES = {
    "tpu-v5e": 16 * GiB,
    "tpu-v6e": 32 * GiB,
    **{name: gpu.memory_bytes for name, gpu in GPUS.items()},
    "cpu": None,
}


def gpu_target_config(target: str) -> str:
  """The stream_executor.GpuTargetConfigProto (text) that stands in for the device."""
  g = GPUS[target]
  extension = "ACCELERATED_FEATURES" if g.accelerated else "NONE"
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g.shared_per_core}
  threads_per_core_limit: 2048
  core_count: {g.cores}
  fpus_per_core: {g.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {g.bandwidth}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {g.memory_bytes}
  shared_memory_per_block_optin: {g.shared_optin}
  cuda_compute_capability {{
    major: {g.sm[0]}
    minor: {g.sm[1]}
    feature_extension: {extension}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{g.name}"
"""


class TargetUnavailable(RuntimeError):
  """This machine cannot compile for the named target (its compiler is missing)."""


def _own_cuda_plugin() -> str | None:
  """The CUDA PJRT plugin loaded beside JAX's backends: $GRPOJAX_CUDA_PLUGIN's,
  else the one --install-compilers put in compilers_dir()."""
  path = os.environ.get("GRPOJAX_CUDA_PLUGIN")
  if path:
    return path if os.path.isfile(path) else None
  return _installed(_CUDA_LIBRARY)


def _cuda_plugin() -> str | None:
  """The CUDA PJRT plugin's library: our own (above), else jax[cuda12]'s."""
  if os.environ.get("GRPOJAX_CUDA_PLUGIN") or _own_cuda_plugin():
    return _own_cuda_plugin()
  try:
    spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
  except ImportError:
    spec = None
  for folder in (spec and spec.submodule_search_locations) or ():
    path = os.path.join(folder, "xla_cuda_plugin.so")
    if os.path.isfile(path):
      return path
  return None


def available(target: str = "tpu-v5e") -> bool:
  """Can this machine compile for `target`?"""
  if target in GPUS:
    return _cuda_plugin() is not None
  if target not in TPUS:
    return False
  return _libtpu() is not None


def _libtpu() -> str | None:
  """libtpu, as JAX looks for it ($TPU_LIBRARY_PATH, then the package), then in
  compilers_dir()."""
  path = os.environ.get("TPU_LIBRARY_PATH")
  if path and os.path.isfile(path):
    return path
  if importlib.util.find_spec("libtpu") is not None:
    return "libtpu"
  return _installed(_TPU_LIBRARY)


def known() -> list[str]:
  """Every target name `devices` accepts."""
  return [*TPUS, *GPUS]


def compile_only(mesh) -> bool:
  """Are `mesh`'s devices a target's compile-only ones (`devices`), not this host's?"""
  return type(mesh.devices.flat[0].client).__name__ == "CompileOnlyPyClient"


@contextlib.contextmanager
def compiling(mesh):
  """Where a program for `mesh` lowers and compiles. For a target's compile-only
  devices: the compilers' start-up noise kept off stderr (quiet_stderr) and, for
  a GPU, its first device as jax's default: jax 0.11's Pallas Triton lowering
  reads the GPU it targets from the default device, as it lowers and as a
  partitioned call's shards lower inside the compile. Nothing, for this host's
  own devices."""
  if not compile_only(mesh):
    yield
    return
  import jax  # pylint: disable=import-outside-toplevel

  device = mesh.devices.flat[0]
  gpu = device.platform in ("gpu", "cuda")
  with jax.default_device(device) if gpu else contextlib.nullcontext(), quiet_stderr():
    yield


@contextlib.contextmanager
def quiet_stderr():
  """The compilers log from C++ straight to file descriptor 2: as a plugin loads
  (no driver here, absl's pre-init notice) and as a GPU compile works (a
  rematerialization that cannot reach the device's memory). For a host that
  never runs the program that is noise: its conclusions are in the numbers."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 2)
      yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


@contextlib.contextmanager
def _library_path(libtpu: str):
  """$TPU_LIBRARY_PATH naming compilers_dir()'s libtpu while JAX loads it, and
  only then: the programs this process starts later must not see a TPU library."""
  before = os.environ.get("TPU_LIBRARY_PATH")
  if libtpu in ("libtpu", before):  # JAX finds it by itself
    yield
    return
  os.environ["TPU_LIBRARY_PATH"] = libtpu
  try:
    yield
  finally:
    if before is None:
      os.environ.pop("TPU_LIBRARY_PATH", None)
    else:
      os.environ["TPU_LIBRARY_PATH"] = before


def _quiet_libtpu(accelerator: str, chips: int) -> None:
  """libtpu's start-up asks the host for its TPU type and workers; a host that is
  no TPU VM gets warnings and a metadata-server query. Say them up front."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{accelerator}-{chips}")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


@functools.cache
def _own_cuda_api():
  """$GRPOJAX_CUDA_PLUGIN's plugin, loaded once, beside (not as) a JAX backend."""
  from jax._src import xla_bridge
  from jax._src.lib import xla_client

  api = xla_client.load_pjrt_plugin_dynamically("cuda", _own_cuda_plugin())
  # What jax does for a plugin it loads itself: register its custom-call
  # partitioners with it, or a sharded program with a Pallas kernel (a
  # custom_partitioning call) cannot compile for several GPUs.
  for register in getattr(xla_bridge, "_plugin_callbacks", ()):
    register(c_api=api)
  return api


def _gpu_devices(target: str, count: int) -> list:
  from jax._src.lib import xla_client
  from jax.experimental import topologies

  kwargs = dict(topology=f"1x1x{count}", target_config=gpu_target_config(target))
  with quiet_stderr():
    if _own_cuda_plugin() and (
        _own_cuda_api.cache_info().currsize or not xla_client.pjrt_plugin_loaded("cuda")):
      topology = xla_client.make_c_api_device_topology(_own_cuda_api(), "", **kwargs)
      return list(topology._make_compile_only_devices())  # noqa: SLF001 -- as get_topology_desc
    return list(topologies.get_topology_desc(platform="cuda", **kwargs).devices)


def devices(target: str, chips: int = 1) -> list:
  """Compile-only devices of one host of `target`, for a `jax.sharding.Mesh`:
  programs sharded over it compile for them. TPUs: a slice of `chips` chips (1,
  4, 8); GPUs: 1 to 8 of them."""
  if target in GPUS:
    if not 1 <= chips <= 8:
      raise ValueError(f"chips={chips}: one host holds 1 to 8 GPUs")
    if not available(target):
      raise TargetUnavailable(f"compiling for {target} needs the CUDA plugin: {CUDA_INSTALL}")
    return _gpu_devices(target, chips)
  if target not in TPUS:
    raise ValueError(f"target {target!r} is unknown; known: {', '.join(known())}")
  if chips not in _GRIDS:
    raise ValueError(f"chips={chips}: a single-host slice has {sorted(_GRIDS)} chips")
  if not available(target):
    raise TargetUnavailable(f"compiling for {target} needs libtpu: {INSTALL}")
  from jax.experimental import topologies

  prefix, accelerator = TPUS[target]
  x, y = _GRIDS[chips]
  _quiet_libtpu(accelerator, chips)
  with quiet_stderr(), _library_path(_libtpu()):
    topology = topologies.get_topology_desc(f"{prefix}:{x}x{y}", platform="tpu",
                                            chips_per_host_bounds=(x, y, 1))
  return list(topology.devices)


def kernels(compiled) -> int:
  """Kernels the compiled program launches: fusions plus custom calls (gemm
  libraries, Mosaic or Triton kernels) in its optimized HLO, outside the fused
  computations (which are those kernels' bodies). A loop body counts once."""
  count, fused = 0, False
  for line in compiled.as_text().splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      fused = "fused" in line.split("(")[0]  # a computation's header
    elif not fused and re.search(r"\s(?:fusion|custom-call)\(", line):
      count += 1
  return count


def mosaic_kernels(compiled) -> int:
  """Pallas TPU (Mosaic) kernels in a program compiled for a TPU."""
  return len(re.findall(r'custom_call_target="tpu_custom_call"', compiled.as_text()))


def compile_pallas_tpu(fn, *args, target: str = "tpu-v5e"):
  """Compiles `fn` (a function calling Pallas TPU kernels) for `target` on
  abstract `args` (jax.ShapeDtypeStruct; any sharding is replaced by one device
  of the target): proof that its kernels lower through Mosaic at these shapes,
  without a TPU. Returns the compiled program; raises if no Mosaic kernel is in it."""
  import jax  # pylint: disable=import-outside-toplevel

  device = devices(target, chips=1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  compiled = jax.jit(fn).lower(*abstract).compile()
  if not mosaic_kernels(compiled):
    raise ValueError(f"{getattr(fn, '__name__', fn)!r} compiled for {target} with no "
                     "Pallas (Mosaic) kernel: it does not call one at these shapes")
  return compiled


# ----------------------------------------------------------- reading a program

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (\S+|\(.*?\)) ([\w\-]+)\((.*?)\)(.*)$")
_SHAPE = re.compile(r"^\w+\[([\d,]*)\]")


HEAVIEST = 10  # kernels Program.heaviest lists
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _nbytes(shape: str) -> int:
  """Bytes of an HLO shape, a tuple's summed (8-bit float types: 1)."""
  return sum(_ITEMSIZE.get(t, 1) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))


def _dims(shape: str) -> list[int]:
  m = _SHAPE.match(shape)
  return [int(d) for d in m[1].split(",") if d] if m else []


@dataclasses.dataclass
class Program:
  """A compiled program as its target runs it, read from the optimized HLO.

  kernels: launches of one call: fusions and custom calls (gemm libraries,
    Mosaic or Triton kernels), each loop body's times its trip count.
  kernel_bytes: what those launches read and write, per call: each kernel's
    operands and result, where a kernel slices an operand the slice only, and
    where it updates a buffer in place the update only (a KV-cache write).
    Like XLA's own count, it ignores caches: an upper bound on HBM traffic.
  heaviest: the kernels that move the most bytes per call, (name, bytes),
    a loop body's times its trips; the first place to look for a cut.
  matmul_flops: 2·M·N·K of every dot (a TPU's dots appear as convolutions),
    loop bodies times their trip counts: unlike `cost_analysis()`, which counts
    a loop body once and is None on a GPU compiled without one.
  loops: (trip count, kernels per trip) of each top-level loop, outermost
    first; a trip count XLA did not state is read from the loop's bound.
  """

  kernels: int
  matmul_flops: float
  loops: list[tuple[int, int]]
  kernel_bytes: float = 0.0
  heaviest: list[tuple[str, float]] = dataclasses.field(default_factory=list)


def computations(text: str) -> tuple[dict, str]:
  """The computations of an optimized HLO text: ({name: [(instruction, shape, op,
  operands, attributes)]}, the entry computation's name)."""
  comps, entry, name = {}, "", None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      name = m[1]
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name and line.startswith("}"):
      name = None
    elif name:
      inst = _INSTRUCTION.match(line)
      if inst:
        comps[name].append(inst.groups())
  return comps, entry


def _trips(attrs: str, cond: list) -> int:
  """A loop's trip count: XLA's where it states one, else the bound its
  condition compares the counter with (`i < bound`, in the condition or a fusion
  it calls): for a loop that can exit early, or whose counter does not start at
  0, an upper bound. 1 where neither is found."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  if m:
    return int(m[1])
  consts = {n: rest for n, _, op, rest, _ in cond if op == "constant"}
  for _, _, op, operands, tail in cond:
    if op == "compare" and "direction=LT" in tail:
      bound = operands.split(", ")[-1].lstrip("%")
      if bound in consts and consts[bound].isdigit():
        return int(consts[bound])
  return 1


def _taps(window: str, lhs: list, out: list, lhs_labels: str, out_labels: str) -> int:
  """Of a convolution's window taps per output element, summed over its spatial
  positions, those that land on real input: a TPU writes batched and padded
  matmuls as convolutions whose dilation holes and padding hold zeros."""
  fields = dict(f.split("=", 1) for f in window.split())
  sizes = [int(x) for x in fields["size"].split("x")]
  per_dim = lambda key, default: ([int(x) for x in fields[key].split("x")]  # noqa: E731
                                  if key in fields else [default] * len(sizes))
  stride, lhs_dilate, rhs_dilate = (per_dim(k, 1) for k in ("stride", "lhs_dilate", "rhs_dilate"))
  pads = ([int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields
          else [0] * len(sizes))
  total = 1
  for d, k in enumerate(sizes):
    n_in, n_out = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
    if n_out * k > 10**7:  # too many to enumerate: every tap
      total *= n_out * k
      continue
    pos = (np.arange(n_out)[:, None] * stride[d] + np.arange(k)[None, :] * rhs_dilate[d]
           - pads[d])
    real = (pos >= 0) & (pos <= (n_in - 1) * lhs_dilate[d]) & (pos % lhs_dilate[d] == 0)
    total *= int(real.sum())
  return total


def _reachable(comps: dict, name: str) -> list[str]:
  """`name` and every computation it calls, transitively."""
  seen, todo = [], [name]
  while todo:
    c = todo.pop()
    if c in comps and c not in seen:
      seen.append(c)
      for *_, tail in comps[c]:
        todo += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", tail)
  return seen


def read_program(compiled) -> Program:
  """What `compiled` (for any target) launches and multiplies per call: see Program."""
  comps, entry = computations(compiled.as_text())
  shapes = {n: s for body in comps.values() for n, s, *_ in body}

  def dot_flops(shape, op, operands, tail) -> float:
    names = [o.strip().lstrip("%") for o in operands.split(",")]
    out = math.prod(_dims(shape))
    if op == "dot":
      lhs = _dims(shapes.get(names[0], ""))
      m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", tail)
      k = math.prod(lhs[int(d)] for d in m[1].split(",") if d) if m and lhs else 0
      return 2.0 * out * k
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", tail)  # convolution
    lhs = _dims(shapes.get(names[0], ""))
    rhs = _dims(shapes.get(names[1], "")) if len(names) > 1 else []
    if not labels or not rhs or not lhs:
      return 0.0
    out_dims, out_labels = _dims(shape), labels[3]
    not_spatial = math.prod(n for n, c in zip(out_dims, out_labels) if c in "bf")
    window = re.search(r"window=\{([^}]*)\}", tail)
    taps = _taps(window[1], lhs, out_dims, labels[1], out_labels) if window else 1
    return 2.0 * not_spatial * rhs[labels[2].index("i")] * taps

  def kernel_bytes(shape, operands, called, tail="") -> int:
    names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
    body = comps.get(called[0], []) if called else []
    params = {int(rest): n for n, _, op, rest, _ in body if op == "parameter" and rest.isdigit()}
    root = body[-1] if body else None
    total = _nbytes(shape)
    # Outputs aliased to operands (a kernel writing a buffer in place: the engine's
    # pool) are the operand's bytes, charged once, as an operand.
    aliased = re.search(r"output_to_operand_aliasing=\{(.*?)\}, \w+=", tail)
    if aliased:
      elements = re.findall(r"\w+\[[\d,]*\]", shape)
      total -= sum(_nbytes(elements[int(i)]) for i in re.findall(r"\{(\d+)\}:", aliased[1])
                   if int(i) < len(elements))
    if root is not None and root[2] == "dynamic-update-slice":  # in place: the update only
      update = root[3].split(", ")[1].lstrip("%")
      total = _nbytes(shapes.get(update, ""))
    for i, n in enumerate(names):
      inner = params.get(i)
      users = [u for u in body if inner and inner in
               [o.strip().lstrip("%") for o in u[3].split(",")]]
      if users and all(u[2] in ("dynamic-slice", "slice", "gather") for u in users):
        total += sum(_nbytes(u[1]) for u in users)  # a slice of it
      elif not (root is not None and root[2] == "dynamic-update-slice" and users
                and all(u is root and u[3].split(", ")[0].lstrip("%") == inner for u in users)):
        total += _nbytes(shapes.get(n, ""))
    return total

  per_kernel: dict[str, float] = {}

  @functools.cache
  def walk(name: str, inside_kernel: bool, times: int = 1) -> tuple[int, float, list, float]:
    kernels, flops, loops, moved = 0, 0.0, [], 0.0
    for inst, shape, op, operands, tail in comps.get(name, ()):
      called = re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)",
                          tail)
      if op in ("dot", "convolution"):
        flops += dot_flops(shape, op, operands, tail)
      if op in ("fusion", "custom-call") and not inside_kernel:
        kernels += 1
        launch = kernel_bytes(shape, operands, called, tail)
        moved += launch
        per_kernel[inst] = times * launch
      if op == "while":
        body = re.search(r"body=%?([\w.\-]+)", tail)[1]
        cond = re.search(r"condition=%?([\w.\-]+)", tail)[1]
        n = _trips(tail, [i for c in _reachable(comps, cond) for i in comps[c]])
        k, f, _, b = walk(body, inside_kernel, times * n)
        kc, _, _, bc = walk(cond, inside_kernel, times * (n + 1))
        kernels += n * k + (n + 1) * kc
        flops += n * f
        moved += n * b + (n + 1) * bc
        loops.append((n, k))
        continue
      for sub in called:
        k, f, _, b = walk(sub, inside_kernel or op in ("fusion", "custom-call"), times)
        kernels += k
        flops += f
        moved += b
    return kernels, flops, loops, moved

  kernels, flops, loops, moved = walk(entry, False)
  heaviest = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:HEAVIEST]
  return Program(kernels=kernels, matmul_flops=flops, loops=loops, kernel_bytes=moved,
                 heaviest=heaviest)
