#!/usr/bin/env bash
# Session 8, one H200 call, < 10 min: issue 16's memory caps, each in a fresh process (as a user loads
# once with a budget): 16 GiB with CUDA graphs (streamed blocks' copies captured) and without, 24 GiB
# with graphs; the FP8 forward with the GELU fusion on by default (bench/fp8_gaps.py); GPU tests.
set -uo pipefail
source bench/gpu_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py -k "transformer or gelu" 2>&1 | tail -3 | tee -a "$LOG"
timeout 90 python3 bench/fp8_gaps.py --out "$OUT" 2>&1 | grep -v '^{' | tail -12 | tee -a "$LOG"
for args in "--caps 16" "--caps 16 --budget-graphs off" "--caps 24"; do
  echo "== bench fp8 --stages budget $args" | tee -a "$LOG"
  timeout 150 python3 -m qwenfast.cli bench fp8 --stages budget $args --results "$OUT" 2>&1 | grep -v "it/s\]" | grep -v '^{' | tee -a "$LOG"
done
echo done | tee -a "$LOG"
