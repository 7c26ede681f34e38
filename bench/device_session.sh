#!/usr/bin/env bash
# One device call for issues 32 and 35, most important first, each part bounded:
#   1. bench/kernel_check.py: the Pallas kernels compiled for the device against XLA,
#      the GPU's step-writing paged kernel included;
#   2. bench/engine_profile.py: where a decode step's time goes (one live row, all live);
#   3. bench/engine.py at Qwen2.5-0.5B shapes, bf16, T = 4096, one rep (the ratios);
#   4. bench/lora_device.py: LoRA and QLoRA against full fine-tuning (update, decode);
#   5. the one-row profile again with XLA's command buffers over the while loop.
# Logs under $OUT (at most 8 files come back).
#   bash bench/device_session.sh
set -u
OUT=${OUT:-/tmp/session-out}
mkdir -p "$OUT"
log() { echo "== $* [$(date +%T)]" | tee -a "$OUT/session.log"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"; } \
  2>&1 | tee -a "$OUT/session.log"
log kernel_check
timeout 150 python bench/kernel_check.py 2>&1 | tee -a "$OUT/session.log"
kernels=gpu
[ "${PIPESTATUS[0]}" = 0 ] || kernels=xla
log "engine_profile (kernels=$kernels)"
timeout 120 python bench/engine_profile.py --T 256 --kernels $kernels --out "$OUT" 2>&1 \
  | tee -a "$OUT/session.log"
log "engine T=4096"
timeout 170 python bench/engine.py --model qwen2.5-0.5b --dtype bfloat16 --no-qwen \
  --prompts 32 --groups 8 --prompt-len 128 --slots 256 --T 4096 --reps 1 --kernels $kernels \
  --json 2>&1 | tee "$OUT/engine.log" | grep -v "^\[" | tee -a "$OUT/session.log"
log lora_device
timeout 200 python bench/lora_device.py --json "$OUT/lora.json" 2>&1 | tee -a "$OUT/session.log"
log "engine_profile with command buffers over the loop"
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL \
  timeout 90 python bench/engine_profile.py --T 256 --kernels $kernels --states one 2>&1 \
  | tee -a "$OUT/session.log"
log done
