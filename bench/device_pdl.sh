#!/usr/bin/env bash
# One device call: does XLA's programmatic dependent launch (PDL: a kernel starts while
# the one before it finishes) shorten the engine's tail step? bench/engine_overhead.py at
# 16 slots, one live row, T = 4096, one process per XLA_FLAGS setting. Log: $OUT/pdl.log.
#   bash bench/device_pdl.sh
set -u
OUT=${OUT:-/tmp/session-out}; mkdir -p "$OUT"
CMDBUF=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
run() { label=$1; flags=$2
  echo "== $label: XLA_FLAGS=$flags [$(date +%T)]" | tee -a "$OUT/pdl.log"
  XLA_FLAGS="$flags" timeout 100 python bench/engine_overhead.py --kernels gpu --slots 16 --no-generate --reps 1 --T 4096 2>&1 | grep -v Warning | grep -E "ms a step|rror|nknown" | tee -a "$OUT/pdl.log"; }
run default ""
run pdl "--xla_gpu_enable_pdl=true"
run pdl-off "--xla_gpu_enable_pdl=false"
run pdl-launch "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
run cmdbuf-pdl "--xla_gpu_enable_pdl=true $CMDBUF"
