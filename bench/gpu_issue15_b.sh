#!/usr/bin/env bash
# Step-caching issue, device call 2 (H200): GPU tests (graph = eager for cached steps), then end to end
# with the `fast` preset next to uncached and diffusers, bf16 and FP8, same run (1024², 50 steps true
# CFG, and 4 steps no CFG), with the cost of one cached forward; then the presets' quality table.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_step_cache.py 2>&1 | tail -3 | tee "$OUT/gpu.log"
timeout 300 python3 -m qwenfast.cli bench pipeline --fp8 --cache fast --case 1024:50:cfg --case 1024:4:nocfg \
    --results "$OUT" 2>&1 | grep -v "it/s\]" | grep -v '^{' | cut -c1-700 | tee -a "$OUT/gpu.log"
timeout 60 python3 -m qwenfast.cli bench quality --cache balanced --cache fast --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
timeout 120 python3 -m qwenfast.cli bench quality --model edit --cache balanced --cache fast --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
