"""The device_programs workload (bench/run.py device_programs): its quick run prints a
row for every program, and the matmul FLOPs read from the compiled decode step equal
a count worked by hand from the tiny model's shapes; with the CUDA plugin, the same
step compiles for an H100 with its kernels per layer."""

import json
import os
import sys

import pytest

from grpojax import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import run as bench_run  # noqa: E402  bench/run.py

device_programs = bench_run.load("device_programs")

# One decode step of qwen2_tiny (D=112, F=224, 7 query heads, 1 kv head, H=16,
# L=2, V=256) at the quick run's shapes: N = 2 prompts x G=4 = 8 rows, a cache of
# P=8 prompt slots and T-1 = 7 completion slots. Per layer:
_QKV = 2 * 8 * 112 * (7 + 2 * 1) * 16  # fused q/k/v projection: 258,048
_O = 2 * 8 * (7 * 16) * 112  # output projection: 200,704
_GATE_UP = 2 * 8 * 112 * (2 * 224)  # fused gate/up: 802,816
_DOWN = 2 * 8 * 224 * 112  # 401,408
# q·k and p·v over every slot, masked ones included: 2 products x 2·N·heads·H per slot.
_ATTENTION = 2 * (2 * 8 * 7 * 16) * (8 + 7)  # 53,760
_LM_HEAD = 2 * 8 * 112 * 256  # the tied unembedding of the N rows: 458,752
DECODE_FLOPS = 2 * (_QKV + _O + _GATE_UP + _DOWN + _ATTENTION) + _LM_HEAD  # 3,892,224


@pytest.mark.slow
def test_the_quick_run_compiles_every_program_and_its_decode_flops_are_the_hand_count(capsys):
  record = bench_run.main(["device_programs", "--quick", "--json"])
  out = capsys.readouterr().out.splitlines()
  assert json.loads(out[-1]) == json.loads(json.dumps(record))
  assert out[1].split()[:3] == ["target", "model", "program"]
  rows = record["figures"]["rows"]
  by_program = {r["program"]: r for r in rows}
  assert set(by_program) == set(device_programs.PROGRAMS)
  for program in device_programs.PROGRAMS:
    assert any(line.split()[:3] == ["cpu", "qwen2_tiny", program] for line in out), program

  decode = by_program["decode"]
  assert decode["analytic_flops"] == DECODE_FLOPS
  assert decode["matmul_flops"] == DECODE_FLOPS
  assert decode["loops"] == [] and decode["kernels"] == decode["static_kernels"]  # unrolled
  assert decode["kernels_per_layer"] > 0
  # The prefill (a layer scan) and the update (a micro-batch scan around one) are
  # exact too: their loops' trip counts are stated in the HLO.
  for program in ("prefill", "update"):
    assert by_program[program]["matmul_flops"] == by_program[program]["analytic_flops"], program
  assert by_program["prefill"]["loops"][0][0] == 2  # the 2 layers


@pytest.mark.skipif(not targets.available("h100-80gb"),
                    reason=f"no CUDA plugin here: {targets.CUDA_INSTALL}")
def test_the_decode_step_compiles_for_an_h100_with_its_kernels_per_layer(capsys):
  record = bench_run.main(["device_programs", "--quick", "--targets", "h100-80gb",
                           "--programs", "decode"])
  (row,) = record["figures"]["rows"]
  assert row["target"] == "h100-80gb" and not row["at_least"]
  assert row["matmul_flops"] == DECODE_FLOPS
  assert 0 < row["kernels_per_layer"] < row["kernels"]
  assert row["bytes_accessed"] is None  # a GPU compiled without one has no cost analysis
  line = capsys.readouterr().out.splitlines()[2]
  assert line.split()[:3] == ["h100-80gb", "qwen2_tiny", "decode"]
