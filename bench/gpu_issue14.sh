#!/usr/bin/env bash
# Multi-GPU issue, one device call on nvidia-h200-x2: the GPU tests, then `qwenfast bench parallel`
# (transformer forward 1024² and 1328², qwenfast and diffusers' own Ulysses vs one GPU; end to end cfg=2
# at 50 steps and ulysses=2 at 4 steps). NVLink multicast stays off (the image sets NCCL_NVLS_ENABLE=0).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.log"
# qwenfast first (forward + end to end), then diffusers' own Ulysses (forward only) in a second run
timeout 330 python3 -m qwenfast.cli bench parallel --no-diffusers --results "$OUT" 2>&1 | grep -v '^{' | grep -v "it/s\]" | cut -c1-900 | tee -a "$OUT/gpu.log"
timeout 200 python3 -m qwenfast.cli bench parallel --no-e2e --results "$OUT" 2>&1 | grep -v '^{' | grep -v "it/s\]" | cut -c1-900 | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
