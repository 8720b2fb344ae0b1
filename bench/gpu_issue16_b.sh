#!/usr/bin/env bash
# Issue 16 (session 7), one H200 call, < 9 min: the modulation table (runtime/modulation.py) and what it frees
# under offload="blocks" (the modulation Linears stay in host memory; the text encoder's layers get the rest
# of the budget).
#  1. GPU tests: tests/test_modulation_table.py (graphs + table vs eager vs no table), the offload/planner tests.
#  2. `qwenfast bench transformer` at 1024²: bf16 and FP8 CUDA-graph forwards with and without the table,
#     diffusers eager in the same run (full-size random weights).
#  3. `qwenfast bench fp8 --stages budget`: FP8 1024² 4-step resident (table on / off), then
#     offload="blocks" planned for and capped at 24 GiB and 16 GiB (fresh prompt per timed call).
# JSON lines -> $OUT/transformer.jsonl, $OUT/fp8.jsonl; log -> $OUT/gpu.log.
set -uo pipefail
source bench/gpu_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_modulation_table.py tests/test_runtime_memory.py \
  -k "table or offload or resident or planner" 2>&1 | tail -4 | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench transformer --size 1024 --compare diffusers --no-compile --iters 20 \
  --results "$OUT" 2>&1 | tee -a "$LOG"
timeout 330 python3 -m qwenfast.cli bench fp8 --stages budget --results "$OUT" 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
echo done | tee -a "$LOG"
