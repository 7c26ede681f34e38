"""Child process that runs Math-Verify for `grpojax.rewards.math`.

Protocol: one JSON object per line on stdin, one line back, "1" or "0":
- `{"p": prediction, "g": gold}`: two answers already extracted, each parsed
  whole as LaTeX (`is_equivalent`);
- `{"c": completion, "g": gold, "r": float_rounding, "s": strict,
  "a": allow_set_relation_comp}`: Math-Verify's own extraction from the
  completion's tail and from the gold text, then its `verify` (`grade`).
The parent kills this process when a reply is late (sympy can spin in C
where no signal reaches it) and switches to a spare one, so a hostile answer
costs its time budget, never the trainer or the rest of the batch. The
address space is capped so a huge number fails with MemoryError here.
"""

import json
import logging
import resource
import sys

_MEMORY_MB = 1024  # on top of what the interpreter uses after importing sympy
_GOLDS = 4096  # parsed golds kept: a group's G completions share one


def _cap_memory():
  with open("/proc/self/statm") as f:
    pages = int(f.read().split()[0])
  used = pages * resource.getpagesize()
  limit = used + (_MEMORY_MB << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main():
  from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

  # The parent bounds every call; Math-Verify's own alarm-based timeouts
  # (whole seconds, main thread only) would only add a warning per call.
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
      kw = {}
    if not gold or not pred:
      return False
    return bool(verify(gold, pred, timeout_seconds=None, **kw))

  try:
    _cap_memory()
  except (OSError, ValueError):
    pass
  # Warm the parser (its grammar loads lazily) before declaring readiness.
  answer({"p": "1", "g": "1"})
  answer({"c": "$\\frac{1}{2}$", "g": "0.5", "r": 6, "s": True, "a": False})
  sys.stdout.write("ready\n")
  sys.stdout.flush()
  for line in sys.stdin:
    try:
      ok = answer(json.loads(line))
    except (Exception, MemoryError, RecursionError):  # noqa: BLE001
      ok = False
    sys.stdout.write("1\n" if ok else "0\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
