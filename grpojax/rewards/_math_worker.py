"""Child process that runs math-verify for `grpojax.rewards.math.is_equivalent`.

Protocol: one JSON object per line on stdin, `{"p": prediction, "g": gold,
"t": seconds}`; one line back, "1" or "0". The parent kills this process
when a reply is late (sympy can spin in C where no signal reaches it) and
starts a fresh one, so a hostile answer costs a timeout, never the trainer.
The address space is capped so a huge number fails with MemoryError here.
"""

import json
import resource
import sys

_MEMORY_MB = 1024  # on top of what the interpreter uses after importing sympy


def _cap_memory():
  with open("/proc/self/statm") as f:
    pages = int(f.read().split()[0])
  used = pages * resource.getpagesize()
  limit = used + (_MEMORY_MB << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main():
  from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

  # Answers arrive already extracted: parse the whole string, LaTeX first,
  # then plain expressions (digits and operators only: nothing is eval'd).
  config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

  def equivalent(pred: str, gold: str, seconds: int) -> bool:
    gold_p = parse(f"${gold}$", extraction_config=config, parsing_timeout=seconds)
    pred_p = parse(f"${pred}$", extraction_config=config, parsing_timeout=seconds)
    if not gold_p or not pred_p:
      return False
    return bool(verify(gold_p, pred_p, timeout_seconds=seconds))

  try:
    _cap_memory()
  except (OSError, ValueError):
    pass
  # Warm the parser (its grammar loads lazily) before declaring readiness.
  equivalent("1", "1", 5)
  sys.stdout.write("ready\n")
  sys.stdout.flush()
  for line in sys.stdin:
    try:
      req = json.loads(line)
      ok = equivalent(req["p"], req["g"], max(1, int(req["t"])))
    except (Exception, MemoryError, RecursionError):  # noqa: BLE001
      ok = False
    sys.stdout.write("1\n" if ok else "0\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
