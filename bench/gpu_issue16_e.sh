#!/usr/bin/env bash
# Session 8, one H200 call, < 10 min:
#  1. GPU tests: GELU + FP8 kernel (max-of-h amax), CUDA graphs under offload="blocks" (resident and streamed).
#  2. bench/gelu_fp8_sweep.py: the kernel vs torch GELU + quantisation, the FP8 forward with it off / on.
#  3. `qwenfast bench fp8 --stages budget`: 24 and 16 GiB with graphs (the streamed blocks' copies captured).
#  4. Qwen-Image-2.1 transformer bench with --profile (where the bf16 cached step goes).
set -uo pipefail
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py tests/test_modulation_table.py \
  tests/test_runtime_memory.py -k "gelu or graph or offload or stream or bring" 2>&1 | tail -6 | tee -a "$LOG"
timeout 150 python3 bench/gelu_fp8_sweep.py --out "$OUT" 2>&1 | grep -v '^{' | tail -16 | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench fp8 --stages budget --results "$OUT" 2>&1 | grep -v "it/s\]" | grep -v '^{' | tee -a "$LOG"
timeout 150 python3 -m qwenfast.benchmarks.qwenimage21 --profile --out "$OUT/issue18.jsonl" 2>&1 | grep -v '^{' | tail -60 | tee -a "$LOG"
echo done | tee -a "$LOG"
