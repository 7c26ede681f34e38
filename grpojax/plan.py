"""`python -m grpojax.plan --config X [--device h100-80gb] [--devices N] [--json]`: will it fit?
`python -m grpojax.plan --install-compilers`: the devices' compilers, beside the venv.

Lowers and compiles the run's own programs (rollout, update, eval generate, SFT
step) ahead of time on abstract inputs (shapes and shardings, no weights, no
device memory), and reports per program the bytes per device XLA's
memory_analysis gives, matmul FLOPs per call (`targets.read_program`: a loop's
body times its trips) and compile seconds, against a device's memory.

For `--device tpu-v5e|tpu-v6e|h100-80gb|...` with that device's compiler
installed (libtpu, or the CUDA plugin: `grpojax.targets`), the programs compile
for the device itself, on this machine: the bytes per device and compile
seconds are its compiler's (`--devices N`: a TPU slice of 1, 4 or 8 chips, or
N GPUs of one host). Otherwise, off the accelerator, they compile for XLA:CPU
on a mesh of fake CPU devices (`--devices N`): the byte counts are XLA:CPU's
for the same programs, a proxy whose measured error (PROXY_ERROR) the output
quotes in one line. Each compile is announced on stderr as it starts.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time

# `--devices N` means N fake CPU devices (or N of a target's): the flag must be set
# before JAX creates its CPU client (jax itself is already imported by the
# `grpojax` package). A plan for a named device compiles for it from here and
# starts no other backend (whose probes, e.g. for a TPU, are noise on this host).
if __name__ == "__main__":
  for i, arg in enumerate(sys.argv):
    value = lambda: arg.split("=", 1)[1] if "=" in arg else sys.argv[i + 1]  # noqa: E731
    if arg.startswith("--devices") and int(value()) > 0:
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                 + f" --xla_force_host_platform_device_count={int(value())}")
      os.environ["JAX_PLATFORMS"] = "cpu"
    elif arg.startswith("--device") and not arg.startswith("--devices") and value():
      os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from grpojax import config as config_lib  # noqa: E402
from grpojax import targets  # noqa: E402
from grpojax.core import advantages as advantages_lib  # noqa: E402
from grpojax.models import lora as lora_lib  # noqa: E402
from grpojax.train import wiring  # noqa: E402

GiB = 2**30
# Memory per device (HBM) of the accelerators a plan can be checked against: the
# GPUs' as their drivers report it (an "80GB" H100 holds 79.1 GiB).
DEVICES = {
    "tpu-v5e": 16 * GiB,
    "tpu-v6e": 32 * GiB,
    **{name: gpu.memory_bytes for name, gpu in targets.GPUS.items()},
    "cpu": None,  # this machine's RAM
}

# How far XLA:CPU's GiB per device have been from the devices' own compilers, program
# by program, (proxy - device) / device: the range of docs/devices.md's table, which
# `python bench/run.py plan_proxy --write` rewrites with this line.
PROXY_ERROR = (0.11, 0.87)
_NO_TARGET_NOTE = ("{name}'s compiler is not installed, so these are XLA:CPU's byte counts, "
                   "a proxy measured {low:+.0%} to {high:+.0%} off the devices' own compilers "
                   "per program (docs/devices.md); for the device's own: {install}")


def device_memory(name: str = "") -> tuple[str, int | None]:
  """(device name, bytes per device): a DEVICES preset, or the detected device's."""
  if name:
    if name not in DEVICES:
      raise ValueError(f"--device={name!r} is unknown; known: {', '.join(DEVICES)}")
    size = DEVICES[name]
    if size is None:
      size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return name, size
  dev = jax.devices()[0]
  stats = None
  try:
    stats = dev.memory_stats()
  except Exception:  # noqa: BLE001 -- backends without memory stats
    pass
  if stats and stats.get("bytes_limit"):
    return dev.device_kind, int(stats["bytes_limit"])
  if dev.platform == "cpu":
    return "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return dev.device_kind, None


def bytes_per_device(tree) -> int:
  """Bytes per device of a tree of (abstract or real) sharded arrays: one shard each."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _abstract_opt_state(tx, params: dict, mesh):
  """tx.init(params) as ShapeDtypeStructs: per-parameter leaves (Adam's moments, the
  accumulated gradients) take their parameter's sharding, scalars are replicated,
  as create_train_state places them."""
  shapes = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, PartitionSpec())

  def place(path, leaf):
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in params]
    p = params[names[-1]] if names else None
    sharding = p.sharding if p is not None and p.shape == leaf.shape else replicated
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(place, shapes)


def abstract_state(cfg, model_cfg, mesh):
  """The TrainState the run creates, as ShapeDtypeStructs with its shardings (with LoRA:
  float32 adapters and their optimizer state, the base frozen in model.dtype or quantised)."""
  from grpojax import models
  from grpojax.train.state import TrainState, lora_critic_specs

  shardings = models.param_shardings(model_cfg, mesh)
  specs = models.param_specs(model_cfg)
  params = {n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=shardings[n])
            for n, (shape, _) in specs.items()}
  ref = frozen = None
  lora = config_lib.lora_config(cfg)
  if lora.enabled:
    frozen = {n: lora_lib.abstract_frozen(n, p, lora, model_cfg.dtype)
              for n, p in params.items()}
    adapter_shardings = models.sharding.named_shardings(
        lora_lib.adapter_specs(model_cfg, lora), mesh)
    params = {n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=adapter_shardings[n])
              for n, (shape, _) in lora_lib.adapter_specs(model_cfg, lora).items()}
    model_cfg = model_cfg.replace(lora_scale=lora.scale)
  elif wiring.uses_reference(cfg):
    ref = {n: jax.ShapeDtypeStruct(p.shape, jnp.dtype(cfg.model.ref_dtype), sharding=p.sharding)
           for n, p in params.items()}
  tx = wiring.optimizer(cfg)
  replicated = NamedSharding(mesh, PartitionSpec())
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=params,
                     opt_state=None, ref_params=ref, frozen=frozen,
                     model_config=model_cfg.replace(param_dtype="float32"), tx=tx)
  if advantages_lib.needs_critic(cfg.advantage.estimator):  # PPO's critic, float32 as the policy
    critic_cfg = _abstract_critic_config(cfg, model_cfg)
    # With LoRA: its adapters and score head on the policy's base (state.lora_critic).
    critic_specs = (lora_critic_specs(critic_cfg, lora) if lora.enabled
                    else models.param_specs(critic_cfg))
    critic_shardings = models.sharding.named_shardings(critic_specs, mesh)
    state = state.replace(
        critic_config=critic_cfg.replace(param_dtype="float32"),
        critic_params={n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=critic_shardings[n])
                       for n, (shape, _) in critic_specs.items()})
  return state.replace(opt_state=_abstract_opt_state(tx, state.trainable, mesh))


def _abstract_critic_config(cfg, model_cfg):
  """The critic's config (wiring.critic's) without its weights: the policy's decoder
  with a score head, or advantage.critic's config.json."""
  if cfg.advantage.critic == "policy":
    return model_cfg.replace(head="score", num_labels=1)
  from grpojax.models import hf

  critic_cfg = hf.read_config(config_lib.model_dir(cfg.advantage.critic, "advantage.critic"))
  return critic_cfg.replace(dtype=model_cfg.dtype, remat=model_cfg.remat,
                            kernels=model_cfg.kernels)


_OVER_HBM = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory.*?required for HLO temporaries "
                       r"\(([\d.]+)([KMGT])\)", re.DOTALL)


def peak_bytes(compiled) -> int:
  """A compiled program's peak device memory per device, as its compiler counts it.

  On a TPU, the compiler's heap simulation's peak (arguments, outputs and the
  temporaries live at once): what it checks against HBM, while its temp_size
  also counts buffers never live together (3.7 GiB too many for the GSM8K update
  at T = 4096: bench/RESULTS.md, "What a TPU's compiler checks"). Elsewhere
  arguments + outputs + temporaries - aliased: what a GPU allocates (its heap
  peak is the same figure), and XLA:CPU's heap peak leaves temporaries out.
  """
  mem = compiled.memory_analysis()
  if _platform(compiled) == "tpu" and getattr(mem, "peak_memory_in_bytes", 0):
    return int(mem.peak_memory_in_bytes)
  return (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)


def _platform(compiled) -> str:
  """The platform a compiled program runs on: its shardings' devices'."""
  for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
    return next(iter(sharding.device_set)).platform
  return jax.default_backend()


def target_kernels(name: str, mesh) -> str:
  """The grpojax.ops backend `model.kernels="auto"` picks on device `name` with
  `mesh`'s devices (ops.resolve's rule): its Pallas attention where this host
  compiles for it, else XLA's (XLA:CPU's proxy cannot lower a Mosaic or Triton kernel)."""
  if not targets.compile_only(mesh):
    return "xla"
  if name in targets.TPUS:
    return "tpu" if mesh.size == 1 else "xla"
  return "gpu" if name in targets.GPUS else "xla"


# (program text, its devices) -> measure's result, newest last. `fit` and `plan` ask
# again for programs they compiled (fit's candidates across calls, then the plan's
# update at the fitted choice), and a real-size compile for a device takes minutes.
_MEASURED: collections.OrderedDict = collections.OrderedDict()
_MEASURED_KEEP = 16


def measure(lower, quiet: bool = False, mesh=None) -> tuple[dict, object, object]:
  """Lowers and compiles; returns ({peak_bytes, ..., flops, compile_s}, lowered, compiled).

  peak_bytes is the compiler's peak: arguments, outputs and the temporaries live
  at once. A TPU's compiler refuses a program that exceeds its memory: then
  compiled is None and peak_bytes is the requirement it states (arguments and
  temporaries), a lower bound (`at_least`: True), rounded as it states it.
  mesh: the program's, which says how it compiles (targets.compiling); quiet:
  the compilers' stderr discarded without one. With a mesh, a program lowered to
  the same text for the same devices as one of the last few is not compiled again
  (its figures, compile_s included, are the first compile's).
  """
  t0 = time.perf_counter()
  where = (targets.compiling(mesh) if mesh is not None
           else targets.quiet_stderr() if quiet else contextlib.nullcontext())
  key = None
  try:
    with where:
      lowered = lower()
      if mesh is not None:
        key = (lowered.as_text(), tuple((d.platform, d.device_kind, d.id)
                                        for d in mesh.devices.flat))
        if key in _MEASURED:
          _MEASURED.move_to_end(key)
          measured, compiled = _MEASURED[key]
          return dict(measured), lowered, compiled
      compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    m = _OVER_HBM.search(str(e))
    if m is None:
      raise
    need = int(float(m[1]) * 1024 ** " KMGT".index(m[2]))
    measured, compiled = dict(peak_bytes=need, argument_bytes=0, output_bytes=0, temp_bytes=need,
                              alias_bytes=0, flops=0.0,
                              compile_s=round(time.perf_counter() - t0, 2), at_least=True), None
  else:
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    parts = {k: int(getattr(mem, f"{k}_size_in_bytes"))
             for k in ("argument", "output", "temp", "alias")}
    measured = dict(peak_bytes=peak_bytes(compiled), **{f"{k}_bytes": v for k, v in parts.items()},
                    flops=targets.read_program(compiled).matmul_flops, compile_s=round(seconds, 2))
  if key is not None:
    _MEASURED[key] = (measured, compiled)
    while len(_MEASURED) > _MEASURED_KEEP:
      _MEASURED.popitem(last=False)
  return dict(measured), lowered, compiled


class _TargetRewards:
  """The reward callback's stand-in in a program compiled for a device this host
  lacks: JAX lowers a host callback only against a running backend of the
  device's platform. Same outputs (rewards [N, K], errors [K]), read from the
  tokens as the callback reads them; the callback itself holds no device memory
  beyond those outputs."""

  def __init__(self, host):
    self.host, self.names = host, host.names

  def __call__(self, example_ids, tokens, mask, *, reward_params=None, **_):
    n, k = tokens.shape[0], len(self.names)
    rewards = jnp.broadcast_to(mask.sum(-1, keepdims=True).astype(jnp.float32), (n, k))
    models = getattr(self.host, "models", ())
    if models:  # their forward is the program's own: compile it on stand-in ids
      lengths = mask.sum(-1).astype(jnp.int32)
      scored = [m.score(p, jnp.broadcast_to(tokens[:, :1], (n, m.max_length)), lengths)
                for m, p in zip(models, reward_params)]
      rewards = jnp.concatenate([rewards[:, :k - len(models)], jnp.stack(scored, 1)], axis=1)
    return rewards, jnp.zeros((k,), jnp.int32)

  def close(self):
    self.host.close()


class _TargetTools:
  """The tool host's stand-in in a program compiled for a device this host lacks (see
  _TargetRewards): traceable, it takes the hand-offs and answers none."""

  traceable = True

  def submit(self, first_row, rows, *_):
    return jnp.zeros((), jnp.int32)

  def collect(self, first_row, wait, *, F: int, L: int):
    return (jnp.full((F,), -1, jnp.int32), jnp.zeros((F,), jnp.int32),
            jnp.zeros((F, L), jnp.int32), jnp.zeros((F,), jnp.int32), jnp.zeros((F,), bool))


@dataclasses.dataclass(frozen=True)
class Fit:
  """What `fit` chose for the update: micro-batches per minibatch and remat, and why."""

  micro_batches: int
  remat: bool | str  # a ModelConfig.remat value
  budget_bytes: int | None  # per device; None: no fitting
  update_bytes: int | None  # the chosen update's estimate per device (None: not compiled)
  how: str  # one line for the log
  kv_pages: int = 0  # the paged engine's pool (rollout.kv_pages; 0: every slot at full length)
  decode_slots: int = 0  # the paged engine's slots (rollout.decode_slots; 0: every row)


def _gib(n: int) -> str:
  return f"{n / GiB:.3g} GiB"


def memory_budget(cfg, device_bytes: int | None = None) -> int | None:
  """train.memory_budget in bytes per device: GiB given, "auto" 90% of the device's
  (device_bytes, default the detected accelerator's; none on a CPU, whose programs
  take host RAM), 0 None (no fitting)."""
  b = cfg.train.memory_budget
  if b == "auto":
    if device_bytes is None and jax.devices()[0].platform == "cpu":
      return None
    size = device_bytes or device_memory()[1]
    return None if size is None else int(0.9 * size)
  return None if not b else int(float(b) * GiB)


def abstract_rollout(cfg, mesh):
  """The update's input as ShapeDtypeStructs (rows over the batch axes)."""
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.train.rollout import Rollout

  r = cfg.rollout
  N, P, T = r.prompts_per_step * r.group_size, r.max_prompt_length, r.max_completion_length
  arr = lambda shape, dt: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dt, sharding=mesh_lib.row_sharding(mesh, N, len(shape)))
  off_policy = wiring.uses_old_logps(cfg)
  critic = advantages_lib.needs_critic(cfg.advantage.estimator)  # per-token advantages
  return Rollout(prompt_tokens=arr((N, P), jnp.int32), prompt_mask=arr((N, P), jnp.int32),
                 tokens=arr((N, T), jnp.int32), mask=arr((N, T), jnp.int32),
                 loss_mask=arr((N, T), jnp.int32),
                 advantages=arr((N, T) if critic else (N,), jnp.float32),
                 old_logps=arr((N, T), jnp.float32) if off_policy else None,
                 ref_logps=arr((N, T), jnp.float32) if wiring.uses_reference(cfg) else None,
                 sampler_logps=arr((N, T), jnp.float32), zero_std=arr((N,), jnp.bool_),
                 values=arr((N, T), jnp.float32) if critic else None,
                 returns=arr((N, T), jnp.float32) if critic else None)


def update_bytes(cfg, model_cfg, mesh, *, micro_batches: int) -> int:
  """The update's compiled peak bytes per device (memory_analysis), train state included."""
  from grpojax.train import step

  state = abstract_state(cfg, model_cfg, mesh)
  rollout = abstract_rollout(cfg, mesh)
  kw = wiring.update_settings(cfg, micro_batches)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  measured, *_ = measure(lambda: step.update.lower(state, rollout, rng, **kw),
                          mesh=mesh)
  return measured["peak_bytes"]


def fit(cfg, model_cfg, mesh, *, device_bytes: int | None = None) -> Fit:
  """Chooses train.micro_batches and model.remat where they are "auto", within the
  budget, then rollout.decode_slots and rollout.kv_pages where they are "auto"
  (`fit_engine`)."""
  fitted = _fit_update(cfg, model_cfg, mesh, device_bytes=device_bytes)
  if cfg.rollout.engine != "paged":
    return fitted
  slots, pages, how = fit_engine(cfg, model_cfg, mesh, device_bytes=device_bytes)
  return dataclasses.replace(fitted, kv_pages=pages, decode_slots=slots,
                             how=f"{fitted.how}; {how}")


def fit_engine(cfg, model_cfg, mesh, *, device_bytes: int | None = None) -> tuple[int, int, str]:
  """(rollout.decode_slots, rollout.kv_pages, why), each fitted where "auto".

  Slots "auto": the most rows the pool holds at full length (S * ceil(T / p) <= M),
  so that no row is ever preempted; all B*G rows where the pool is every slot's
  (kv_pages 0, or no budget). With the pool "auto" too, the pool is fitted for
  all rows' slots, then the most slots whose pool holds them (fewer slots leave
  more room: a few compiles of the generation; where even all rows' generation is
  over the budget, fewer slots are searched for). For ragged lengths
  more slots than that may be faster (preemption restarts the rows the pool
  runs short of): set decode_slots.
  """
  import numpy as np

  from grpojax.sampling import engine as engine_lib

  r = cfg.rollout
  N, T = r.prompts_per_step * r.group_size, r.max_completion_length
  per_row = -(-T // r.page_size)
  expected = config_lib.expected_lengths(cfg)
  if expected is not None and r.kv_pages == "auto":
    # Lengths to expect: every row (or the slots set) decoding, and a pool for the live
    # pages at their peak in 99% of batches, rather than all the budget leaves.
    slots = N if r.decode_slots == "auto" else r.decode_slots
    pages, how = fit_pages(cfg, model_cfg, mesh, device_bytes=device_bytes, slots=slots)
    rng = np.random.default_rng(0)
    median, sigma = expected
    peaks = [live_pages_peak(np.clip(np.rint(rng.lognormal(np.log(median), sigma, N)), 1, T),
                             T, slots=min(slots or N, N), page_size=r.page_size)
             for _ in range(100)]
    want = min(max(per_row * engine_lib.row_shards(mesh, r.prompts_per_step),
                   int(np.ceil(np.percentile(peaks, 99)))), min(slots or N, N) * per_row)
    if not pages or want <= pages:
      return slots, want, (f"decode_slots={slots}, kv_pages={want} (rollout.expected_lengths="
                           f"{r.expected_lengths!r}: the live pages' peak in 99 of 100 "
                           f"batches drawn so; their median {int(np.median(peaks))})")
    if r.decode_slots != "auto":
      return slots, pages, how
  if r.decode_slots != "auto":
    pages, how = fit_pages(cfg, model_cfg, mesh, device_bytes=device_bytes)
    return r.decode_slots, pages, how
  if r.kv_pages != "auto":
    slots = min(N, r.kv_pages // per_row) if r.kv_pages else N
    return slots, r.kv_pages, (f"decode_slots={slots} (the rows kv_pages={r.kv_pages} holds "
                               "at full length)")
  fitted = {}

  def holds(slots: int) -> bool:
    """Does the pool fitted beside `slots` slots' generation hold that many rows at
    full length? False where the generation alone is over the budget."""
    try:
      pages, how = fit_pages(cfg, model_cfg, mesh, device_bytes=device_bytes, slots=slots)
    except config_lib.ConfigError:
      if slots == 1:
        raise
      return False
    fitted[slots] = pages, how
    return (min(N, pages // per_row) if pages else N) >= slots

  # The rows the pool holds fall as slots rise (each slot's generation takes room),
  # so the slots that fit are 1 .. S for one S: the largest is searched between
  # what the pool fitted for N slots holds (which fits) and what the pool fitted for
  # that many holds (more cannot). Usually the two agree: two compiles.
  if holds(N):
    low, high = N, N + 1
  else:
    low, high = 0, N
    if N in fitted:
      held = max(1, fitted[N][0] // per_row)
      if holds(held):
        low, high = held, min(N, fitted[held][0] // per_row + 1)
      else:
        high = held
  while high - low > 1:  # holds(1) is True or raises: not even one row's generation fits
    mid = (low + high) // 2
    low, high = (mid, high) if holds(mid) else (low, mid)
  pages, how = fitted[low]
  return low, pages, f"decode_slots={low} (the rows the pool holds at full length), {how}"


def live_pages_peak(lengths, T: int, *, slots: int, page_size: int) -> int:
  """The most pages the engine's rows hold at once, rows of `lengths` [N] (tokens, as
  drawn: a row of length L decodes positions 0 .. L - 2) taking `slots` slots lowest
  first, a page when a position starts one, all released when the row ends; with
  no pool limit (no preemption)."""
  import heapq

  ends = []  # (step the row ends, its pages at the end) of the running rows
  events = []  # (step, +pages taken or -pages released)
  t = 0
  for L in (int(x) for x in lengths):
    steps = max(min(L, T) - 1, 0)  # decode steps; 0: ended at the prefill
    if not steps:
      continue
    if len(ends) == slots:  # waits for the earliest slot to free
      t, _ = heapq.heappop(ends)
    heapq.heappush(ends, (t + steps, 0))
    pages = -(-steps // page_size)
    # Page k is taken at the row's step k * page_size; all go at its end.
    events += [(t + k * page_size, 1) for k in range(pages)] + [(t + steps, -pages)]
  held = peak = 0
  for _, d in sorted(events, key=lambda e: (e[0], e[1])):  # releases before takes
    held += d
    peak = max(peak, held)
  return int(peak) if len(lengths) else 0


def page_bytes(cfg, model_cfg) -> int:
  """Bytes of one KV page of the paged engine, all layers, keys and values."""
  return (2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
          * cfg.rollout.page_size * jnp.dtype(model_cfg.dtype).itemsize)


def _batches(rounds: int, x: jax.ShapeDtypeStruct, mesh) -> jax.ShapeDtypeStruct:
  """[rounds, ...] of a batch's x, each batch split as x is: DAPO streaming's input."""
  spec = jax.sharding.PartitionSpec(None, *x.sharding.spec)
  return jax.ShapeDtypeStruct((rounds, *x.shape), x.dtype,
                              sharding=jax.sharding.NamedSharding(mesh, spec))


def _shapes_only_score(example_ids, tokens, mask, valid):
  """A streaming engine's score for measuring its program: the host's outputs' shapes."""
  return jnp.zeros((tokens.shape[0], 1)), jnp.zeros((1,), jnp.int32), valid


def fit_pages(cfg, model_cfg, mesh, *, device_bytes: int | None = None,
              slots: int | None = None) -> tuple[int, str]:
  """(rollout.kv_pages, why): where "auto", the most pages the memory budget leaves
  beside the engine's generation, at most every slot at full length. slots: the
  engine's (default rollout.decode_slots, which must then be a number).

  The generation is compiled once, with one completion's pages; a pool of M pages
  then needs M - that many page_bytes more (the pool is one buffer per layer,
  updated in place). Without a budget (a CPU): 0, every slot at full length.
  Raises config.ConfigError when not even one completion's pages fit.
  """
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.sampling import engine as engine_lib
  from grpojax.sampling.strategies import SamplingParams

  r = cfg.rollout
  if r.kv_pages != "auto":
    return int(r.kv_pages), f"kv_pages={r.kv_pages}"
  budget = memory_budget(cfg, device_bytes)
  if budget is None:
    return 0, "kv_pages=0 (no memory budget: every slot at full length)"
  B, G, P, T = r.prompts_per_step, r.group_size, r.max_prompt_length, r.max_completion_length
  slots = r.decode_slots if slots is None else slots
  S, full = engine_lib.EngineConfig(slots, r.page_size).sizes(B * G, T)
  per_row = full // S
  # Over a mesh's batch axes each device runs an engine with its share of the pool
  # (engine.sharded_program): the budget is per device, the pool the sum.
  shards = engine_lib.row_shards(mesh, B)
  state = abstract_state(cfg, model_cfg, mesh)
  prompts = jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=mesh_lib.row_sharding(mesh, B))
  rng = jax.eval_shape(lambda: jax.random.key(0))
  engine = engine_lib.EngineConfig(slots=slots, page_size=r.page_size, pages=per_row * shards,
                                   tail_slots=config_lib.tail_slots(cfg))
  kw = dict(sampling=SamplingParams(), num_samples=G, max_new_tokens=T, eos=(0,), pad_id=0)
  if wiring.rollout_strategy(cfg, engine) == "streaming":  # every batch's prompts prefilled,
    # their rows in one queue
    R = r.dynamic_sampling_max_rounds
    tokens = _batches(R, prompts, mesh)
    ids = _batches(R, jax.ShapeDtypeStruct((B,), jnp.int32,
                                           sharding=mesh_lib.row_sharding(mesh, B, 1)), mesh)
    lower = lambda: engine_lib.stream_program.lower(  # noqa: E731
        state.model_config, state.model_params, tokens, tokens, ids, rng, engine=engine,
        stream=engine_lib.Stream(score=_shapes_only_score, groups=B // shards, rewards=1),
        mesh=mesh, **kw)
  elif wiring.rollout_strategy(cfg, engine) == "carried":  # the carried batches' rows too,
    # their prompts and prefixes in the prompt store (engine.carry)
    from grpojax.sampling.engine import carry

    def pool_of(groups):  # the pool of that many groups, nothing drawn yet
      return jax.eval_shape(lambda t, k: carry.fresh(t, t, t[:, 0], k, num_samples=G,
                                                     max_new_tokens=T, pad_id=0),
                            jax.ShapeDtypeStruct((groups, P), jnp.int32), rng)

    engine = dataclasses.replace(engine, slots=slots or B * G)
    go = carry.keep_start if r.partial == "keep" else carry.resume_program
    carried = dict(engine=engine, groups=B, max_staleness=r.max_staleness,
                   restart=r.partial == "restart", width=max(T - 1, 0), **kw)
    if shards > 1:  # each row shard its own engine over its share (carry.resume_sharded)
      old = pool_of(r.carried_batches * B) if r.carried_batches else None
      sharded = jax.jit(functools.partial(carry.resume_sharded, state.model_config, mesh=mesh,
                                          **carried))
      lower = lambda: sharded.lower(  # noqa: E731
          state.model_params, old, pool_of(B), jax.ShapeDtypeStruct((), jnp.int32))
    else:
      pool = pool_of((r.carried_batches + 1) * B)
      lower = lambda: go.lower(  # noqa: E731
          state.model_config, state.model_params, pool, jnp.zeros((), jnp.int32), **carried)
  else:
    program, more = engine_lib.program_for(engine, mesh, B)
    lower = lambda: program.lower(  # noqa: E731
        state.model_config, state.model_params, prompts, prompts, rng, **kw, **more)
  measured, *_ = measure(lower, mesh=mesh)
  # The rest of the train state stays on the device beside the generation.
  need = measured["peak_bytes"] + max(0, bytes_per_device(state) - measured["argument_bytes"])
  each = page_bytes(cfg, state.model_config)
  pages = min(full, (per_row + (budget - need) // each) * shards)
  if pages < per_row * shards:
    raise config_lib.ConfigError(
        f"rollout.kv_pages='auto': the generation needs {_gib(need)} per device with one "
        f"completion's {per_row} pages, over train.memory_budget's {_gib(budget)}: shorten "
        "rollout.max_completion_length, or use fewer rollout.decode_slots")
  return int(pages), (f"kv_pages={pages} ({_gib(pages * each)} of KV pool beside "
                      f"{_gib(need - per_row * each)} of the generation's rest and the train state)")


def _fit_update(cfg, model_cfg, mesh, *, device_bytes: int | None = None) -> Fit:
  """Chooses train.micro_batches and model.remat where they are "auto", within the budget.

  The fastest choice that fits: no remat, then remat "dots", then full remat;
  for each, the fewest micro-batches. Candidates are compiled on abstract inputs (no device memory
  used) and measured by XLA's memory_analysis: the first, then (if it does not
  fit) the most micro-batches and a bisection between. Explicit values are
  kept. Raises config.ConfigError, in one line, when nothing fits. device_bytes: the memory of the device planned for (default: this one's).
  """
  r = cfg.rollout
  budget = memory_budget(cfg, device_bytes)
  micros, remats = wiring.micro_batch_choices(cfg), wiring.remat_choices(cfg)  # fastest first
  if budget is None:
    return Fit(micros[0], remats[0], None, None, "no memory budget (train.memory_budget=0, a "
               f"CPU, or an unknown device): micro_batches={micros[0]}, remat={remats[0]}")
  state = bytes_per_device(abstract_state(cfg, model_cfg, mesh))
  if state > budget:  # no program can fit: say so without compiling one
    raise config_lib.ConfigError(
        f"the train state alone (float32 weights, Adam's moments{', the reference' if wiring.uses_reference(cfg) else ''}) "
        f"takes {_gib(state)} per device, over train.memory_budget's {_gib(budget)}: shard it "
        "over more devices (--config.mesh.shape.fsdp=N) or plan a larger device")
  tried = {}

  def need(m, remat):
    if (m, remat) not in tried:
      tried[m, remat] = update_bytes(cfg, model_cfg.replace(remat=remat), mesh, micro_batches=m)
    return tried[m, remat]

  m, remat = micros[-1], remats[-1]
  # More micro-batches and more remat never need more memory (the bisection below
  # assumes as much): when the fastest choice does not fit and the most frugal does
  # not either, nothing does.
  if need(micros[0], remats[0]) > budget and need(m, remat) > budget:
    raise config_lib.ConfigError(
        f"the update needs {_gib(need(m, remat))} per device even with micro_batches={m} "
        f"and remat={remat}, over train.memory_budget's {_gib(budget)}: shorten "
        f"rollout.max_completion_length ({r.max_completion_length}) or max_prompt_length, shard "
        "over more devices (--config.mesh.shape.fsdp=N), or raise train.memory_budget")
  for remat in remats:
    if need(micros[0], remat) <= budget:
      return Fit(micros[0], remat, budget, need(micros[0], remat),
                 f"micro_batches={micros[0]}, remat={remat}: the update needs "
                 f"{_gib(need(micros[0], remat))} per device of the budget's "
                 f"{_gib(budget)} ({len(tried)} compiled)")
    if need(micros[-1], remat) > budget:
      continue
    lo, hi = 0, len(micros) - 1  # micros[hi] fits; find the first that does
    while lo < hi:
      mid = (lo + hi) // 2
      if need(micros[mid], remat) <= budget:
        hi = mid
      else:
        lo = mid + 1
    m = micros[hi]
    return Fit(m, remat, budget, need(m, remat),
               f"micro_batches={m}, remat={remat}: the update needs {_gib(need(m, remat))} "
               f"per device of the budget's {_gib(budget)} ({len(tried)} compiled)")
  raise AssertionError("unreachable: the most frugal choice fits, so the loop returned")


def load_program(cfg, model_cfg, mesh, state):
  """A QLoRA run's start-up, or None for another run: (a thunk lowering the program that
  quantises the largest projection, the bytes per device resident beside it). The loader
  (hf.load_params) quantises each projection as it is placed, so at worst the rest of the
  frozen base is there in its final form while the largest one is quantised."""
  from grpojax import models

  lora = config_lib.lora_config(cfg)
  if not lora.enabled or lora.quantize == "none":
    return None
  frozen = state.frozen
  name = max((n for n in frozen if lora_lib.quantizable(n)),
             key=lambda n: math.prod(frozen[n].shape))
  w = jax.ShapeDtypeStruct(frozen[name].shape, jnp.dtype(cfg.model.dtype),
                           sharding=models.param_shardings(model_cfg, mesh)[name])
  return (lambda: lora_lib.quantize_program(w, lora.quantize).lower(w, lora.quantize),
          bytes_per_device(frozen) - bytes_per_device(frozen[name]))


def plan(cfg, *, device: str = "", memory_bytes: int | None = None, devices: int = 0,
         progress=None) -> dict:
  """The plan of experiment `cfg` on the current devices: a JSON-able dict.

  With the named `device`'s compiler here (`grpojax.targets`), the programs
  compile for `devices` of it (default: as many as this host's local devices).

  Each program's `peak_bytes` is the compiler's peak per device (`measure`);
  `total_bytes` adds the train state it does not take as arguments but which
  stays on the device while it runs (e.g. Adam's moments during the rollout),
  none for a program the compiler refused (its stated need is a lower bound).
  A QLoRA run's "load" is its start-up: the quantiser of the largest projection, with
  the rest of the frozen base (quantised as it was loaded) resident.
  progress: called with one line before each wait (a fit, a program's compile).
  """
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.sampling import engine as engine_lib
  from grpojax.sampling import sampler
  from grpojax.sampling.strategies import SamplingParams
  from grpojax.train import sft, step
  from grpojax.train import strategy as strategy_lib

  config_lib.validate(cfg)
  name, budget = device_memory(device)
  if memory_bytes:
    budget = int(memory_bytes)
  # The target's own compiler where this machine has it: as many chips as there
  # are (fake) local devices.
  target_devices = None
  if name in targets.known() and targets.available(name):
    target_devices = targets.devices(name, chips=devices or jax.device_count())
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict(), devices=target_devices)
  compiler = ("its own compiler" if target_devices is not None else
              "XLA:CPU" + ("" if name == "cpu" else f" as a proxy: {name}'s compiler is not here"))
  say = progress or (lambda line: None)

  def compiling(program):
    say(f"plan: compiling {program} for {mesh.size} x {name} ({compiler})")

  r, t = cfg.rollout, cfg.train
  task = wiring.run_task(cfg)
  environments = wiring.run_environments(cfg)
  reward_fns, reward_weights = wiring.run_rewards(cfg, task, environments)
  tokenizer = wiring.run_tokenizer(cfg, environments)
  if cfg.rollout.max_prompt_length == "auto":  # from the data, as the run will size it
    train_rows, held_out = wiring.run_rows(cfg, task)
    cfg = wiring.with_prompt_length(cfg, task, tokenizer,
                                    [train_rows] + [rows for _, rows in held_out])
  model_cfg = wiring.model_config(cfg, tokenizer)
  if name != "cpu" and model_cfg.kernels in ("auto", "cpu"):  # the target's, not this host's
    model_cfg = model_cfg.replace(kernels=target_kernels(name, mesh))
  unfitted = None  # why the run would stop at startup, if it would
  if "auto" in (cfg.train.micro_batches, cfg.model.remat, r.decode_slots, r.kv_pages):
    say(f"plan: fitting the run to {name}'s memory (each layout it tries is a compile)")
  try:
    fitted = fit(cfg, model_cfg, mesh, device_bytes=budget)  # the named device's memory
  except config_lib.ConfigError as e:
    unfitted = str(e)  # reported below as not fitting, with the programs' bytes
    # at the most frugal choice fit tried: how far from fitting the run is.
    fitted = Fit(wiring.micro_batch_choices(cfg)[-1], wiring.remat_choices(cfg)[-1], None,
                 None, f"nothing fits: {e}")
  model_cfg = model_cfg.replace(remat=fitted.remat)
  # Reward models: frozen beside the policy, their weights resident, their forward
  # in the rollout program.
  reward_models, reward_params, model_weights = wiring.run_reward_models(cfg, mesh, abstract=True)
  if reward_models:
    reward_weights = (*(reward_weights or (1.0,) * len(reward_fns)), *model_weights)
  state = abstract_state(cfg, model_cfg, mesh)
  if reward_models:
    state = state.replace(reward_params=reward_params)
  state_bytes = bytes_per_device(state)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  B, P, T = r.prompts_per_step, r.max_prompt_length, r.max_completion_length

  def prompts(rows):
    return {"prompt_tokens": jax.ShapeDtypeStruct((rows, P), jnp.int32,
                                                  sharding=mesh_lib.row_sharding(mesh, rows)),
            "prompt_mask": jax.ShapeDtypeStruct((rows, P), jnp.int32,
                                                sharding=mesh_lib.row_sharding(mesh, rows))}

  programs, resident = {}, {}
  # A state over the budget fits no program: nothing to compile (fit said so).
  if budget is None or state_bytes <= budget:
    load = load_program(cfg, model_cfg, mesh, state)
    if load is not None:
      compiling("load")
      programs["load"], *_ = measure(load[0], mesh=mesh)
      resident["load"] = load[1]
    # Lowering never calls the reward callback: decode and lookup are never used.
    host = HostRewards(reward_fns, decode=lambda rows: [""] * len(rows), lookup=lambda i: {},
                       weights=reward_weights, num_workers=0, models=reward_models)
    if targets.compile_only(mesh):  # no backend of the target's platform runs here
      host = _TargetRewards(host)
    try:
      rollout_config = wiring.rollout_config(cfg, tokenizer, fitted.micro_batches,
                                            fitted.kv_pages, fitted.decode_slots, environments)
      if rollout_config.hook is not None and targets.compile_only(mesh):
        rollout_config.hook.host.close()
        rollout_config = dataclasses.replace(
            rollout_config, hook=dataclasses.replace(rollout_config.hook, host=_TargetTools()))
      strategy = strategy_lib.make(
          wiring.rollout_strategy(cfg, rollout_config.engine), rollout_config, host, num_prompts=B,
          max_rounds=r.dynamic_sampling_max_rounds if r.dynamic_sampling else 1,
          reward_weights=reward_weights, mesh=mesh)
      lower = lambda: strategy.lower(state, rng, prompt_length=P)  # noqa: E731
      compiling("rollout")
      programs["rollout"], lowered, compiled = measure(lower, mesh=mesh)
      if r.max_staleness > 0 and r.partial == "keep":
        # The engine's state (its pages) stays on the device through the update.
        resident["update"] = sum(x.size * x.dtype.itemsize
                                 for x in jax.tree.leaves(lowered.out_info[2]))
      # The update's input is the rollout's output: its shapes, and the shardings XLA chose
      # (the run's own layout where the rollout did not compile: too large for the device).
      if compiled is None:
        rollout = abstract_rollout(cfg, mesh)
      else:
        outputs = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                               lowered.out_info, compiled.output_shardings)
        rollout = outputs[0]
    finally:
      host.close()
    del lowered, compiled

    update_kw = wiring.update_settings(cfg, fitted.micro_batches)
    jax.clear_caches()  # fit may have compiled this very update: time a real compile
    compiling("update")
    programs["update"], *_ = measure(lambda: step.update.lower(state, rollout, rng, **update_kw),
                                      mesh=mesh)

    if cfg.eval.num_prompts:
      modes = [("eval_greedy", 1, SamplingParams(temperature=0.0))]
      n = config_lib.eval_samples(cfg)
      if n:  # the n samples of pass@k, maj@k and mean@n
        modes.append((f"eval_sampled@{n}", n, SamplingParams(temperature=cfg.eval.temperature)))
      engine = config_lib.engine_config(cfg, fitted.kv_pages, fitted.decode_slots)
      for key, k, sampling in modes:
        b = prompts(cfg.eval.batch_size)
        kw = dict(sampling=sampling, num_samples=k, max_new_tokens=T, eos=tuple(tokenizer.eos_ids),
                  pad_id=int(tokenizer.pad_id))
        if engine is None:
          generate, kw = sampler.generate_program, dict(kw, mesh=mesh)
        else:
          generate, more = engine_lib.program_for(engine, mesh, cfg.eval.batch_size)
          kw = dict(kw, **more)
        compiling(key)
        programs[key], *_ = measure(lambda b=b, generate=generate, kw=kw: generate.lower(
            state.model_config, state.model_params, b["prompt_tokens"], b["prompt_mask"], rng,
            **kw),
            mesh=mesh)

    if cfg.sft.steps:
      tx = sft.sft_optimizer(cfg.sft.learning_rate, cfg.sft.steps)
      params = state.params
      opt_state = _abstract_opt_state(tx, params, mesh)
      rows = cfg.sft.batch_size
      sft_batch = dict(prompts(rows), example_ids=jax.ShapeDtypeStruct(
          (rows,), jnp.int32, sharding=mesh_lib.row_sharding(mesh, rows, 1)))
      for key in ("targets", "target_mask"):
        sft_batch[key] = jax.ShapeDtypeStruct((rows, T), jnp.int32,
                                              sharding=mesh_lib.row_sharding(mesh, rows))
      compiling("sft")
      programs["sft"], *_ = measure(lambda: sft.sft_step.lower(
          state.model_config, params, opt_state, sft_batch, tx=tx, frozen=state.frozen),
          mesh=mesh)

  for key, p in programs.items():
    # The train state stays on the device around every program: the update takes
    # (and donates) all of it, the others only part, and SFT works on a copy.
    outside = resident[key] if key in resident else state_bytes if key == "sft" else (
        0 if key == "update" or p.get("at_least") else max(0, state_bytes - p["argument_bytes"]))
    p["resident_bytes"] = outside
    p["total_bytes"] = p["peak_bytes"] + outside

  worst = max(programs, key=lambda k: programs[k]["total_bytes"], default="the train state")
  need = programs[worst]["total_bytes"] if programs else state_bytes
  fits = None if budget is None else need <= budget
  backend = mesh.devices.flat[0].platform
  if backend != "cpu" or name == "cpu":
    note = None  # the target's own compiler, or a plan for this CPU itself
  else:
    note = _NO_TARGET_NOTE.format(
        name=name, low=PROXY_ERROR[0], high=PROXY_ERROR[1],
        install=targets.INSTALL if name in targets.TPUS else targets.CUDA_INSTALL)
  if unfitted:  # the run itself would stop before its first step
    fits, reason = False, unfitted
  elif fits is None:
    reason = f"{worst} needs {need / GiB:.2f} GiB per device; {name}'s memory is unknown"
  else:
    reason = (f"{worst} needs {need / GiB:.2f} GiB per device "
              f"{'<=' if fits else '>'} {name}'s {budget / GiB:.2f} GiB")
  n_params = sum(math.prod(x.shape) for n, x in state.model_params.items()
                 if not lora_lib.is_adapter(n))
  choices = {
      "model": cfg.model.path or cfg.model.arch, "parameters": n_params,
      "devices": mesh.size, "mesh": dict(mesh.shape), "backend": backend,
      "rows": B * r.group_size, "prompt_length": P, "completion_length": T,
      "minibatches": t.minibatches, "grad_accum_steps": cfg.optim.grad_accum_steps,
      "num_iterations": t.num_iterations, "remat": fitted.remat, "micro_batches": fitted.micro_batches,
      "fit": fitted.how, "dtype": cfg.model.dtype,
      "kernels": model_cfg.kernels,
      "reference": wiring.uses_reference(cfg), "state_bytes": state_bytes,
      "trainable": sum(math.prod(x.shape) for x in state.params.values()),
      "lora": (f"rank {cfg.model.lora.rank}, base {cfg.model.lora.quantize}"
               if state.frozen is not None else None),
  }
  return {"device": name, "device_memory_bytes": budget, "programs": programs,
          "choices": choices, "fits": fits, "reason": reason,
          "note": note}


def ppo_twin(cfg):
  """The run `cfg` as PPO with a learned critic: advantage.estimator=gae from the
  policy, one completion per prompt and G times the prompts (the same samples per
  step), the KL in the reward where the run has one (TRL's PPO recipe)."""
  out = copy.deepcopy(cfg)
  with out.unlocked():
    r = out.rollout
    r.prompts_per_step, r.group_size = r.prompts_per_step * r.group_size, 1
    if isinstance(r.decode_slots, int) and r.decode_slots:
      r.decode_slots = min(r.decode_slots, r.prompts_per_step)
    out.advantage.estimator = "gae"
    out.loss.kl_in_reward = out.loss.beta > 0
    out.rollout.dynamic_sampling = False
    if out.rollout.strategy in ("dynamic", "streaming"):
      out.rollout.strategy = "auto"
  return out


def compare(cfg, against: str = "ppo", **kw) -> dict:
  """{"grpo": plan(cfg), "ppo": plan(ppo_twin(cfg)), "ratios": PPO's bytes over GRPO's}
  (plan's keyword arguments kw): the same run both ways, program by program."""
  if against != "ppo":
    raise ValueError(f"--compare={against!r}: the planner compares against 'ppo'")
  grpo, ppo = plan(cfg, **kw), plan(ppo_twin(cfg), **kw)
  ratios = {"state": ppo["choices"]["state_bytes"] / grpo["choices"]["state_bytes"]}
  for k, p in ppo["programs"].items():
    if k in grpo["programs"] and grpo["programs"][k]["total_bytes"]:
      ratios[k] = p["total_bytes"] / grpo["programs"][k]["total_bytes"]
  return {"grpo": grpo, "ppo": ppo, "ratios": ratios}


def format_compare(result: dict) -> str:
  """Both plans' tables, then PPO's bytes over GRPO's, program by program."""
  g, p = result["grpo"], result["ppo"]
  lines = ["GRPO, as configured:", format_plan(g), "",
           f"PPO with a critic (advantage.estimator=gae, {p['choices']['rows']} rows of one "
           "completion per prompt):", format_plan(p), "",
           "PPO / GRPO, bytes per device (total, with the resident train state):"]
  for k, ratio in result["ratios"].items():
    what = (f"{g['choices']['state_bytes'] / GiB:.2f} -> {p['choices']['state_bytes'] / GiB:.2f}"
            if k == "state" else f"{g['programs'][k]['total_bytes'] / GiB:.2f} -> "
            f"{p['programs'][k]['total_bytes'] / GiB:.2f}")
    lines.append(f"  {k}: {what} GiB, {ratio:.2f}x")
  verdict = {True: "fits", False: "does not fit", None: "unknown"}
  lines.append(f"GRPO {verdict[g['fits']]}, PPO {verdict[p['fits']]} on {g['device']}")
  return "\n".join(lines)


def format_plan(result: dict) -> str:
  """The human table."""
  c = result["choices"]
  lines = [f"model {c['model']} ({c['parameters'] / 1e9:.3f}B parameters), {c['dtype']} compute, "
           f"remat={c['remat']}; {c['rows']} rows x (P={c['prompt_length']} + "
           f"T={c['completion_length']}), minibatches={c['minibatches']}, "
           f"micro_batches={c['micro_batches']}; "
           f"{c['devices']} {c['backend']} device(s), mesh {c['mesh']}",
           f"fit: {c['fit']}",
           *([f"LoRA {c['lora']}: {c['trainable'] / 1e6:.2f}M trainable parameters"]
             if c.get("lora") else []),
           f"train state: {c['state_bytes'] / GiB:.2f} GiB per device", ""]
  header = ("program", "peak GiB", "+state GiB", "total GiB", "matmul GFLOP", "compile s")
  def over(p):  # a TPU compiler's refusal: its requirement is a lower bound
    return ">=" if p.get("at_least") else ""
  rows = [header] + [(k, f"{over(p)}{p['peak_bytes'] / GiB:.2f}", f"{p['resident_bytes'] / GiB:.2f}",
                      f"{over(p)}{p['total_bytes'] / GiB:.2f}",
                      "?" if p.get("at_least") else f"{p['flops'] / 1e9:,.1f}",
                      f"{p['compile_s']:.1f}") for k, p in result["programs"].items()]
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  for r in rows if result["programs"] else []:  # none compiled when the state cannot fit
    lines.append("  ".join(r[0].ljust(widths[0]) if i == 0 else r[i].rjust(widths[i])
                           for i in range(len(r))))
  budget = result["device_memory_bytes"]
  if result["programs"]:
    lines.append("")
  lines.append(f"device: {result['device']}"
               + ("" if budget is None else f", {budget / GiB:.2f} GiB per device"))
  verdict = {True: "fits", False: "does not fit", None: "unknown"}[result["fits"]]
  lines.append(f"{verdict}: {result['reason']}")
  if result["note"]:
    lines.append(f"note: {result['note']}")
  return "\n".join(lines)


def main(argv):
  from absl import app, logging

  # absl's INFO default would print JAX's probe of every backend this host lacks.
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _INSTALL.value:
    found = targets.install_compilers()
    if all(found.values()):
      print(f"installed in {targets.compilers_dir()}: the planner finds them there "
            f"(--device {', '.join(targets.known())})")
    return 0 if all(found.values()) else 1
  say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 (stdout: the table)
  kw = dict(device=_DEVICE.value, devices=_DEVICES.value,
            memory_bytes=int(_MEMORY_GB.value * GiB) if _MEMORY_GB.value else None, progress=say)
  try:
    if _COMPARE.value:
      result = compare(_CONFIG.value, _COMPARE.value, **kw)
    else:
      result = plan(_CONFIG.value, **kw)
  except (config_lib.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_compare(result) if _COMPARE.value else format_plan(result))
  if _JSON.value:
    print(json.dumps(result))
  if _COMPARE.value:
    return 0 if result["grpo"]["fits"] is not False else 1
  return 0 if result["fits"] is not False else 1


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  # The same default experiment as grpojax.main (whose flags cannot be imported twice).
  _DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "experiments", "arithmetic_tiny.py")
  _CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Experiment config file.",
                                            lock_config=True)
  _DEVICE = flags.DEFINE_string("device", "", f"budget of a device: {', '.join(DEVICES)}; "
                                "default: the detected device")
  _DEVICES = flags.DEFINE_integer("devices", 0, "plan on N devices (the run's mesh): fake CPU "
                                  "devices, or N of the target's own (a TPU slice of 1, 4 "
                                  "or 8 chips; 1-8 GPUs)")
  _MEMORY_GB = flags.DEFINE_float("memory_gb", 0.0, "budget in GiB per device (overrides --device)")
  _JSON = flags.DEFINE_boolean("json", False, "also print one JSON object on the last line")
  _COMPARE = flags.DEFINE_string("compare", "", "'ppo': plan the run as configured and as PPO "
                                 "with a learned critic (same samples per step), side by side")
  _INSTALL = flags.DEFINE_boolean(
      "install-compilers", False, "install the TPU and NVIDIA compilers (libtpu, the CUDA "
      "plugin) beside the venv, where --device finds them; then exit")
  app.run(main)
