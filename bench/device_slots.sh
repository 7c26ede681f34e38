#!/usr/bin/env bash
# One device call: bench/engine.py at Qwen2.5-0.5B shapes, bf16, T = 4096, 256 rows, with
# S = 64 slots (what the planner gives the 4k experiment on a 16 GiB v5e without
# expected lengths), against the lockstep generate in the same run. Log: $OUT/engine-s64.log.
#   bash bench/device_slots.sh
set -u
OUT=${OUT:-/tmp/session-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"; } \
  2>&1 | tee -a "$OUT/engine-s64.log"
timeout 250 python bench/engine.py --model qwen2.5-0.5b --dtype bfloat16 --no-qwen --slots 64 \
  --T 4096 --reps 1 --kernels gpu --json 2>&1 | grep -v Warning | tee -a "$OUT/engine-s64.log" \
  | grep -v '^\[{'
