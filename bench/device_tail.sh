#!/usr/bin/env bash
# One device call for issue 32's ragged / full ratio with the engine's tail narrowed
# (EngineConfig.tail_slots): bench/engine_variants.py at Qwen2.5-0.5B shapes, bf16,
# T = 4096, 256 rows, S = 256, GPU kernels, one process per setting:
#   auto     the default: 256 slots, then 64, then 16;
#   none     never narrowed (--tail-slots 0): the engine before the tail;
#   deeper   256, 64, 16, then 4.
# Logs under $OUT.
#   bash bench/device_tail.sh
set -u
OUT=${OUT:-/tmp/session-out}
mkdir -p "$OUT"
log() { echo "== $* [$(date +%T)]" | tee -a "$OUT/tail.log"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"; } \
  2>&1 | tee -a "$OUT/tail.log"
run() { label=$1; shift
  log "$label"
  timeout 150 python bench/engine_variants.py --T 4096 --reps 1 --label "$label" "$@" 2>&1 \
    | grep -v Warning | tee -a "$OUT/tail.log"; }
run auto
run none --tail-slots 0
run deeper --tail-slots 64,16,4
log done
grep '^{' "$OUT/tail.log"
