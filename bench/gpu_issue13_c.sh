#!/usr/bin/env bash
# Engine-core issue, device call 3 (H200): GPU tests of the new core, then the demo quality gate per
# code path on this tree (text-to-image 120 prompts, edits 120), to set against the rows of 8d50797
# in bench/results/quality.jsonl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_core.py tests/test_pipeline.py tests/test_fp8.py \
    tests/test_lora.py tests/test_runtime_memory.py tests/test_transformer.py tests/test_edit.py 2>&1 | tail -4 | tee "$OUT/gpu.log"
mkdir -p "$OUT/new"
timeout 70 python3 -m qwenfast.cli bench quality --paths --results "$OUT/new" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
timeout 330 python3 -m qwenfast.cli bench quality --paths --model edit --results "$OUT/new" 2>&1 | grep -v '^{' | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
