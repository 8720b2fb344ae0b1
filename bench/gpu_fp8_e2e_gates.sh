#!/usr/bin/env bash
# One device call (H200, <= 10 min) after the FP8 short-M fix and the edit demo:
#  1. GPU tests: FP8 (padding, refusal fallback), text-encoder CUDA graph, pipeline;
#  2. bench/fp8_diag.py: which FP8 shapes cuBLASLt refuses; that FP8Linear and an FP8 transformer run them;
#  3. the demo quality gate per code path, text-to-image (120 prompts) and edits (120 edits), JSON to
#     $OUT/quality.jsonl (tests/test_demo.py's GPU tests assert the same rows: |gap| <= 2 points);
#  4. `qwenfast bench pipeline --fp8`: end to end vs diffusers, then qwenfast with FP8 block GEMMs;
#  5. `qwenfast bench pipeline --no-e2e --vae`: VAE rows incl. diffusers' own bf16-vs-fp32 error.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8.py tests/test_pipeline.py 2>&1 | tail -3 | tee "$OUT/gpu.log"
timeout 60 python3 bench/fp8_diag.py 2>&1 | tail -12 | tee -a "$OUT/gpu.log"
timeout 60 python3 -m qwenfast.cli bench quality --paths --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
timeout 150 python3 -m qwenfast.cli bench quality --paths --model edit --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
timeout 260 python3 -m qwenfast.cli bench pipeline --fp8 --results "$OUT" 2>&1 | grep -v "it/s\]" \
    | grep -v '^{' | tee -a "$OUT/gpu.log" | tail -12
timeout 100 python3 -m qwenfast.cli bench pipeline --no-e2e --vae --results "$OUT" 2>&1 | grep "VAE 1" | cut -c1-400 | tee -a "$OUT/gpu.log"
echo done
