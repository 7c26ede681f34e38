"""Memory fitting: the "auto" sizes of a run (train.micro_batches, model.remat,
rollout.decode_slots, rollout.kv_pages) chosen by compiling its programs on abstract
inputs, and the abstract train state and rollout those programs take.

The trainer sizes its run with `fit` before the first step (train/loop.py); the
planner (grpojax.plan) reports the same figures for a device it may not have. Both
read them from here, so the loop never imports the planner.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from grpojax import targets
from grpojax.errors import ConfigError
from grpojax.models import lora as lora_lib
from grpojax.train import wiring

GiB = targets.GiB
DEVICES = targets.DEVICES  # name -> bytes per device (None: this machine's RAM)


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


def abstract_opt_state(tx, params: dict, mesh):
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


def abstract_state(s, model_cfg, mesh):
  """The TrainState the run creates, as ShapeDtypeStructs with its shardings (with LoRA:
  float32 adapters and their optimizer state, the base frozen in model.dtype or quantised)."""
  from grpojax import models
  from grpojax.train.state import TrainState, lora_critic_specs

  shardings = models.param_shardings(model_cfg, mesh)
  specs = models.param_specs(model_cfg)
  params = {n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=shardings[n])
            for n, (shape, _) in specs.items()}
  ref = frozen = None
  lora = s.model.lora
  if lora.enabled:
    frozen = {n: lora_lib.abstract_frozen(n, p, lora, model_cfg.dtype)
              for n, p in params.items()}
    adapter_shardings = models.sharding.named_shardings(
        lora_lib.adapter_specs(model_cfg, lora), mesh)
    params = {n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=adapter_shardings[n])
              for n, (shape, _) in lora_lib.adapter_specs(model_cfg, lora).items()}
    model_cfg = model_cfg.replace(lora_scale=lora.scale)
  elif s.uses_reference:
    ref = {n: jax.ShapeDtypeStruct(p.shape, jnp.dtype(s.model.ref_dtype), sharding=p.sharding)
           for n, p in params.items()}
  tx = wiring.optimizer(s)
  replicated = NamedSharding(mesh, PartitionSpec())
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=params,
                     opt_state=None, ref_params=ref, frozen=frozen,
                     model_config=model_cfg.replace(param_dtype="float32"), tx=tx)
  if s.advantage.needs_critic:  # PPO's critic, float32 as the policy
    critic_cfg = wiring.critic_config(s, model_cfg)
    # With LoRA: its adapters and score head on the policy's base (state.lora_critic).
    critic_specs = (lora_critic_specs(critic_cfg, lora) if lora.enabled
                    else models.param_specs(critic_cfg))
    critic_shardings = models.sharding.named_shardings(critic_specs, mesh)
    state = state.replace(
        critic_config=critic_cfg.replace(param_dtype="float32"),
        critic_params={n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=critic_shardings[n])
                       for n, (shape, _) in critic_specs.items()})
  return state.replace(opt_state=abstract_opt_state(tx, state.trainable, mesh))


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


def memory_budget(s, device_bytes: int | None = None) -> int | None:
  """train.memory_budget in bytes per device: GiB given, "auto" 90% of the device's
  (device_bytes, default the detected accelerator's; none on a CPU, whose programs
  take host RAM), 0 None (no fitting)."""
  b = s.train.memory_budget
  if b == "auto":
    if device_bytes is None and jax.devices()[0].platform == "cpu":
      return None
    size = device_bytes or device_memory()[1]
    return None if size is None else int(0.9 * size)
  return None if not b else int(float(b) * GiB)


def abstract_rollout(s, mesh):
  """The update's input as ShapeDtypeStructs (rows over the batch axes)."""
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.train.rollout import Rollout

  r = s.rollout
  N, P, T = r.prompts_per_step * r.group_size, r.max_prompt_length, r.max_completion_length
  arr = lambda shape, dt: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dt, sharding=mesh_lib.row_sharding(mesh, N, len(shape)))
  off_policy = s.uses_old_logps
  critic = s.advantage.needs_critic  # per-token advantages
  return Rollout(prompt_tokens=arr((N, P), jnp.int32), prompt_mask=arr((N, P), jnp.int32),
                 tokens=arr((N, T), jnp.int32), mask=arr((N, T), jnp.int32),
                 loss_mask=arr((N, T), jnp.int32),
                 advantages=arr((N, T) if critic else (N,), jnp.float32),
                 old_logps=arr((N, T), jnp.float32) if off_policy else None,
                 ref_logps=arr((N, T), jnp.float32) if s.uses_reference else None,
                 sampler_logps=arr((N, T), jnp.float32), zero_std=arr((N,), jnp.bool_),
                 values=arr((N, T), jnp.float32) if critic else None,
                 returns=arr((N, T), jnp.float32) if critic else None)


def update_bytes(s, model_cfg, mesh, *, micro_batches: int) -> int:
  """The update's compiled peak bytes per device (memory_analysis), train state included."""
  from grpojax.train import step

  state = abstract_state(s, model_cfg, mesh)
  rollout = abstract_rollout(s, mesh)
  kw = wiring.update_settings(s, micro_batches)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  measured, *_ = measure(lambda: step.update.lower(state, rollout, rng, **kw),
                          mesh=mesh)
  return measured["peak_bytes"]


def fit(s, model_cfg, mesh, *, device_bytes: int | None = None) -> Fit:
  """Chooses train.micro_batches and model.remat where they are "auto", within the
  budget, then rollout.decode_slots and rollout.kv_pages where they are "auto"
  (`fit_engine`)."""
  fitted = _fit_update(s, model_cfg, mesh, device_bytes=device_bytes)
  if s.rollout.engine != "paged":
    return fitted
  slots, pages, how = fit_engine(s, model_cfg, mesh, device_bytes=device_bytes)
  return dataclasses.replace(fitted, kv_pages=pages, decode_slots=slots,
                             how=f"{fitted.how}; {how}")


def fit_engine(s, model_cfg, mesh, *, device_bytes: int | None = None) -> tuple[int, int, str]:
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

  r = s.rollout
  N, T = r.prompts_per_step * r.group_size, r.max_completion_length
  per_row = -(-T // r.page_size)
  expected = s.rollout.expected_lengths
  if expected is not None and r.kv_pages == "auto":
    # Lengths to expect: every row (or the slots set) decoding, and a pool for the live
    # pages at their peak in 99% of batches, rather than all the budget leaves.
    slots = N if r.decode_slots == "auto" else r.decode_slots
    pages, how = fit_pages(s, model_cfg, mesh, device_bytes=device_bytes, slots=slots)
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
    pages, how = fit_pages(s, model_cfg, mesh, device_bytes=device_bytes)
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
      pages, how = fit_pages(s, model_cfg, mesh, device_bytes=device_bytes, slots=slots)
    except ConfigError:
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


def page_bytes(s, model_cfg) -> int:
  """Bytes of one KV page of the paged engine, all layers, keys and values."""
  return (2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
          * s.rollout.page_size * jnp.dtype(model_cfg.dtype).itemsize)


def _batches(rounds: int, x: jax.ShapeDtypeStruct, mesh) -> jax.ShapeDtypeStruct:
  """[rounds, ...] of a batch's x, each batch split as x is: DAPO streaming's input."""
  spec = jax.sharding.PartitionSpec(None, *x.sharding.spec)
  return jax.ShapeDtypeStruct((rounds, *x.shape), x.dtype,
                              sharding=jax.sharding.NamedSharding(mesh, spec))


def _shapes_only_score(example_ids, tokens, mask, valid):
  """A streaming engine's score for measuring its program: the host's outputs' shapes."""
  return jnp.zeros((tokens.shape[0], 1)), jnp.zeros((1,), jnp.int32), valid


def fit_pages(s, model_cfg, mesh, *, device_bytes: int | None = None,
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

  r = s.rollout
  if r.kv_pages != "auto":
    return int(r.kv_pages), f"kv_pages={r.kv_pages}"
  budget = memory_budget(s, device_bytes)
  if budget is None:
    return 0, "kv_pages=0 (no memory budget: every slot at full length)"
  B, G, P, T = r.prompts_per_step, r.group_size, r.max_prompt_length, r.max_completion_length
  slots = r.decode_slots if slots is None else slots
  S, full = engine_lib.EngineConfig(slots, r.page_size).sizes(B * G, T)
  per_row = full // S
  # Over a mesh's batch axes each device runs an engine with its share of the pool
  # (engine.sharded_program): the budget is per device, the pool the sum.
  shards = engine_lib.row_shards(mesh, B)
  state = abstract_state(s, model_cfg, mesh)
  prompts = jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=mesh_lib.row_sharding(mesh, B))
  rng = jax.eval_shape(lambda: jax.random.key(0))
  engine = engine_lib.EngineConfig(slots=slots, page_size=r.page_size, pages=per_row * shards,
                                   tail_slots=s.rollout.tail_slots)
  kw = dict(sampling=SamplingParams(), num_samples=G, max_new_tokens=T, eos=(0,), pad_id=0)
  if wiring.rollout_strategy(s, engine) == "streaming":  # every batch's prompts prefilled,
    # their rows in one queue
    R = r.dynamic_sampling_max_rounds
    tokens = _batches(R, prompts, mesh)
    ids = _batches(R, jax.ShapeDtypeStruct((B,), jnp.int32,
                                           sharding=mesh_lib.row_sharding(mesh, B, 1)), mesh)
    lower = lambda: engine_lib.stream_program.lower(  # noqa: E731
        state.model_config, state.model_params, tokens, tokens, ids, rng, engine=engine,
        stream=engine_lib.Stream(score=_shapes_only_score, groups=B // shards, rewards=1),
        mesh=mesh, **kw)
  elif wiring.rollout_strategy(s, engine) == "carried":  # the carried batches' rows too,
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
  each = page_bytes(s, state.model_config)
  pages = min(full, (per_row + (budget - need) // each) * shards)
  if pages < per_row * shards:
    raise ConfigError(
        f"rollout.kv_pages='auto': the generation needs {_gib(need)} per device with one "
        f"completion's {per_row} pages, over train.memory_budget's {_gib(budget)}: shorten "
        "rollout.max_completion_length, or use fewer rollout.decode_slots")
  return int(pages), (f"kv_pages={pages} ({_gib(pages * each)} of KV pool beside "
                      f"{_gib(need - per_row * each)} of the generation's rest and the train state)")


def _fit_update(s, model_cfg, mesh, *, device_bytes: int | None = None) -> Fit:
  """Chooses train.micro_batches and model.remat where they are "auto", within the budget.

  The fastest choice that fits: no remat, then remat "dots", then full remat;
  for each, the fewest micro-batches. Candidates are compiled on abstract inputs (no device memory
  used) and measured by XLA's memory_analysis: the first, then (if it does not
  fit) the most micro-batches and a bisection between. Explicit values are
  kept. Raises config.ConfigError, in one line, when nothing fits. device_bytes: the memory of the device planned for (default: this one's).
  """
  r = s.rollout
  budget = memory_budget(s, device_bytes)
  micros, remats = s.micro_batch_choices, s.model.remat_choices  # fastest first
  if budget is None:
    return Fit(micros[0], remats[0], None, None, "no memory budget (train.memory_budget=0, a "
               f"CPU, or an unknown device): micro_batches={micros[0]}, remat={remats[0]}")
  state = bytes_per_device(abstract_state(s, model_cfg, mesh))
  if state > budget:  # no program can fit: say so without compiling one
    raise ConfigError(
        f"the train state alone (float32 weights, Adam's moments{', the reference' if s.uses_reference else ''}) "
        f"takes {_gib(state)} per device, over train.memory_budget's {_gib(budget)}: shard it "
        "over more devices (--config.mesh.shape.fsdp=N) or plan a larger device")
  tried = {}

  def need(m, remat):
    if (m, remat) not in tried:
      tried[m, remat] = update_bytes(s, model_cfg.replace(remat=remat), mesh, micro_batches=m)
    return tried[m, remat]

  m, remat = micros[-1], remats[-1]
  # More micro-batches and more remat never need more memory (the bisection below
  # assumes as much): when the fastest choice does not fit and the most frugal does
  # not either, nothing does.
  if need(micros[0], remats[0]) > budget and need(m, remat) > budget:
    raise ConfigError(
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


def load_program(s, model_cfg, mesh, state):
  """A QLoRA run's start-up, or None for another run: (a thunk lowering the program that
  quantises the largest projection, the bytes per device resident beside it). The loader
  (hf.load_params) quantises each projection as it is placed, so at worst the rest of the
  frozen base is there in its final form while the largest one is quantised."""
  from grpojax import models

  lora = s.model.lora
  if not lora.enabled or lora.quantize == "none":
    return None
  frozen = state.frozen
  name = max((n for n in frozen if lora_lib.quantizable(n)),
             key=lambda n: math.prod(frozen[n].shape))
  w = jax.ShapeDtypeStruct(frozen[name].shape, jnp.dtype(s.model.dtype),
                           sharding=models.param_shardings(model_cfg, mesh)[name])
  return (lambda: lora_lib.quantize_program(w, lora.quantize).lower(w, lora.quantize),
          bytes_per_device(frozen) - bytes_per_device(frozen[name]))
