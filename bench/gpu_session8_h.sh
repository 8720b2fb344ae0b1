#!/usr/bin/env bash
# Session 8, last H200 call: GPU tests of what changed (FP8 kernels, GELU fusion default, graphs under
# offload, engine core); the demo quality gate over every code path (FP8 now with the GELU fusion), text
# to image and edits; Qwen-Image-2.1 vs diffusers eager and diffusers' regional compile (+ profile).
set -uo pipefail
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py tests/test_fp8.py tests/test_modulation_table.py \
  tests/test_engine_core.py tests/test_runtime_memory.py -k "not interpreter" 2>&1 | tail -3 | tee -a "$LOG"
timeout 100 python3 -m qwenfast.cli bench quality --paths --results "$OUT" 2>&1 | grep -v '^{' | tail -12 | tee -a "$LOG"
timeout 100 python3 -m qwenfast.cli bench quality --model edit --paths --results "$OUT" 2>&1 | grep -v '^{' | tail -12 | tee -a "$LOG"
timeout 200 python3 -m qwenfast.benchmarks.qwenimage21 --compile --profile --out "$OUT/issue18.jsonl" > "$OUT/h21.log" 2>&1
grep -v '^{' "$OUT/h21.log" | grep -v "^-\+\|Self CPU" | cut -c1-72,150-200 | tail -60 | tee -a "$LOG"
echo done | tee -a "$LOG"
