#!/usr/bin/env bash
# Session 9, H200: 8-bit attention with Q and K written in e4m3 by the QK-norm + RoPE kernel (the fused
# joint path). GPU tests of the kernel and the path, then the 60-layer FP8 forward at 1024² with
# attention cudnn vs fp8 (FA3's FP8 forward; carry .whl/fa3_fwd-*.whl), then the demo quality gate with
# fp8 attention (text to image, edits). Greppable lines start with "ATTN ".
set -uo pipefail
source bench/gpu_env.sh
export QWENFAST_FP8_ATTENTION=fa3
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_fp8.py tests/test_kernels.py -k "not interpreter and (qk_norm_rope or fp8 or joint)" 2>&1 | tail -4 | tee -a "$LOG"
timeout 150 python3 -m qwenfast.cli bench attention transformer --results "$OUT" 2>&1 | grep -v '^{' | grep -v Warn | tail -8 | tee -a "$LOG"
timeout 120 python3 -m qwenfast.cli bench attention quality --n 120 --results "$OUT" 2>&1 | grep "ATTN quality\b\|ATTN quality_summary\|fp8_calls" | tee -a "$LOG"
timeout 150 python3 -m qwenfast.cli bench attention quality --model edit --n 120 --results "$OUT" 2>&1 | grep "ATTN quality\b\|ATTN quality_summary\|fp8_calls" | tee -a "$LOG"
echo done | tee -a "$LOG"
