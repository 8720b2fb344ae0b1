#!/usr/bin/env bash
# Session 10, H200: Qwen-Image-2.1 end to end at 1024² vs diffusers (random Qwen3-VL 8B-shape encoder shared):
# 40 steps (step cache off / balanced / fast), turbo-4, then our FP8 pipeline at 40 steps and turbo-4;
# (prefill attention now written token-major, no concatenation).
set -uo pipefail
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_qwenimage21.py tests/test_step_cache21.py tests/test_transformer21_paths.py 2>&1 | tail -2 | tee -a "$LOG"
timeout 420 python3 -m qwenfast.benchmarks.qwenimage21_e2e --fp8 --out "$OUT/h21_e2e.jsonl" 2>&1 | grep -v "should be kept in float32" | grep -v '^{' | tee -a "$LOG"
echo done | tee -a "$LOG"
