#!/usr/bin/env bash
# What only a device can measure, in one call of at most 10 minutes on a lent H100 or
# H200 (run from the repo root; logs, JSON records and table.md under $OUT):
#   1. bench/run.py roofline --device gpu --remat: decode's share of the HBM roofline, the
#      update's MFU, the planner's peak against the device's peak_bytes_in_use;
#   2. bench/run.py engine --device gpu: the engine's ragged and full-length runs
#      against lockstep generate (Qwen2.5-0.5B shapes, bf16, 256 rows, T = 4,096);
#      if the GPU kernels fail, again on XLA's paged attention;
#   3. gsm8k_nan_repro.py (../shared/device/): the shipped GSM8K experiment's first
#      updates on a random Qwen2.5-0.5B-shaped checkpoint: loss, kl, grad_norm finite?
# then bench/device_table.py prints the table. The machine lacks a few packages: carry
# their wheels and the repro script in .whl/ (git-ignored), prepared here with
#   ../shared/device/prepare.sh && cp ../shared/device/gsm8k_nan_repro.py .whl/
# and run, carrying [".whl"]:   bash bench/device.sh
# --quick: the same steps at tiny shapes on this machine's CPU (the test suite's, with
# REPRO=none: the repro left out; REPRO=PATH names the script).
set -u
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK=1
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
log() { echo "== $* [$(date +%T)]"; }
if [ -n "$QUICK" ]; then
  run_args=(--quick --device cpu)
  repro_env=(TINY=1)
  repro_flags=(--config.rollout.prompts_per_step=2 --config.rollout.group_size=2
               --config.rollout.max_completion_length=8 --config.train.steps=1
               --config.eval.num_prompts=0)
else
  run_args=(--device gpu)
  repro_env=()
  repro_flags=(--config.train.steps=2 --config.eval.num_prompts=0)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi

log roofline
timeout "${ROOFLINE_TIMEOUT:-150}" python bench/run.py roofline "${run_args[@]}" --remat --json \
  2>&1 | tee "$OUT/roofline.log"
grep '^{"workload"' "$OUT/roofline.log" > "$OUT/roofline.json"

log engine
timeout "${ENGINE_TIMEOUT:-200}" python bench/run.py engine "${run_args[@]}" --json \
  2>&1 | tee "$OUT/engine.log"
if ! grep -q '^{"workload"' "$OUT/engine.log" && [ -z "$QUICK" ]; then
  log "engine on XLA's paged attention"
  timeout 200 python bench/run.py engine "${run_args[@]}" --kernels xla --json 2>&1 \
    | tee -a "$OUT/engine.log"
fi
grep '^{"workload"' "$OUT/engine.log" > "$OUT/engine.json"

log gsm8k_nan_repro
repro=${REPRO:-}
for where in .whl/gsm8k_nan_repro.py ../shared/device/gsm8k_nan_repro.py; do
  [ -z "$repro" ] && [ -f "$where" ] && repro=$where
done
if [ -z "$repro" ] || [ "$repro" = none ]; then
  echo "skipped: no gsm8k_nan_repro.py (cp ../shared/device/gsm8k_nan_repro.py .whl/)" \
    | tee "$OUT/repro.log"
else
  work=$(mktemp -d)
  { env "${repro_env[@]}" python "$repro" "$work/repro" &&
    timeout "${REPRO_TIMEOUT:-200}" python -m grpojax.main \
      --config experiments/gsm8k_qwen2_5_0_5b.py --config.model.path="$work/repro/model" \
      --config.task.dataset="$work/repro/gsm8k.jsonl" "${repro_flags[@]}" --workdir "$work/run"
  } > "$OUT/repro.log" 2>&1
  echo "exit status $?" | tee -a "$OUT/repro.log"
  cp "$work/run/metrics.jsonl" "$OUT/repro_metrics.jsonl" 2>/dev/null
  rm -rf "$work"
fi

log table
python bench/device_table.py "$OUT" | tee "$OUT/table.md"
