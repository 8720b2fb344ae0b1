#!/usr/bin/env bash
# Session 8, one H200 call: GPU tests (graphs under offload with every block resident); the FP8 forward
# back to back vs spaced with SM clocks sampled (why the replay is ~7% above the profiled kernel span);
# `qwenfast bench pipeline --case 1024:50:cfg --fp8` (50 steps, true CFG, bf16 and FP8 vs diffusers).
set -uo pipefail
source bench/gpu_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_modulation_table.py 2>&1 | tail -3 | tee -a "$LOG"
timeout 120 python3 bench/fp8_gaps.py --out "$OUT" 2>&1 | grep -v '^{' | head -4 | tee -a "$LOG"
timeout 330 python3 -m qwenfast.cli bench pipeline --case 1024:50:cfg --fp8 --results "$OUT" 2>&1 | grep -v "it/s\]" | tail -25 | tee -a "$LOG"
echo done | tee -a "$LOG"
