#!/usr/bin/env bash
# One device call (H200, <= 10 min) after the FP8 short-M fix and the edit demo, most important first:
#  1. GPU tests: FP8 (padding, refusal fallback), text-encoder CUDA graph, pipeline;
#  2. `qwenfast bench pipeline --fp8 --vae`: end to end vs diffusers, then qwenfast with FP8 block GEMMs;
#     VAE rows incl. diffusers' own bf16-vs-fp32 error. JSON to $OUT/pipeline.jsonl;
#  3. the demo quality gate per code path, text-to-image (120 prompts) and edits (120 edits), JSON to
#     $OUT/quality.jsonl (tests/test_demo.py's GPU tests assert the same rows: |gap| <= 2 points);
#  4. bench/fp8_diag.py: which FP8 shapes cuBLASLt refuses; that FP8Linear and an FP8 transformer run them.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8.py tests/test_pipeline.py 2>&1 | tail -3 | tee "$OUT/gpu.log"
timeout 300 python3 -m qwenfast.cli bench pipeline --fp8 --vae --results "$OUT" 2>&1 | grep -v "it/s\]" \
    | grep -v '^{' | cut -c1-420 | tee -a "$OUT/gpu.log" | tail -14
timeout 50 python3 -m qwenfast.cli bench quality --paths --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
timeout 150 python3 -m qwenfast.cli bench quality --paths --model edit --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
timeout 45 python3 bench/fp8_diag.py 2>&1 | tail -8 | tee -a "$OUT/gpu.log"
echo done
