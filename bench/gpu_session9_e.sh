#!/usr/bin/env bash
# Session 9, H200: the 8-bit attention GPU tests (engine test fixed), then the FP8 forward at 1024²
# back to back and after 0.3 s idle, kernel categories and gaps (bench/fp8_gaps.py), default attention
# vs QWENFAST_ATTENTION=fp8 (fused joint path, FA3 FP8), same run.
set -uo pipefail
source bench/gpu_env.sh
export QWENFAST_FP8_ATTENTION=fa3
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_attention_fp8.py -k "gpu" 2>&1 | tail -2 | tee -a "$LOG"
timeout 150 python3 bench/fp8_gaps.py --out "$OUT" 2>&1 | grep -v '^{' | grep -v -i warn | tail -14 | tee -a "$LOG"
QWENFAST_ATTENTION=fp8 timeout 150 python3 bench/fp8_gaps.py --out "$OUT" 2>&1 | grep -v '^{' | grep -v -i warn | tail -14 | tee -a "$LOG"
echo done | tee -a "$LOG"
