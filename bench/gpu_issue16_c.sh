#!/usr/bin/env bash
# Issue 16 (session 8), one H200 call, < 9 min:
#  1. GPU tests of the modulation table and offload (`bring` puts host parts back: the session-7 fix).
#  2. bench/fp8_gaps.py: the FP8 1024² forward's wall time vs its kernel time (idle between kernels).
#  3. `qwenfast bench fp8 --stages budget`: FP8 1024² 4-step resident, then offload="blocks" planned for and
#     capped at 24 GiB and 16 GiB (fresh prompt per timed call), with the modulation table.
# JSON lines -> $OUT/*.jsonl; log -> $OUT/gpu.log.
set -uo pipefail
source bench/gpu_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_modulation_table.py tests/test_runtime_memory.py \
  -k "table or offload or resident or planner or bring" 2>&1 | tail -4 | tee -a "$LOG"
timeout 120 python3 bench/fp8_gaps.py --out "$OUT" 2>&1 | tail -30 | tee -a "$LOG"
timeout 330 python3 -m qwenfast.cli bench fp8 --stages budget --results "$OUT" 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
echo done | tee -a "$LOG"
