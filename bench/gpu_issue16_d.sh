#!/usr/bin/env bash
# Issue 16 (session 8), one H200 call, < 9 min:
#  1. GPU tests: the chunked GELU + FP8 kernel, CUDA graphs under offload="blocks" with every block resident.
#  2. bench/gelu_fp8_sweep.py: the GELU + quantisation kernel sweep, then the FP8 forward with it off / on.
#  3. `qwenfast bench fp8 --stages budget`: 24 and 16 GiB, CUDA graphs kept on (they replay when all
#     blocks are resident).
set -uo pipefail
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py tests/test_modulation_table.py \
  -k "gelu or graph or offload" 2>&1 | tail -4 | tee -a "$LOG"
timeout 200 python3 bench/gelu_fp8_sweep.py --out "$OUT" 2>&1 | grep -v '^{' | tail -30 | tee -a "$LOG"
timeout 240 python3 -m qwenfast.cli bench fp8 --stages budget --results "$OUT" 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
echo done | tee -a "$LOG"
