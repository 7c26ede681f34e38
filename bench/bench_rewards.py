"""Reward throughput: math answers and sandboxed code runs through the worker pool.

    python bench/bench_rewards.py [--math 1024] [--code 256] [--workers 2]
    python bench/bench_rewards.py --against ed51e61 [--runs 200]
    python bench/bench_rewards.py --hostile

Prints completions per second for:
  - math: `math_accuracy_reward` on a GSM8K/MATH-like mix (plain numbers,
    LaTeX fractions, radicals, intervals, algebra; about half right), in
    this process and through `HostRewards` (persistent pool);
  - code: `code_reward` on short programs (right, wrong, raising) through the
    pool, each in its own sandbox (namespaces, cgroup, seccomp, two
    throwaway uids: the program and its tests in separate interpreters);
    and one sandboxed run at a time in this process: wall-clock and CPU
    milliseconds per run (CPU of the sandbox's processes, all of them).
Start-up (spawning workers, importing sympy) is excluded: one warm-up batch
runs first, as it would in training.

`--hostile` instead times `MathAccuracy` on batches of 256 answers with 8
hostile ones among them (nested powers and factorials, 100 KB strings):
248 of the GSM8K/MATH mix, then 248 of Math-Verify's own test answers
(long LaTeX, in tests/data), each batch three times, and the slowest single
verdict.

`--against REV` instead compares this checkout's sandbox with the one at git
revision REV (its `_sandbox*.py`, run by this checkout's trainer side):
sandboxed runs of the programs above, one at a time, the two sandboxes
interleaved run by run, in alternating order, so that a busy machine (or
the previous run's teardown) slows both alike.
"""

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpojax.rewards import code_reward, math_accuracy_reward  # noqa: E402
from grpojax.rewards.base import compute_rewards  # noqa: E402
from grpojax.rewards.runtime.host import HostRewards  # noqa: E402
from grpojax.sandbox import run_tests, runner, sandbox_isolation  # noqa: E402

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


def math_batch(n, seed=0):
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


PROGRAMS = [
    ("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5\nassert add(-1, 1) == 0"),
    ("def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5"),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     "assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]"),
    ("def rev(s):\n    return s[::-1]\n", "assert rev('abc') == 'cba'"),
    ("def rev(s):\n    raise NotImplementedError\n", "assert rev('abc') == 'cba'"),
    ("import math\ndef hyp(a, b):\n    return math.hypot(a, b)\n", "assert hyp(3, 4) == 5"),
    ("def srt(x):\n    return sorted(x)\n", "assert srt([3, 1, 2]) == [1, 2, 3]"),
    ("def srt(x) return x\n", "assert srt([3, 1, 2]) == [1, 2, 3]"),
]


def rate(n, seconds):
    return f"{n} in {seconds:.2f} s = {n / seconds:,.0f}/s"


def decode_chars(rows):
    return ["".join(map(chr, row)) for row in rows]  # host_batch's tokens are code points


def host_batch(texts, columns):
    ids = np.arange(len(texts), dtype=np.int32)
    length = max(len(t) for t in texts)
    tokens = np.zeros((len(texts), length), np.int32)
    mask = np.zeros_like(tokens)
    for r, t in enumerate(texts):
        tokens[r, :len(t)], mask[r, :len(t)] = [ord(c) for c in t], 1
    examples = [{"prompt": "", **{k: v[r] for k, v in columns.items()}} for r in range(len(texts))]
    return ids, tokens, mask, examples


def bench_math(n, workers):
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
    assert np.array_equal(out.rewards, pooled.rewards)
    print(f"math  accuracy {np.nanmean(out.rewards):.3f} (about half right by construction)")
    print(f"math  in-process          : {rate(n, serial)}")
    print(f"math  pool ({workers} workers)     : {rate(n, pool_s)}")


def bench_code(n, workers):
    rows = [PROGRAMS[i % len(PROGRAMS)] for i in range(n)]
    texts = [f"```python\n{p}```" for p, _ in rows]
    ids, tokens, mask, examples = host_batch(texts, {"tests": [t for _, t in rows]})
    for w in sorted({workers, 2 * workers}):
        with HostRewards([code_reward], decode=decode_chars, lookup=examples.__getitem__,
                         num_workers=w) as host:
            host.compute(ids[:8], tokens[:8], mask[:8])
            t = time.perf_counter()
            out = host.compute(ids, tokens, mask)
            seconds = time.perf_counter() - t
        passed = int(np.nansum(out.rewards))
        print(f"code  pool ({w} workers)     : {rate(n, seconds)}  ({passed} passed)")


def bench_code_latency(n):
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
    print(f"code  one run at a time    : {1000 * statistics.median(walls):.1f} ms wall (median of "
          f"{n}), {1000 * cpu / n:.1f} ms CPU per run")


HOSTILE_MATH = ["The answer is $(2^{99999})^{99999}$.", r"\boxed{(9999!)!}",
                "(2^99999)^99999", "x" * 100_000, r"\[ x" * 25_000, "1 " * 50_000,
                "$" * 100_000, r"\boxed{" * 14_000 + "1" + "}" * 14_000]


def bench_math_hostile():
    import json
    from grpojax.rewards.math import MathAccuracy
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "data", "math_verify_cases.json")) as f:
        suite = json.load(f)["cases"]
    mix = math_batch(248)
    latex = ([c["pred"] for c in suite[:248]], [c["gold"] for c in suite[:248]])
    reward = MathAccuracy()
    for name, (completions, golds) in (("GSM8K/MATH mix", mix), ("Math-Verify's tests", latex)):
        completions = list(completions) + HOSTILE_MATH
        golds = list(golds) + ["1"] * len(HOSTILE_MATH)
        reward(completions=completions, answer=golds)  # warm: workers up, sympy's caches
        times = []
        for _ in range(3):
            t = time.perf_counter()
            out = reward(completions=completions, answer=golds)
            times.append(time.perf_counter() - t)
        assert out[-len(HOSTILE_MATH):] == [0.0] * len(HOSTILE_MATH)
        slowest = 0.0
        for c, g in zip(completions, golds):
            t = time.perf_counter()
            reward(completions=[c], answer=[g])
            slowest = max(slowest, time.perf_counter() - t)
        print(f"math  {name:>20}: 256 answers (8 hostile) in {statistics.median(times):.2f} s "
              f"(median of 3), slowest single verdict {1000 * slowest:.0f} ms")


def _sandbox_at(rev, old_dir):
    """Revision `rev`'s run_tests, with its own supervisor files, loaded from old_dir."""
    import importlib.util
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("_sandbox.py", "_sandbox_wire.py", "_sandbox_jail.py", "runner.py"):
        # In grpojax/sandbox/ since the sandbox got its own package, grpojax/rewards/ before.
        shown = [subprocess.run(["git", "show", f"{rev}:grpojax/{where}/{name}"], cwd=repo,
                                capture_output=True, text=True) for where in ("sandbox", "rewards")]
        found = [s.stdout for s in shown if s.returncode == 0]
        if not found:
            if name == "runner.py":  # before the package: the runner was rewards/code.py
                return None
            sys.exit(f"{rev} has no {name} in grpojax/sandbox/ or grpojax/rewards/")
        with open(os.path.join(old_dir, name), "w") as f:
            f.write(found[0])
    spec = importlib.util.spec_from_file_location(f"runner_{rev}", os.path.join(old_dir, "runner.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    module._SUPERVISOR = os.path.join(old_dir, "_sandbox.py")
    return module.run_tests


def bench_code_against(rev, n):
    """Runs per second of this checkout's sandbox against revision `rev`'s, each with its
    own runner (the trainer's half: the judging plan, the payload) and supervisor."""
    old_dir = tempfile.mkdtemp(prefix="grpojax-sbx-old-")
    old_run = _sandbox_at(rev, old_dir)
    if old_run is None:  # a revision before grpojax/sandbox/: this runner drives its files
        old_path = os.path.join(old_dir, "_sandbox.py")

        def old_run(program, tests):
            runner._SUPERVISOR, saved = old_path, runner._SUPERVISOR
            try:
                return run_tests(program, tests)
            finally:
                runner._SUPERVISOR = saved
    runs = {"this checkout": run_tests, rev: old_run}
    walls = {k: [] for k in runs}
    cpus = dict.fromkeys(runs, 0.0)
    for i in range(n + 2):  # the first two: byte-code caches, page cache
        program, tests = PROGRAMS[i % len(PROGRAMS)]
        order = list(runs.items())
        for name, fn in order if i % 2 else order[::-1]:  # neither always goes first
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            fn(program, tests)
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if i >= 2:
                walls[name].append(wall)
                cpus[name] += (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    for name in runs:
        total = sum(walls[name])
        print(f"code  {name:>14}: {n / total:.1f} runs/s, {1000 * statistics.median(walls[name]):.1f}"
              f" ms wall (median of {n}), {1000 * cpus[name] / n:.1f} ms CPU per run")
    ratio = sum(walls[rev]) / sum(walls["this checkout"])
    print(f"code  runs/s of this checkout / {rev}: {ratio:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--math", type=int, default=1024)
    ap.add_argument("--code", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--against", help="a git revision whose sandbox to compare with")
    ap.add_argument("--hostile", action="store_true", help="math batches with hostile answers")
    ap.add_argument("--runs", type=int, default=200, help="runs of each sandbox, with --against")
    args = ap.parse_args()
    print(f"cpus={os.cpu_count()} sandbox isolation={','.join(sandbox_isolation())}")
    if args.against:
        bench_code_against(args.against, args.runs)
        return
    if args.hostile:
        bench_math_hostile()
        return
    if args.math:
        bench_math(args.math, args.workers)
    if args.code:
        bench_code(args.code, args.workers)
        bench_code_latency(40)


if __name__ == "__main__":
    main()
