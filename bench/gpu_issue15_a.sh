#!/usr/bin/env bash
# Step-caching issue, device call 1 (H200): the GPU tests of the cache (graph = eager per variant),
# then the preset sweep on the demo model (bench/cache_sweep.py: 50 steps, CFG, both suites).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_step_cache.py tests/test_engine_core.py 2>&1 | tail -3 | tee "$OUT/gpu.log"
timeout 420 python3 bench/cache_sweep.py --device cuda --results "$OUT" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
