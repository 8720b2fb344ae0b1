#!/usr/bin/env bash
# Device call 2 of 2 for issue 6, H200, <= 5 min: `qwenfast bench pipeline --no-e2e --vae --memory --offload`
# in one process (full-size random weights built once): VAE decode/encode vs diffusers and the 2512² decode;
# built without diffusers' transformer (only its VAE, for the VAE rows), as a user's GPU memory looks: the planner
# calibration grid (goal: prediction within 10% of the measured peak), forced-OOM recovery, offload
# model / blocks, and blocks under a 24 GiB cap. $OUT/pipeline.jsonl, $OUT/memory_calibration.json.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 450 python3 -m qwenfast.cli bench pipeline --no-e2e --vae --memory --offload --results "$OUT" 2>&1 \
    | grep -v "it/s\]" | grep -v '^{' | tee "$OUT/gpu_memory.log" | tail -30
echo "exit ${PIPESTATUS[0]}"
