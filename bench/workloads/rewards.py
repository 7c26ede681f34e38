"""Reward throughput: math answers and sandboxed code runs, in process and through the
worker pool.

Completions per second for:
  - math: `math_accuracy_reward` on a GSM8K/MATH-like mix (plain numbers, LaTeX
    fractions, radicals, intervals, algebra; about half right), in this process and
    through `HostRewards` (a persistent pool of --workers);
  - code: `code_reward` on short programs (right, wrong, raising) through the pool at
    --workers and twice as many, each in its own sandbox (namespaces, cgroup,
    seccomp, two throwaway uids: the program and its tests in separate
    interpreters); and one sandboxed run at a time in this process: wall-clock and
    CPU milliseconds per run (CPU of the sandbox's processes, all of them);
  - with --hostile, `MathAccuracy` on batches of 256 answers with 8 hostile ones
    among them (nested powers and factorials, 100 KB strings): 248 of the mix, then
    248 of Math-Verify's own test answers (tests/data), each batch three times
    (the median), and the slowest single verdict.
Start-up (spawning workers, importing sympy) is excluded: one warm-up batch runs
first, as in training. The CPU alone works here; --device changes nothing.
--quick: 64 math answers, 8 programs on one worker, 4 runs one at a time.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import time

import numpy as np

from grpojax.rewards import code_reward, math_accuracy_reward
from grpojax.rewards.base import compute_rewards
from grpojax.rewards.math import MathAccuracy
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sandbox import run_tests, sandbox_isolation

CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "tests", "data", "math_verify_cases.json")
SYMBOLIC = [  # (gold, right prediction, wrong prediction)
    (r"\frac{3}{4}", "0.75", r"\frac{4}{3}"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", r"\sqrt{2}"),
    (r"2\sqrt{3}", r"\sqrt{12}", r"3\sqrt{2}"),
    (r"(1, 2]", r"(1,2]", r"[1,2]"),
    (r"\{1, 2\}", r"\{2, 1\}", r"\{1, 3\}"),
    (r"x^2+2x+1", r"(x+1)^2", r"(x+1)^3"),
    (r"\frac{\pi}{3}", r"\pi/3", r"\pi/6"),
    (r"3 + 2\sqrt{2}", r"(1+\sqrt{2})^2", r"3 + \sqrt{2}"),
]
PROGRAMS = [
    ("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5\nassert add(-1, 1) == 0"),
    ("def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5"),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
     "    return a\n",
     "assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]"),
    ("def rev(s):\n    return s[::-1]\n", "assert rev('abc') == 'cba'"),
    ("def rev(s):\n    raise NotImplementedError\n", "assert rev('abc') == 'cba'"),
    ("import math\ndef hyp(a, b):\n    return math.hypot(a, b)\n", "assert hyp(3, 4) == 5"),
    ("def srt(x):\n    return sorted(x)\n", "assert srt([3, 1, 2]) == [1, 2, 3]"),
    ("def srt(x) return x\n", "assert srt([3, 1, 2]) == [1, 2, 3]"),
]
HOSTILE_MATH = ["The answer is $(2^{99999})^{99999}$.", r"\boxed{(9999!)!}",
                "(2^99999)^99999", "x" * 100_000, r"\[ x" * 25_000, "1 " * 50_000,
                "$" * 100_000, r"\boxed{" * 14_000 + "1" + "}" * 14_000]


def add_arguments(parser) -> None:
  parser.add_argument("--math", type=int, help="math completions (default 1024)")
  parser.add_argument("--code", type=int, help="code completions (default 256)")
  parser.add_argument("--workers", type=int, help="the pool's worker processes (default 2)")
  parser.add_argument("--hostile", action="store_true", help="also math with hostile answers")


def math_batch(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
  """Completions and golds: 3/4 plain numbers (GSM8K), 1/4 LaTeX (MATH)."""
  rng = random.Random(seed)
  completions, golds = [], []
  for i in range(n):
    right = rng.random() < 0.5
    if i % 4 < 3:
      gold = rng.randint(1, 10 ** rng.randint(1, 6))
      pred = gold if right else gold + rng.choice([-1, 1, 10])
      style = rng.choice([f"#### {pred:,}", f"\\boxed{{{pred}}}", f"The answer is {pred}."])
      completions.append(f"Step 1: think. Step 2: compute.\n{style}")
      golds.append(f"Some rationale.\n#### {gold}")
    else:
      gold, good, bad = rng.choice(SYMBOLIC)
      completions.append(f"Working... so the answer is $\\boxed{{{good if right else bad}}}$.")
      golds.append(gold)
  return completions, golds


def decode_chars(rows):
  return ["".join(map(chr, row)) for row in rows]  # host_batch's tokens are code points


def host_batch(texts, columns):
  """(example ids, tokens, mask, examples) of texts, a token per character."""
  ids = np.arange(len(texts), dtype=np.int32)
  tokens = np.zeros((len(texts), max(len(t) for t in texts)), np.int32)
  mask = np.zeros_like(tokens)
  for r, t in enumerate(texts):
    tokens[r, :len(t)], mask[r, :len(t)] = [ord(c) for c in t], 1
  examples = [{"prompt": "", **{k: v[r] for k, v in columns.items()}} for r in range(len(texts))]
  return ids, tokens, mask, examples


def bench_math(n: int, workers: int) -> dict:
  completions, golds = math_batch(n)
  compute_rewards([math_accuracy_reward], [""] * 16, completions[:16], {"answer": golds[:16]})
  t = time.perf_counter()
  out = compute_rewards([math_accuracy_reward], [""] * n, completions, {"answer": golds})
  serial = time.perf_counter() - t
  ids, tokens, mask, examples = host_batch(completions, {"answer": golds})
  with HostRewards([math_accuracy_reward], decode=decode_chars, lookup=examples.__getitem__,
                   num_workers=workers) as host:
    host.compute(ids[:64], tokens[:64], mask[:64])  # warm-up: spawn, import sympy
    t = time.perf_counter()
    pooled = host.compute(ids, tokens, mask)
    pool_s = time.perf_counter() - t
  assert np.array_equal(out.rewards, pooled.rewards, equal_nan=True)
  r = dict(math_accuracy=float(np.nanmean(out.rewards)), math_in_process_per_s=n / serial,
           math_pool_per_s=n / pool_s)
  print(f"math  accuracy {r['math_accuracy']:.3f} (about half right by construction)")
  print(f"math  in-process          : {n} in {serial:.2f} s = {n / serial:,.0f}/s")
  print(f"math  pool ({workers} workers)     : {n} in {pool_s:.2f} s = {n / pool_s:,.0f}/s",
        flush=True)
  return r


def bench_code(n: int, workers: list[int]) -> dict:
  rows = [PROGRAMS[i % len(PROGRAMS)] for i in range(n)]
  texts = [f"```python\n{p}```" for p, _ in rows]
  ids, tokens, mask, examples = host_batch(texts, {"tests": [t for _, t in rows]})
  out = {}
  for w in workers:
    with HostRewards([code_reward], decode=decode_chars, lookup=examples.__getitem__,
                     num_workers=w) as host:
      host.compute(ids[:8], tokens[:8], mask[:8])
      t = time.perf_counter()
      rewards = host.compute(ids, tokens, mask).rewards
      seconds = time.perf_counter() - t
    out[f"code_pool_{w}_per_s"] = n / seconds
    out["code_passed"] = int(np.nansum(rewards))
    print(f"code  pool ({w} workers)     : {n} in {seconds:.2f} s = {n / seconds:,.1f}/s  "
          f"({out['code_passed']} passed)", flush=True)
  return out


def bench_code_latency(n: int) -> dict:
  """One run at a time: the sandbox's own cost, without pool or queueing."""
  program, tests = PROGRAMS[0]
  run_tests(program, tests)
  walls = []
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  for _ in range(n):
    t = time.perf_counter()
    assert run_tests(program, tests).passed
    walls.append(time.perf_counter() - t)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  r = dict(code_run_wall_ms=1000 * statistics.median(walls), code_run_cpu_ms=1000 * cpu / n)
  print(f"code  one run at a time    : {r['code_run_wall_ms']:.1f} ms wall (median of {n}), "
        f"{r['code_run_cpu_ms']:.1f} ms CPU per run", flush=True)
  return r


def bench_math_hostile() -> dict:
  with open(CASES, encoding="utf-8") as f:
    suite = json.load(f)["cases"]
  batches = {"mix": math_batch(248),
             "math_verify": ([c["pred"] for c in suite[:248]], [c["gold"] for c in suite[:248]])}
  reward = MathAccuracy()
  out = {}
  for name, (completions, golds) in batches.items():
    completions = list(completions) + HOSTILE_MATH
    golds = list(golds) + ["1"] * len(HOSTILE_MATH)
    reward(completions=completions, answer=golds)  # warm: workers up, sympy's caches
    times = []
    for _ in range(3):
      t = time.perf_counter()
      verdicts = reward(completions=completions, answer=golds)
      times.append(time.perf_counter() - t)
    assert verdicts[-len(HOSTILE_MATH):] == [0.0] * len(HOSTILE_MATH)
    slowest = 0.0
    for c, g in zip(completions, golds):
      t = time.perf_counter()
      reward(completions=[c], answer=[g])
      slowest = max(slowest, time.perf_counter() - t)
    out.update({f"hostile_{name}_s": statistics.median(times),
                f"hostile_{name}_slowest_ms": 1000 * slowest})
    print(f"math  {name:>12}: 256 answers (8 hostile) in {statistics.median(times):.2f} s "
          f"(median of 3), slowest single verdict {1000 * slowest:.0f} ms", flush=True)
  return out


def run(args) -> dict:
  math_n = args.math or (64 if args.quick else 1024)
  code_n = args.code or (8 if args.quick else 256)
  workers = args.workers or (1 if args.quick else 2)
  isolation = sandbox_isolation()
  print(f"cpus={os.cpu_count()} sandbox isolation={','.join(isolation)}", flush=True)
  out = dict(cpus=os.cpu_count(), isolation=list(isolation))
  if math_n:
    out.update(bench_math(math_n, workers))
  if code_n:
    out.update(bench_code(code_n, [workers] if args.quick else [workers, 2 * workers]))
    out.update(bench_code_latency(4 if args.quick else 40))
  if args.hostile:
    out.update(bench_math_hostile())
  return out
