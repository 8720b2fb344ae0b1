#!/usr/bin/env bash
# Session 9, first H200 call: the GPU tests session 8 could not run (FP8 fused kernels' CUDA tolerances,
# graphs under offload with every block resident, the row-scale refactor) and the rest of the engine's
# GPU tests; the edit quality gate over every code path (timed out in session 8); one wide vs several
# narrow bf16 GEMMs (issue 18).
set -uo pipefail
source bench/gpu_env.sh
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py tests/test_modulation_table.py tests/test_fp8.py \
  tests/test_engine_core.py tests/test_runtime_memory.py tests/test_kernels.py tests/test_lora.py -k "not interpreter" 2>&1 | tail -4 | tee -a "$LOG"
timeout 60 python3 bench/gemm_split.py > "$OUT/gemm_split.log" 2>&1; tail -5 "$OUT/gemm_split.log" | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench quality --model edit --paths --results "$OUT" 2>&1 | grep -v '^{' | tail -12 | tee -a "$LOG"
echo done | tee -a "$LOG"
