#!/usr/bin/env bash
# One device call: bench/stream.py at Qwen2.5-0.5B shapes, bf16, 32 prompts x 8, T = 2048,
# up to 4 batches, with half and a quarter of the groups accepted. Logs under $OUT.
#   bash bench/device_stream.sh
set -u
OUT=${OUT:-/tmp/session-out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import jax; print('jax', jax.__version__)"; } 2>&1 | tee -a "$OUT/stream.log"
for a in 0.5 0.25; do
  echo "== accept $a [$(date +%T)]" | tee -a "$OUT/stream.log"
  timeout 200 python bench/stream.py --T 2048 --accept "$a" --quick 2>&1 | tee -a "$OUT/stream.log"
done
grep '^{' "$OUT/stream.log"
