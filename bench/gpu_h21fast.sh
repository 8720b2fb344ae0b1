#!/usr/bin/env bash
# Qwen-Image-2.1 step cache (issue 18, helper h21fast), one H200.
# 1. tests/test_step_cache21.py on the GPU: the cached steps replayed as CUDA graphs (one per step-cache variant:
#    first, full, cached) give the eager images (tiny 2.1 model, bf16), plus the CPU-side checks on CUDA.
# 2. python -m qwenfast.benchmarks.qwenimage21_e2e: full size, random weights, end to end at 1024²: our pipeline at
#    40 steps (2.1's default, no CFG) with the step cache off / balanced / fast (s per image, mean |Δ| vs off), and
#    the 4-step turbo schedule vs diffusers' QwenImage21Pipeline with the same weights (s per image, mean |Δ|), plus
#    diffusers at 40 steps. Text encoder: a random Qwen3-VL of the 8B shape, shared by both pipelines (it falls back
#    to a 2-layer one, and says so in the rows, if the 8B one cannot be built). Writes $OUT/h21fast.jsonl.
# Multi-GPU for 2.1 (runtime/parallel21.py) is covered by the CPU gloo tests (tests/test_parallel21.py) only.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_step_cache21.py -rs 2>&1 | tail -5 | tee -a "$OUT/gpu.log"
timeout 330 python3 -m qwenfast.benchmarks.qwenimage21_e2e --size 1024 --steps 40 --out "$OUT/h21fast.jsonl" 2>&1 \
  | grep -v "should be kept in float32" | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
