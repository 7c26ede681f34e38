"""Child process that runs Math-Verify for `grpojax.rewards.math`.

Protocol: one JSON object per line on stdin, one line back: "1" (equal), "0"
(not equal, or nothing to compare), "t" (its CPU budget ran out: no verdict).
- `{"p": prediction, "g": gold, "t": cpu_s}`: two answers already extracted,
  each parsed whole as LaTeX (`is_equivalent`);
- `{"c": completion, "g": gold, "r": float_rounding, "s": strict,
  "a": allow_set_relation_comp, "t": cpu_s}`: Math-Verify's own extraction
  from the completion's answer and from the gold text, then its `verify`
  (`grade`).
A request may use `cpu_s` seconds of this process's CPU time (user and
system), not of the wall clock: a busy machine slows the verdict, never
changes it. SIGPROF interrupts Python code when the budget is spent; the
parent kills this process when sympy spins in C past it (no signal handler
runs there), so a hostile answer costs its budget, never the trainer or the
rest of the batch. The address space is capped so a huge number fails with
MemoryError here.
"""

import json
import logging
import resource
import signal
import sys

_MEMORY_MB = 1024  # on top of what the interpreter uses after importing sympy
_GOLDS = 4096  # parsed golds kept: a group's G completions share one


class _OutOfTime(BaseException):
  """The request's CPU budget is spent. A BaseException: Math-Verify's and
  sympy's `except Exception` must not turn it into a verdict of 0."""


def _cap_memory():
  with open("/proc/self/statm") as f:
    pages = int(f.read().split()[0])
  used = pages * resource.getpagesize()
  limit = used + (_MEMORY_MB << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main():
  from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

  # This process bounds every call by CPU time (below); Math-Verify's own
  # alarm-based timeouts count wall time (whole seconds, main thread only).
  logging.disable(logging.WARNING)
  # Boxes first, as TRL's accuracy reward and Math-Verify's tests read them.
  config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
  golds = {}

  def parse_gold(text):
    if text not in golds:
      if len(golds) >= _GOLDS:
        golds.clear()
      golds[text] = parse(text, extraction_config=config, parsing_timeout=None)
    return golds[text]

  def answer(req):
    if "c" in req:
      gold = parse_gold(req["g"])
      pred = parse(req["c"], extraction_config=config, parsing_timeout=None)
      kw = dict(float_rounding=int(req["r"]), strict=bool(req["s"]),
                allow_set_relation_comp=bool(req["a"]))
    else:
      gold = parse_gold(f"${req['g']}$")
      pred = parse(f"${req['p']}$", extraction_config=config, parsing_timeout=None)
      # `x > 4` is the interval (4, \infty): compared as sets, both ways round.
      kw = dict(allow_set_relation_comp=True)
    if not gold or not pred:
      return False
    return bool(verify(gold, pred, timeout_seconds=None, **kw))

  # One shot per request: the handler disarms itself before raising, so an
  # _OutOfTime swallowed by a bare `except:` deep in sympy is not raised again
  # where nothing catches it (the parent's CPU check backs this one up).
  armed, late = [False], [False]

  def out_of_time(signum, frame):
    if armed[0]:
      armed[0] = False
      late[0] = True
      raise _OutOfTime

  signal.signal(signal.SIGPROF, out_of_time)

  def run(req):
    cpu_s = float(req.get("t") or 0)
    if cpu_s > 0:
      signal.setitimer(signal.ITIMER_PROF, cpu_s)  # counts this process's CPU, user and system
      armed[0] = True
    try:
      try:
        return answer(req)
      finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_PROF, 0)
    except (_OutOfTime, Exception, MemoryError, RecursionError):  # noqa: BLE001
      return False  # whatever failed, `late` says whether the budget ran out first

  try:
    _cap_memory()
  except (OSError, ValueError):
    pass
  # Warm the parser (its grammar loads lazily) before declaring readiness.
  run({"p": "1", "g": "1"})
  run({"c": "$\\frac{1}{2}$", "g": "0.5", "r": 6, "s": True, "a": False})
  sys.stdout.write("ready\n")
  sys.stdout.flush()
  for line in sys.stdin:
    late[0] = False
    try:
      ok = run(json.loads(line))
    except ValueError:  # not JSON: a parent bug, answered so the protocol stays in step
      ok = False
    sys.stdout.write("t\n" if late[0] else "1\n" if ok else "0\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
