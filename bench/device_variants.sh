#!/usr/bin/env bash
# One device call for issue 32's ragged / full ratio: the engine alone at Qwen2.5-0.5B shapes,
# bf16, T = 4096, 256 rows, S = 256, in three processes (bench/engine_variants.py):
#   base     as shipped;
#   cmdbuf   XLA's command buffers over the decode loop (WHILE, CONDITIONAL): one graph a run;
#   rbg      JAX_DEFAULT_PRNG_IMPL=unsafe_rbg: the draw's threefry noise replaced, its cost;
# then the one-row profile (bench/engine_profile.py) under the command buffers.
# Logs under $OUT.
#   bash bench/device_variants.sh
set -u
OUT=${OUT:-/tmp/session-out}
mkdir -p "$OUT"
log() { echo "== $* [$(date +%T)]" | tee -a "$OUT/variants.log"; }
CMDBUF=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"; } \
  2>&1 | tee -a "$OUT/variants.log"
run() { label=$1; shift
  log "$label"
  env "$@" timeout 130 python bench/engine_variants.py --T 4096 --reps 1 --label "$label" 2>&1 \
    | tee -a "$OUT/variants.log"; }
run base PYTHONUNBUFFERED=1
run cmdbuf XLA_FLAGS=$CMDBUF
run rbg JAX_DEFAULT_PRNG_IMPL=unsafe_rbg
log "engine_profile, one row, command buffers"
XLA_FLAGS=$CMDBUF timeout 90 python bench/engine_profile.py --T 256 --states one --out "$OUT" \
  2>&1 | tee -a "$OUT/variants.log"
log done
grep '^{' "$OUT/variants.log"
