#!/usr/bin/env bash
# FP8 issue, device call 1 (H200): GPU tests of the FP8 layers and the offload streamer, then
# `qwenfast bench fp8` (FP8 file load peak, LoRA on FP8, FP8 under 24/16 GiB).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_fp8_loading.py tests/test_runtime_memory.py 2>&1 | tail -3 | tee -a "$OUT/gpu.log"
timeout 420 python3 -m qwenfast.cli bench fp8 --results "$OUT" 2>&1 | tail -20 | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
