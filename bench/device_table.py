"""The short table bench/device.sh ends with, from what its steps left in a folder:
roofline.json and engine.json (bench/run.py's --json records), repro.log and
repro_metrics.jsonl (the GSM8K NaN repro's run). A missing step's rows say so.

  python bench/device_table.py OUT
"""

from __future__ import annotations

import json
import math
import os
import sys


def read_record(path: str) -> dict | None:
  """The last --json record in `path`, or None."""
  if not os.path.isfile(path):
    return None
  lines = [line for line in open(path, encoding="utf-8") if line.startswith("{")]
  return json.loads(lines[-1]) if lines else None


def pct(x) -> str:
  return "-" if x is None else f"{100 * x:.1f}%"


def times(x) -> str:
  return "-" if x is None else f"{x:.2f}x"


def gib(x) -> str:
  return "-" if x is None else f"{x / 2**30:.2f} GiB"


def roofline_rows(rec: dict | None) -> list[tuple[str, str]]:
  if rec is None:
    return [("roofline", "no record")]
  f = rec["figures"]
  rows = [(f"decode, {g['rows']} rows: share of the HBM roofline", pct(g["hbm_roofline"]))
          for g in f["generate"]]
  rows += [(f"update MFU ({f['update_rows']} rows)", pct(f["update_mfu"])),
           ("update peak: planned", gib(f["planned_peak_bytes"])),
           ("update peak: peak_bytes_in_use less the resident", gib(f["measured_peak_bytes"])),
           ("planned / measured", times(f["planned_vs_measured"]))]
  return rows


def engine_rows(rec: dict | None) -> list[tuple[str, str]]:
  if rec is None:
    return [("engine", "no record")]
  rows = []
  for r in rec["figures"]["by_T"]:
    T = r["T"]
    for run, v in r["runs"].items():
      rows.append((f"T={T} {run}", f"{v['tokens_per_s']:,.0f} tok/s, {v['seconds']:.2f} s"))
    rows += [(f"T={T} engine ragged / full", times(r["ragged_vs_full"])),
             (f"T={T} engine ragged / generate ragged", times(r["ragged_vs_generate"])),
             (f"T={T} engine full / generate full", times(r["full_vs_generate"]))]
  return rows


def repro_rows(out: str) -> list[tuple[str, str]]:
  log = os.path.join(out, "repro.log")
  if not os.path.isfile(log):
    return [("gsm8k_nan_repro", "not run")]
  text = open(log, encoding="utf-8").read()
  if text.startswith("skipped"):
    return [("gsm8k_nan_repro", text.strip())]
  status = text.strip().splitlines()[-1] if text.strip() else "no output"
  path = os.path.join(out, "repro_metrics.jsonl")
  steps = ([json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
           if os.path.isfile(path) else [])
  rows = [("gsm8k_nan_repro", status)]
  for m in steps:
    if "loss" not in m:
      continue
    values = {k: m.get(k) for k in ("loss", "kl", "grad_norm")}
    finite = all(v is None or math.isfinite(v) for v in values.values())
    rows.append((f"step {m.get('step')}: loss, kl, grad_norm",
                 ", ".join("-" if v is None else f"{v:.4g}" for v in values.values())
                 + ("" if finite else "  NOT FINITE")))
  return rows


def table(out: str) -> str:
  roofline = read_record(os.path.join(out, "roofline.json"))
  engine = read_record(os.path.join(out, "engine.json"))
  head = next((r for r in (roofline, engine) if r), None)
  where = (f"{head['device']}, jax {head['jax']}, commit {head['commit']}" if head
           else "no record")
  rows = roofline_rows(roofline) + engine_rows(engine) + repro_rows(out)
  return "\n".join([f"{where}", "", "| figure | value |", "|---|---|",
                    *(f"| {k} | {v} |" for k, v in rows)])


if __name__ == "__main__":
  print(table(sys.argv[1]))
