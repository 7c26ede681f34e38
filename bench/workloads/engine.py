"""The rollout engine against lockstep `generate` on ragged and full-length completions:
tokens/s, the KV bytes each reads against the live KV, KV memory.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, S decode slots, M pages of p tokens.

Rows: each row's length is drawn from a lognormal with median T/8 and sigma
--sigma (in log space), clipped to [1, T], and forced through the samplers'
`stop_at` hook: row n draws V - 1 as its token len_n - 1. The random model never
draws V - 1 itself (common.with_stop_logit), and every run checks its lengths.
Four runs per T, each compiled by a warm-up (rows stopped at 2 tokens), then timed
in turn, --reps rounds, the best of each:
  engine ragged     `engine.generate` (S slots, M pages of p), the drawn lengths
  engine full       the same program, every row forced to T tokens
  generate ragged   the lockstep `sampler.generate_from_params`, the drawn lengths
  generate full     the same, every row at T
Useful tokens/s: the rows' lengths summed over those seconds; the ratios are
engine ragged / full, ragged / generate ragged and full / generate full.

KV bytes = keys read x bytes per key (bench/engine_kv.py). Keys read: the engine's
schedule replayed in numpy and checked against EngineStats; the lockstep's, every
row's T - 1 slots each step. Bytes per key: on a CPU, the slopes of XLA's cost model
over compiled steps ("x live": over the live KV; "in place": the page writes'
whole-pool charge taken out); on an accelerator (or --floor), the floor, one read
of each key and value and the weights once a step, and "% HBM" is a run's floor
bytes over its seconds and a copy's bandwidth measured in the same process. "Bound
by bandwidth" (JSON): tokens per byte, engine against lockstep, the ratios of a
device bound by its memory bandwidth, from the programs alone.

--compile-only: instead, the same figures at Qwen2.5-0.5B's shapes (bf16, B=32 x
G=8, S=32, P=128) from compiled steps alone, never run: XLA:CPU's cost model and,
with --targets tpu,h100, the TPU v5e's and H100's compilers' (grpojax.targets),
with each target's own paged attention kernel beside XLA's.

Settings by --device: cpu, the 27.8M-parameter 'small' Llama in float32, B=4 x G=8,
P=32, S=8, T=256,1024, best of 2 (minutes on 2 cores); gpu and tpu, Qwen2.5-0.5B's
shapes in bf16 with the platform's kernels, B=32 x G=8, P=128, S=256, T=4096, one
rep; --quick, the 'tiny' preset, B=2 x G=8, P=8, S=4, p=8, T=32 (qwen2_tiny for
--compile-only). Flags given override them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
import engine_kv as kv_lib
from grpojax import models, ops, targets
from grpojax.sampling import engine as engine_lib
from grpojax.sampling import sampler, strategies

QWEN = "qwen2.5-0.5b"  # grpojax.models preset: Qwen2.5-0.5B's published shapes
SAMPLING = strategies.SamplingParams(temperature=1.0)
TARGETS = {"tpu": "tpu-v5e", "h100": "h100-80gb"}
KERNELS = {"tpu-v5e": ("tpu",), "h100-80gb": ("gpu",)}  # a target's pool kernel backend


def draw_lengths(seed: int, rows: int, T: int, sigma: float) -> np.ndarray:
  """[rows] int32 completion lengths: lognormal with median T/8 and `sigma`, in [1, T]."""
  x = np.random.default_rng(seed).lognormal(np.log(T / 8), sigma, rows)
  return np.clip(np.rint(x), 1, T).astype(np.int32)


# ---------------------------------------------------------------- timed runs

RUNS = ("engine ragged", "engine full", "generate ragged", "generate full")


@dataclasses.dataclass
class Shapes:
  B: int  # prompts
  G: int  # samples per prompt
  P: int  # prompt tokens
  S: int  # decode slots
  p: int  # page size
  pages: int  # M; 0: enough for every slot at full length
  tail: tuple[int, ...] | None = None  # EngineConfig.tail_slots (None: automatic)

  @property
  def N(self) -> int:
    return self.B * self.G

  @property
  def engine(self) -> engine_lib.EngineConfig:
    return engine_lib.EngineConfig(slots=self.S, page_size=self.p, pages=self.pages,
                                   tail_slots=self.tail)

  def M(self, T: int) -> int:
    return self.engine.sizes(self.N, T)[1]


def timed_runs(cfg, weights, s: Shapes, T: int, lengths: np.ndarray, *, reps: int,
               seed: int, log=print, runs: tuple = RUNS) -> dict:
  """{run: (best seconds, EngineStats or None)} of `runs` (of RUNS): each compiled by a
  warm-up (every row stopped at 2 tokens), then `reps` timed calls, alternating; each
  call's lengths checked against its stop_at."""
  V = cfg.vocab_size
  prompts = jnp.asarray(np.random.default_rng(seed).integers(0, V - 1, (s.B, s.P)), jnp.int32)
  mask = jnp.ones_like(prompts)
  kw = dict(rng=jax.random.key(seed), num_samples=s.G, max_new_tokens=T, sampling=SAMPLING,
            eos_ids=(V - 1,), pad_id=0)

  def call(method: str, stop: np.ndarray):
    stop_at = jnp.asarray(stop, jnp.int32)
    t = time.perf_counter()
    if method == "engine":
      out, stats = engine_lib.generate(cfg, weights, prompts, mask, engine=s.engine,
                                       with_stats=True, stop_at=stop_at, **kw)
    else:
      out, stats = sampler.generate_from_params(cfg, weights, prompts, mask, stop_at=stop_at,
                                                **kw), None
    lengths_out = np.asarray(out.lengths)  # waits for the program
    seconds = time.perf_counter() - t
    if not np.array_equal(lengths_out, stop) or bool(np.any(np.asarray(out.truncated))):
      bad = np.flatnonzero(lengths_out != stop)
      raise AssertionError(f"{method}: {len(bad)} rows did not stop where forced (rows "
                           f"{bad[:8].tolist()}: {lengths_out[bad[:8]].tolist()} != "
                           f"{stop[bad[:8]].tolist()})")
    return seconds, stats

  stops = {"ragged": lengths, "full": np.full(s.N, T, np.int32)}
  for method in dict.fromkeys(run.split()[0] for run in runs):
    seconds, _ = call(method, np.full(s.N, min(2, T), np.int32))
    log(f"  {method}: compiled and warmed up in {seconds:.1f} s")
  best = {}
  for rep in range(reps):
    for run in runs:
      method, schedule = run.split()
      seconds, stats = call(method, stops[schedule])
      log(f"  rep {rep + 1}/{reps} {run}: {seconds:.2f} s")
      if run not in best or seconds < best[run][0]:
        best[run] = (seconds, stats)
  return best


# ---------------------------------------------------------------- figures


def figures(kv: kv_lib.StepKV, bpt: int, s: Shapes, T: int, lengths: np.ndarray,
            schedules: dict) -> dict:
  """{run: {tokens, steps, keys (read, one layer), live_keys, kv (bytes XLA counts over
  the run), kv_in_place, live (bytes), peak_bytes, pool_bytes}}."""
  M = s.M(T)
  prompts = s.B * s.P * bpt
  out = {}
  for run in RUNS:
    method, schedule = run.split()
    rows = lengths if schedule == "ragged" else np.full(s.N, T, np.int32)
    sched = schedules[run]
    r = dict(tokens=int(rows.sum()), steps=sched.steps, keys=sched.page_keys + sched.prompt_keys,
             live_keys=sched.live_keys, live=sched.live_keys * bpt)
    if method == "engine":
      r["kv"], r["kv_in_place"] = kv.engine(sched, M)
      r["step_bytes"] = sched.steps * kv.engine_fixed + r["kv_in_place"]
      r.update(pages_peak=sched.pages_peak, preempted=sched.preempted,
               peak_bytes=prompts + sched.pages_peak * s.p * bpt,
               pool_bytes=prompts + M * s.p * bpt)
    else:
      r.update(kv=kv.lockstep(sched), peak_bytes=prompts + s.N * max(T - 1, 1) * bpt)
      r["kv_in_place"], r["pool_bytes"] = r["kv"], r["peak_bytes"]
      r["step_bytes"] = sched.steps * kv.lockstep_fixed + r["kv"]
    out[run] = r
  return out


def schedules_of(s: Shapes, T: int, lengths: np.ndarray, kernels: tuple = ("xla", 1, 1)) -> dict:
  """{run: Schedule} of RUNS, the engine's replayed (None where it would preempt)."""
  out = {}
  for schedule, rows in (("ragged", lengths), ("full", np.full(s.N, T, np.int32))):
    try:
      out[f"engine {schedule}"] = kv_lib.simulate(rows, T, S=s.S, M=s.M(T), p=s.p, G=s.G,
                                                  P=s.P, kernels=kernels)
    except ValueError:
      out[f"engine {schedule}"] = None
    out[f"generate {schedule}"] = kv_lib.lockstep_schedule(rows, T, G=s.G, P=s.P)
  return out


def mib(x) -> str:
  return f"{x / 2**20:,.1f}"


def table(fig: dict, seconds: dict | None, bpt: int, bandwidth: float | None = None) -> list[str]:
  """The rows of one T: per run its tokens, time, steps, keys read against the live
  ones, KV bytes per token and against the live KV, its KV memory, and with
  `bandwidth` (bytes/s) its bytes' share of it over its seconds."""
  head = (f"  {'run':<16} {'tokens':>9} {'seconds':>8} {'tok/s':>7} {'steps':>6} "
          f"{'keys/live':>9} {'KV MB/tok':>9} {'x live':>7} {'in place':>8} {'peak MiB':>9} "
          f"{'alloc MiB':>9}" + (f" {'% HBM':>6}" if bandwidth else ""))
  lines = [head]
  for run, r in fig.items():
    sec = seconds[run][0] if seconds else None
    cells = [f"  {run:<16}", f"{r['tokens']:>9,}", f"{sec:>8.2f}" if sec else f"{'-':>8}",
             f"{r['tokens'] / sec:>7,.0f}" if sec else f"{'-':>7}", f"{r['steps']:>6,}",
             f"{r['keys'] / r['live_keys']:>9.2f}", f"{r['kv'] / r['tokens'] / 1e6:>9.2f}",
             f"{r['kv'] / r['live']:>7.2f}", f"{r['kv_in_place'] / r['live']:>8.2f}",
             f"{mib(r['peak_bytes']):>9}", f"{mib(r['pool_bytes']):>9}"]
    if bandwidth:
      cells.append(f"{100 * r['step_bytes'] / sec / bandwidth:>6.1f}" if sec else f"{'-':>6}")
    lines.append(" ".join(cells))
  rag = fig["engine ragged"]
  lines.append(f"  live KV of the ragged rows: {rag['live'] / rag['tokens'] / 1e6:.4g} MB per "
               f"generated token ({bpt:,} B per token of context)")
  return lines


def kv_line(name: str, kv: kv_lib.StepKV, bpt: int, s: Shapes) -> str:
  """The slopes against one read of each key and value."""
  return (f"  {name}, bytes per key read (x one read of its K and V): engine "
          f"{kv.page_key / bpt:.2f} per page key, {kv.engine_prompt_key / bpt:.2f} per prompt key, "
          f"page writes charged {kv.write_page / (s.p * bpt):.2f} per pool token a step; lockstep "
          f"{kv.slot_key / bpt:.2f} per completion slot, {kv.lockstep_prompt_key / bpt:.2f} per "
          "prompt key")

def ratio(a, b):
  return None if a is None or b is None else a / b


def check_replay(run: str, stats, replay: kv_lib.Schedule | None) -> None:
  """The engine's EngineStats against the replay: steps and pages_peak exactly, keys read
  and live to float32's rounding (the engine sums them in float32, one add a step: each
  rounds by at most half an ulp of the sum, 2**-24 of it)."""
  if replay is None:
    return
  got = (int(stats.steps), int(stats.pages_peak), int(stats.preempted))
  want = (replay.steps, replay.pages_peak, replay.preempted)
  keys = (float(stats.keys_read), float(stats.live_keys))
  want_keys = (replay.page_keys + replay.prompt_keys, replay.live_keys)
  if got != want or not np.allclose(keys, want_keys, rtol=max(1e-6, got[0] * 2.0**-24)):
    raise AssertionError(f"{run}: EngineStats (steps, pages_peak, preempted) {got}, keys (read, "
                         f"live) {keys}; the replay {want}, {want_keys}")


def summary(T: int, s: Shapes, fig: dict, seconds: dict | None,
            bandwidth: float | None = None) -> dict:
  """One T's JSON object: the ratios the issue asks for, then every run's figures
  (with `bandwidth`, bytes/s: each run's bytes over its seconds, as its share)."""
  tok_s = ({run: fig[run]["tokens"] / seconds[run][0] for run in RUNS} if seconds
           else dict.fromkeys(RUNS))
  runs = {}
  for run, r in fig.items():
    runs[run] = dict(tokens=r["tokens"], seconds=seconds[run][0] if seconds else None,
                     tokens_per_s=tok_s[run], steps=r["steps"],
                     keys_vs_live=r["keys"] / r["live_keys"],
                     kv_bytes_per_token=r["kv"] / r["tokens"], kv_vs_live=r["kv"] / r["live"],
                     kv_in_place_vs_live=r["kv_in_place"] / r["live"],
                     kv_peak_bytes=r["peak_bytes"], kv_allocated_bytes=r["pool_bytes"])
    if "pages_peak" in r:
      runs[run].update(pages_peak=r["pages_peak"], preempted=r["preempted"])
    if bandwidth and seconds:
      runs[run]["bandwidth_share"] = r["step_bytes"] / seconds[run][0] / bandwidth
  rag, gen = fig["engine ragged"], fig["generate ragged"]
  # Tokens per byte moved (steps x the fixed bytes + KV in place): the ratios a
  # device bound by its memory bandwidth would show, from the compiled steps alone.
  per_byte = {run: fig[run]["tokens"] / fig[run]["step_bytes"] for run in RUNS}
  modelled = dict(
      ragged_vs_full=per_byte["engine ragged"] / per_byte["engine full"],
      ragged_vs_generate=per_byte["engine ragged"] / per_byte["generate ragged"],
      full_vs_generate=per_byte["engine full"] / per_byte["generate full"])
  return dict(
      T=T,
      ragged_vs_full=ratio(tok_s["engine ragged"], tok_s["engine full"]),
      ragged_vs_generate=ratio(tok_s["engine ragged"], tok_s["generate ragged"]),
      full_vs_generate=ratio(tok_s["engine full"], tok_s["generate full"]),
      kv_bytes_vs_live=rag["kv"] / rag["live"],
      kv_bytes_vs_live_in_place=rag["kv_in_place"] / rag["live"],
      generate_kv_bytes_vs_live=gen["kv"] / gen["live"], bandwidth_bound=modelled,
      bandwidth_bytes_per_s=bandwidth,
      shapes=dict(dataclasses.asdict(s), N=s.N, M=s.M(T)), runs=runs)




# B, G, P, S, p, T list, reps by setting; flags given override them.
PAGE = engine_lib.EngineConfig().page_size
SETTINGS = {
    "quick": dict(model="tiny", prompts=2, groups=8, prompt_len=8, slots=4, page_size=8, T="32",
                  reps=1),
    "cpu": dict(model="small", prompts=4, groups=8, prompt_len=32, slots=8, page_size=PAGE,
                T="256,1024", reps=2),
    "gpu": dict(model=QWEN, dtype="bfloat16", prompts=32, groups=8, prompt_len=128, slots=256,
                page_size=PAGE, T="4096", reps=1),
}
SETTINGS["tpu"] = SETTINGS["gpu"]
# --compile-only's shapes (qwen2_tiny at --quick's).
COMPILED = dict(prompts=32, groups=8, prompt_len=128, slots=32, page_size=PAGE, T="1024,4096")


def add_arguments(parser) -> None:
  parser.add_argument("--prompts", type=int, help="B")
  parser.add_argument("--groups", type=int, help="G samples per prompt")
  parser.add_argument("--prompt-len", type=int, help="P")
  parser.add_argument("--slots", type=int, help="S decode slots of the engine")
  parser.add_argument("--page-size", type=int, help="p tokens per page")
  parser.add_argument("--pages", type=int, default=0,
                      help="M pages in the pool; 0: every slot at full length, S*ceil(T/p)")
  parser.add_argument("--T", help="completion lengths, comma-separated")
  parser.add_argument("--reps", type=int, help="timed runs of each; the best is reported")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sigma", type=float, default=1.0,
                      help="of the lognormal lengths (median T/8), in log space")
  parser.add_argument("--model", help="'small', 'tiny' or a grpojax.models preset (its shapes, "
                      "random weights)")
  parser.add_argument("--dtype", help="the timed model's weights and compute")
  parser.add_argument("--kernels", choices=ops.BACKENDS, help="default: the platform's")
  parser.add_argument("--floor", action="store_true",
                      help="cost the runs at the floor (StepKV.floor), with each one's share "
                      "of the measured bandwidth; the default on an accelerator")
  parser.add_argument("--compile-only", action="store_true",
                      help="the Qwen2.5-0.5B figures from compiled steps, nothing run")
  parser.add_argument("--targets", default="",
                      help="with --compile-only, also these compilers (tpu = tpu-v5e, h100 = "
                      "h100-80gb), comma-separated")


def settings(args, base: dict) -> dict:
  """`base` with the flags given."""
  names = ("model", "dtype", "prompts", "groups", "prompt_len", "slots", "page_size", "T", "reps")
  out = dict(base, **{n: getattr(args, n) for n in names if getattr(args, n) is not None})
  for n in ("prompts", "groups", "prompt_len", "slots", "page_size"):
    if out.get(n, 1) < 1:
      raise SystemExit(f"--{n.replace('_', '-')} must be >= 1")
  return out


def shapes(d: dict, pages: int) -> Shapes:
  return Shapes(d["prompts"], d["groups"], d["prompt_len"], d["slots"], d["page_size"], pages)


def run(args) -> dict:
  log = functools.partial(print, flush=True)
  log(f"lengths lognormal (median T/8, sigma {args.sigma}), seed {args.seed}")
  results = compile_only(args, log) if args.compile_only else timed(args, log)
  out = {"by_T": results}
  last = results[-1] if results else {}
  for key in ("ragged_vs_full", "ragged_vs_generate", "full_vs_generate", "kv_bytes_vs_live"):
    out[key] = last.get(key)
  return out


def timed(args, log) -> list[dict]:
  """The four runs at each T, with their KV figures."""
  d = settings(args, SETTINGS["quick" if args.quick else args.device])
  s = shapes(d, args.pages)
  cfg, weights = common.random_model(d["model"], args.seed, d.get("dtype"), args.kernels)
  xla_cfg = cfg.replace(kernels="xla")
  bpt = kv_lib.bytes_per_token(cfg)
  n_params = sum(int(np.prod(w.shape)) for w in weights.values())
  weight_bytes = sum(int(w.nbytes) for w in weights.values())
  floor = args.floor or jax.default_backend() != "cpu"
  bandwidth = common.ceilings(args.quick, jnp.float32)[1] if floor else None
  Ts = [int(t) for t in str(d["T"]).split(",")]
  log(f"{d['model']} model: {n_params / 1e6:.2f}M parameters, {cfg.dtype}, "
      f"kernels={cfg.kernels}, on {jax.devices()[0].device_kind}; B={s.B} x G={s.G} = {s.N} "
      f"rows, P={s.P}, S={s.S}, p={s.p}, pages={s.pages or 'auto'}, T={Ts}, best of {d['reps']}")
  if bandwidth:
    log(f"memory bandwidth (a copy, read + write): {bandwidth / 1e9:,.0f} GB/s")
  out = []
  t0 = time.perf_counter()
  for T in Ts:
    lengths = draw_lengths(args.seed, s.N, T, args.sigma)
    M = s.M(T)
    log(f"\nT={T}: {s.N} rows of {int(lengths.sum()):,} tokens (median {int(np.median(lengths))}, "
        f"max {int(lengths.max())}); engine S={s.S}, M={M} pages of {s.p}")
    seconds = timed_runs(cfg, weights, s, T, lengths, reps=d["reps"], seed=args.seed, log=log)
    sched = schedules_of(s, T, lengths, kv_lib.attention_of(cfg))
    for run_name in ("engine ragged", "engine full"):
      check_replay(run_name, seconds[run_name][1], sched[run_name])
      if sched[run_name] is None:  # preempted: the replay does not follow; EngineStats' keys
        stats = seconds[run_name][1]
        sched[run_name] = kv_lib.Schedule(int(stats.steps), int(stats.pages_peak),
                                          int(stats.preempted), int(stats.keys_read), 0,
                                          int(stats.live_keys))
        log(f"  {run_name}: preempted, not replayed; its keys read are EngineStats' (pages and "
            "prompts together, costed as page keys)")
    kv = (kv_lib.StepKV.floor(bpt, weight_bytes) if floor
          else kv_lib.step_kv(xla_cfg, B=s.B, G=s.G, P=s.P, S=s.S, T=T, p=s.p, M=M))
    fig = figures(kv, bpt, s, T, lengths, sched)
    log("\n".join(table(fig, seconds, bpt, bandwidth)))
    log(f"  bytes: the floor, each key read once and the weights ({mib(weight_bytes)} MiB) "
        "once a step; % HBM: that over the seconds and the copy's bandwidth" if floor
        else kv_line("XLA:CPU", kv, bpt, s))
    r = summary(T, s, fig, seconds, bandwidth)
    r.update(model=d["model"], dtype=cfg.dtype, kernels=cfg.kernels,
             bytes="floor" if floor else "xla")
    log(f"  engine ragged / full {r['ragged_vs_full']:.2f}x, ragged / generate "
        f"{r['ragged_vs_generate']:.2f}x, full / generate {r['full_vs_generate']:.2f}x; "
        f"KV read / live: engine {r['kv_bytes_vs_live']:.2f} "
        f"({r['kv_bytes_vs_live_in_place']:.2f} in place), generate "
        f"{r['generate_kv_bytes_vs_live']:.2f}  [{time.perf_counter() - t0:.0f} s]")
    out.append(r)
  return out


def compile_only(args, log) -> list[dict]:
  """The figures at Qwen2.5-0.5B's shapes (qwen2_tiny's with --quick) from compiled steps
  and replayed schedules, per compiler and kernel backend."""
  d = settings(args, SETTINGS["quick"] if args.quick else COMPILED)
  sq = shapes(d, args.pages)
  name = "qwen2_tiny" if args.quick else QWEN
  qcfg = models.get_preset(name).replace(dtype="bfloat16", kernels="xla")
  qbpt = kv_lib.bytes_per_token(qcfg)
  compilers = ["cpu", *(TARGETS.get(t, t) for t in args.targets.split(",") if t)]
  log(f"{name} (bf16, compile-only; schedules replayed): B={sq.B} x G={sq.G} = {sq.N} rows, "
      f"P={sq.P}, S={sq.S}, p={sq.p}, pages={sq.pages or 'auto'}, {qbpt:,} B of KV per token")
  out = []
  for T in [int(t) for t in str(d["T"]).split(",")]:
    lengths = draw_lengths(args.seed, sq.N, T, args.sigma)
    sched = schedules_of(sq, T, lengths)
    if None in sched.values():
      log(f"T={T}: the engine would preempt with {sq.M(T)} pages, which the replay does "
          "not follow: no figures")
      continue
    per_compiler = {}
    for target in compilers:
      if target != "cpu" and not targets.available(target):
        log(f"  {target}: skipped, its compiler is not installed")
        continue
      device = None if target == "cpu" else targets.devices(target, chips=1)[0]
      # XLA's paged attention, and on a TPU or GPU also the platform's pool kernel.
      for kernels in ["xla", *KERNELS.get(target, ())]:
        kcfg = qcfg.replace(kernels=kernels)
        kernel = kv_lib.pool_kernel(kcfg, sq.p)
        if kernels != "xla" and not kernel:
          log(f"  {target}: no {kernels} kernel at these sizes (ops.paged_backend), XLA's above")
          continue
        ksched = schedules_of(sq, T, lengths, kv_lib.attention_of(kcfg)) if kernel else sched
        try:
          with jax.default_device(device) if device is not None else contextlib.nullcontext():
            kv = kv_lib.step_kv(kcfg, B=sq.B, G=sq.G, P=sq.P, S=sq.S, T=T, p=sq.p, M=sq.M(T),
                                device=device)
        except (RuntimeError, AssertionError) as e:  # refused, or the pool moved
          log(f"T={T}, {target} ({kernels}): {e}")
          continue
        fig = figures(kv, qbpt, sq, T, lengths, ksched)
        where = f"{target}:{kernels}" if kernel else target
        log(f"T={T}, compiled for {where}:")
        log("\n".join(table(fig, None, qbpt)))
        log(kv_line(where, kv, qbpt, sq))
        q = summary(T, sq, fig, None)
        bb = q["bandwidth_bound"]
        log(f"  bound by bandwidth (tokens per byte moved; a step's fixed bytes: engine "
            f"{mib(kv.engine_fixed)} MiB, lockstep {mib(kv.lockstep_fixed)} MiB): engine "
            f"ragged / full {bb['ragged_vs_full']:.2f}x, ragged / generate "
            f"{bb['ragged_vs_generate']:.2f}x, full / generate {bb['full_vs_generate']:.2f}x")
        per_compiler[where] = q
    out.append(dict(T=T, model=name, kv_bytes_vs_live=per_compiler.get("cpu", {}).get(
        "kv_bytes_vs_live"), compilers=per_compiler))
  return out
