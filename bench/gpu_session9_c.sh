#!/usr/bin/env bash
# Session 9, H200: the FA3 engine test's failure in full, then the demo quality gate with 8-bit attention
# (fused joint path; fp32 reference now with exact attention), text to image and edits.
set -uo pipefail
source bench/gpu_env.sh
export QWENFAST_FP8_ATTENTION=fa3
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention_fp8.py -k "gpu" --tb=long 2>&1 | grep -v "^SKIPPED" | tail -40 | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench attention quality --n 120 --results "$OUT" 2>&1 | grep "^ATTN quality \|quality_summary\|Error" | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench attention quality --model edit --n 120 --results "$OUT" 2>&1 | grep "^ATTN quality \|quality_summary\|Error" | tee -a "$LOG"
echo done | tee -a "$LOG"
