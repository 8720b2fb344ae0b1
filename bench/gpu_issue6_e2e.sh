#!/usr/bin/env bash
# Device call 1 of 2 for issue 6 (+ issue 5's GPU quality gate), H200, <= 10 min:
#  1. GPU tests: kernels (incl. the shared _row_coords prologue), FP8, fast VAE, runtime, VAE vs diffusers,
#     and the demo model's score per code path (fp32 reference .. FP8, within 2 points);
#  2. `qwenfast bench quality --paths` (the table behind that test, JSON to $OUT/quality.jsonl);
#  3. `qwenfast bench pipeline --fp8`: end to end vs diffusers (same random full-size weights, same run),
#     then qwenfast again with FP8 block GEMMs. JSON lines to $OUT/pipeline.jsonl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_fp8.py tests/test_vae_fast.py \
    tests/test_runtime_memory.py tests/test_vae.py tests/test_demo.py -k "not interpreter" 2>&1 | tail -6 | tee "$OUT/gpu_e2e.log"
timeout 120 python3 -m qwenfast.cli bench quality --paths --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu_e2e.log"
timeout 330 python3 -m qwenfast.cli bench pipeline --fp8 --results "$OUT" 2>&1 | grep -v "it/s\]" \
    | grep -v '^{' | tee -a "$OUT/gpu_e2e.log" | tail -20
echo "exit ${PIPESTATUS[0]}"
