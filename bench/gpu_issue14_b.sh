#!/usr/bin/env bash
# Multi-GPU issue, device call (nvidia-h200-x2): Ulysses-2 forward with the attention pipelined over
# 1, 2 and 4 head chunks (QWENFAST_ULYSSES_CHUNKS), 4-step end to end with the default, then diffusers'
# own Ulysses forward (enable_parallelism, ulysses_anything) at 1024² in the same call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.log"
for c in 1 2 4; do
  echo "== chunks=$c" | tee -a "$OUT/gpu.log"
  QWENFAST_ULYSSES_CHUNKS=$c timeout 110 python3 -m qwenfast.cli bench parallel --no-diffusers --no-e2e --results "$OUT/c$c" 2>&1 \
      | grep -v '^{' | grep -v "it/s\]" | cut -c1-600 | tee -a "$OUT/gpu.log"
done
echo "== diffusers' own Ulysses (1024²)" | tee -a "$OUT/gpu.log"
timeout 200 python3 -m qwenfast.cli bench parallel --no-e2e --size 1024 --results "$OUT/diffusers" 2>&1 | grep -v '^{' \
    | grep -v "it/s\]" | cut -c1-900 | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
