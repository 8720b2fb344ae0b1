#!/usr/bin/env bash
# Session 11, H200: 2.1 blocks hand the next block its LayerNorm + scale (one pass fewer per block);
# the 2.1 GPU tests, the transformer bench (cached step vs diffusers eager) and the end-to-end bench.
set -uo pipefail
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transformer21_paths.py tests/test_qwenimage21.py tests/test_step_cache21.py tests/test_attention_backends.py 2>&1 | tail -2 | tee -a "$LOG"
timeout 240 python3 -m qwenfast.benchmarks.qwenimage21 --out "$OUT/issue18.jsonl" 2>&1 | grep -v '^{' | grep -v -i warn | tail -5 | tee -a "$LOG"
timeout 300 python3 -m qwenfast.benchmarks.qwenimage21_e2e --fp8 --out "$OUT/h21_e2e.jsonl" 2>&1 | grep -v "should be kept in float32" | grep -v '^{' | tee -a "$LOG"
echo done | tee -a "$LOG"
