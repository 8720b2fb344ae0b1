#!/usr/bin/env bash
# Device call 1 of 2 for issue 6, H200, <= 10 min:
#  1. GPU tests: kernels (incl. the shared _row_coords prologue), FP8 (incl. short-M padding), the
#     text-encoder CUDA graph, fast VAE, runtime, VAE vs diffusers;
#  2. bench/fp8_diag.py: which FP8 GEMM shapes cuBLASLt refuses, and that FP8Linear runs them all;
#  3. `qwenfast bench pipeline --fp8`: end to end vs diffusers (same random full-size weights, same run),
#     then qwenfast again with FP8 block GEMMs. JSON lines to $OUT/pipeline.jsonl.
# (The demo score per code path: `qwenfast bench quality --paths`, run with the issue-5 device call.)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_fp8.py tests/test_vae_fast.py \
    tests/test_runtime_memory.py tests/test_vae.py tests/test_pipeline.py -k "not interpreter" 2>&1 | tail -4 | tee "$OUT/gpu_e2e.log"
timeout 60 python3 bench/fp8_diag.py 2>&1 | tail -20 | tee -a "$OUT/gpu_e2e.log"
timeout 330 python3 -m qwenfast.cli bench pipeline --fp8 --results "$OUT" 2>&1 | grep -v "it/s\]" \
    | grep -v '^{' | tee -a "$OUT/gpu_e2e.log" | tail -20
echo "exit ${PIPESTATUS[0]}"
