#!/usr/bin/env bash
# The rollout engine on a lent GPU, in one call: the Pallas kernels compiled and checked
# against XLA (bench/kernel_check.py), the copy bandwidth, then bench/engine.py timed at
# Qwen2.5-0.5B's shapes in bf16 (random weights), B=32 x G=8 = 256 rows, P=128, S=256
# slots, T=4096 then 1024, best of 2. If a kernel fails its check, the engine runs on
# XLA's paged attention instead (--kernels xla). Logs and the JSON under $OUT.
#   bash bench/device_engine.sh            # ENGINE_TIMEOUT (s, default 420) bounds the timing
set -u
OUT=${OUT:-/tmp/engine-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv \
  | tee "$OUT/gpu.txt"
python -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)" \
  | tee -a "$OUT/gpu.txt"
timeout 150 python bench/kernel_check.py 2>&1 | tee "$OUT/kernel_check.log"
kernels=()
[ "${PIPESTATUS[0]}" = 0 ] || kernels=(--kernels xla)
timeout "${ENGINE_TIMEOUT:-420}" python bench/engine.py --model qwen2.5-0.5b --dtype bfloat16 \
  --no-qwen --prompts 32 --groups 8 --prompt-len 128 --slots 256 --T 4096,1024 --reps 2 \
  "${kernels[@]}" --json 2>&1 | tee "$OUT/engine.log"
tail -1 "$OUT/engine.log" > "$OUT/engine.json"
grep -E "^(  [a-z]+ (ragged|full)|  engine ragged /|T=|memory bandwidth|paged|attention)" \
  "$OUT/kernel_check.log" "$OUT/engine.log"
