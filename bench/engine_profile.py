"""Where a decode step's time goes on the device: the engine's run under JAX's profiler,
its device kernels summed per step against the step's wall time.

One row runs to T and the other N - 1 stop at their second token (as
bench/engine_overhead.py), so nearly every step has one live row: the step's fixed
cost. State "full" runs every row to T instead. The run is compiled and warmed up
first; only the second call is traced. From the trace (perfetto_trace.json.gz):

  wall ms/step     the traced call's seconds over its T - 1 steps
  kernels/step     device kernel events over the steps
  busy ms/step     the union of the kernels' intervals on the device, over the steps
  idle             wall - busy: launches, host round trips between loop trips;
                   its gaps over 20 us by the kernels on either side
  kinds, top       device time by kind of kernel (matmul, attention, ...) and by kernel

  python bench/engine_profile.py --T 512 [--states one,full] [--out DIR]
  python bench/engine_profile.py --model small --kernels xla --T 16   # the script's own test (CPU)
  python bench/engine_profile.py --trace trace-one-gpu.json.gz --steps 255 --wall-ms 3.21
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.sampling import engine as engine_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import QWEN, SAMPLING, bench_model  # noqa: E402


def trace_events(log_dir: str) -> list[dict]:
  """The X (complete) events of the one perfetto trace under `log_dir`, each with its
  process's name as "process"."""
  path, = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return [dict(e, process=names.get(e.get("pid"), "")) for e in events if e.get("ph") == "X"]


def union_us(intervals) -> float:
  """The length of the union of (start, end) intervals."""
  total, end = 0.0, -np.inf
  for s, e in sorted(intervals):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def kind(name: str) -> str:
  """A kernel's part of a decode step, by its name on an NVIDIA GPU."""
  if name.startswith(("gemm_fusion", "nvjet", "cutlass", "sm90_xmma")):
    return "matmul"
  if "paged_attention" in name:
    return "attention"
  if name.startswith("input_reduce_fusion") or "gather_reduce" in name or name.startswith("sort"):
    return "draw and bookkeeping reductions"
  if name.lower().startswith("memcpy"):
    return "copies"
  return "other fusions"


def summarize(events: list[dict], steps: int, wall_s: float, top: int = 25) -> dict:
  """Per-step figures from a trace's device events (processes named /device:...): the
  kernels by name and by kind, the device's idle time between kernels, and the gaps
  over 20 us by the kernels on either side (where the host holds the device up)."""
  device = sorted((e for e in events if e["process"].startswith("/device:")),  # none on CPU
                  key=lambda e: e["ts"])
  spans = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in device]
  by_name = collections.defaultdict(lambda: [0, 0.0])
  by_kind = collections.defaultdict(lambda: [0, 0.0])
  for e in device:
    for table, key in ((by_name, e["name"]), (by_kind, kind(e["name"]))):
      table[key][0] += 1
      table[key][1] += e.get("dur", 0.0)
  gaps = collections.defaultdict(list)
  for (_, end), after, before in zip(spans, device[1:], device):
    if after["ts"] - end > 20:
      gaps[f"{before['name']} -> {after['name']}"].append(after["ts"] - end)
  busy = union_us(spans) if spans else 0.0
  first, last = (spans[0][0], max(e for _, e in spans)) if spans else (0.0, 0.0)
  host = collections.Counter(e["name"] for e in events if not e["process"].startswith("/device:"))
  per = lambda us: us / 1e3 / steps  # noqa: E731  microseconds in all -> ms a step
  return dict(
      steps=steps, wall_ms_per_step=1e3 * wall_s / steps,
      device_span_ms_per_step=per(last - first), busy_ms_per_step=per(busy),
      kernels_per_step=len(device) / steps,
      kinds={k: (c / steps, per(d)) for k, (c, d) in
             sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
      gaps_over_20us={k: (len(v) / steps, per(sum(v))) for k, v in
                      sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:8]},
      top=[(n, c / steps, per(d)) for n, (c, d) in
           sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
      host_top=host.most_common(15))


def report(s: dict) -> None:
  print(f"  wall {s['wall_ms_per_step']:.3f} ms/step; device span "
        f"{s['device_span_ms_per_step']:.3f}, busy {s['busy_ms_per_step']:.3f} ms/step; "
        f"{s['kernels_per_step']:.1f} kernels/step; "
        f"idle {s['wall_ms_per_step'] - s['busy_ms_per_step']:.3f} ms/step")
  print(f"  {'kind':<40} {'/step':>6} {'ms/step':>8}")
  for name, (count, ms) in s["kinds"].items():
    print(f"  {name:<40} {count:>6.1f} {ms:>8.3f}")
  print(f"  {'idle gaps over 20 us, between':<70} {'/step':>6} {'ms/step':>8}")
  for name, (count, ms) in s["gaps_over_20us"].items():
    print(f"  {name[:70]:<70} {count:>6.2f} {ms:>8.3f}")
  print(f"  {'kernel':<70} {'/step':>6} {'ms/step':>8}")
  for name, count, ms in s["top"]:
    print(f"  {name[:70]:<70} {count:>6.2f} {ms:>8.4f}")
  print("  host events:", ", ".join(f"{n[:40]} x{c}" for n, c in s["host_top"]), flush=True)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--T", type=int, default=512)
  parser.add_argument("--model", default=QWEN)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--kernels", default="gpu")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--slots", type=int, default=256)
  parser.add_argument("--states", default="one,full", help="one (one row runs), full (all)")
  parser.add_argument("--out", default="", help="keep the trace and the summary here")
  parser.add_argument("--trace", help="summarize this saved perfetto_trace.json.gz instead "
                      "(with --steps and --wall-ms, the run's, from its profile JSON)")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--wall-ms", type=float, help="the traced run's ms a step")
  a = parser.parse_args(argv)
  if a.trace:
    with tempfile.TemporaryDirectory() as d:
      os.makedirs(os.path.join(d, "t"))
      shutil.copy(a.trace, os.path.join(d, "t", "perfetto_trace.json.gz"))
      s = summarize(trace_events(d), a.steps, a.wall_ms * a.steps / 1e3)
    report(s)
    return [s]
  B, G, P, T = a.prompts, a.groups, 128 if a.model != "small" else 16, a.T
  N = B * G
  cfg, weights = bench_model(a.model, 0, a.dtype, a.kernels)
  V = cfg.vocab_size
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, V - 1, (B, P)), jnp.int32)
  conf = engine_lib.EngineConfig(slots=min(a.slots, N), page_size=128 if a.model != "small" else 8)
  summaries = []
  for state in a.states.split(","):
    stop = np.full(N, T if state == "full" else 2, np.int32)
    stop[0] = T

    def call(stop=stop):
      out = engine_lib.generate(cfg, weights, prompts, jnp.ones_like(prompts), engine=conf,
                                rng=jax.random.key(0), num_samples=G, max_new_tokens=T,
                                sampling=SAMPLING, eos_ids=(V - 1,), pad_id=0,
                                stop_at=jnp.asarray(stop))
      got = np.asarray(out.lengths)
      assert np.array_equal(got, stop), "rows did not stop where forced"

    call()
    log_dir = tempfile.mkdtemp(prefix="engine_profile_")
    jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
    t = time.perf_counter()
    call()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    s = summarize(trace_events(log_dir), T - 1, wall)
    s.update(device=jax.devices()[0].device_kind, model=a.model, kernels=a.kernels, state=state,
             T=T, N=N, slots=conf.slots, xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(f"{s['device']}: {a.model} {a.dtype}, kernels={a.kernels}, state={state}, N={N}, "
          f"S={conf.slots}, T={T}; XLA_FLAGS={s['xla_flags']!r}")
    report(s)
    if a.out:
      os.makedirs(a.out, exist_ok=True)
      tag = f"{state}-{a.kernels}"
      with open(os.path.join(a.out, f"profile-{tag}.json"), "w") as f:
        json.dump(s, f, indent=1, default=str)
      trace, = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
      if os.path.getsize(trace) < 15e6 and state == a.states.split(",")[0]:  # $OUT: 16 MiB a file
        shutil.copy(trace, os.path.join(a.out, f"trace-{tag}.json.gz"))
    shutil.rmtree(log_dir, ignore_errors=True)
    summaries.append(s)
  return summaries


if __name__ == "__main__":
  main()
