#!/usr/bin/env bash
# Issue 19 (img2img / inpainting), device call (H200): one full-size row per new pipeline vs diffusers
# 0.42.1 on the same random weights, same run (`qwenfast bench pipeline --task ...`): img2img (strength
# 0.6), inpaint (0.85), edit-inpaint (1.0, Edit v1 preprocessing: ~1024² input), 1024², 30 steps, true
# CFG 4; time, peak memory, speed-up and mean |Δ| of the images. Then the CPU-side tests of the task
# (they run on the GPU box's CPU too: a quick check that nothing there differs).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 420 python3 -m qwenfast.cli bench pipeline --task img2img --task inpaint --task edit-inpaint --steps 30 \
    --results "$OUT" 2>&1 | grep -v '^{' | tee "$OUT/gpu_19a.log"
tail -n 1 "$OUT/pipeline.jsonl" 2>/dev/null | sed 's/^{"bench": "pipeline_tasks"/{"bench": "pipeline_tasks", "label": "issue19a"/' \
    > "$OUT/pipeline_tasks_19a.jsonl" && cat "$OUT/pipeline_tasks_19a.jsonl"
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_inpaint.py -x 2>&1 | tail -2 | tee -a "$OUT/gpu_19a.log"
echo done | tee -a "$OUT/gpu_19a.log"
