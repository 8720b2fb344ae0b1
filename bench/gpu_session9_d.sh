#!/usr/bin/env bash
# Session 9, H200: end to end with 8-bit attention (QWENFAST_ATTENTION=fp8, FA3's FP8 forward, fused
# joint path) — 1024² 4 steps no CFG and 50 steps true CFG, bf16 and FP8 GEMMs vs diffusers, same run;
# then the edit demo's quality gate for the FP8 path (fp32 reference + FP8, default attention).
set -uo pipefail
source bench/gpu_env.sh
QWENFAST_ATTENTION=fp8 QWENFAST_FP8_ATTENTION=fa3 timeout 330 python3 -m qwenfast.cli bench pipeline --case 1024:4:nocfg \
  --case 1024:50:cfg --fp8 --results "$OUT" 2>&1 | grep -v "it/s\]" | grep -v '^{' | tail -12 | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench quality --model edit --paths --path fp8 --results "$OUT" 2>&1 | grep -v '^{' | tail -4 | tee -a "$LOG"
echo done | tee -a "$LOG"
