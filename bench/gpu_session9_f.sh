#!/usr/bin/env bash
# Session 9, H200: Qwen-Image-2.1 transformer (cached step, 1024²) vs diffusers eager, default attention
# (cuDNN) and then attention="fa3" (FA3's bf16 forward from the carried fa3-fwd wheel), each in its own
# process with its own diffusers baseline.
set -uo pipefail
source bench/gpu_env.sh
timeout 200 python3 -m qwenfast.benchmarks.qwenimage21 --out "$OUT/issue18.jsonl" 2>&1 | grep -v '^{' | grep -v -i warn | tail -5 | tee -a "$LOG"
QWENFAST_ATTENTION=fa3 timeout 200 python3 -m qwenfast.benchmarks.qwenimage21 --out "$OUT/issue18_fa3.jsonl" 2>&1 | grep -v '^{' | grep -v -i warn | tail -5 | tee -a "$LOG"
echo done | tee -a "$LOG"
