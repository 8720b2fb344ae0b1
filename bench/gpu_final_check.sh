#!/usr/bin/env bash
# Final check on the H200 of the whole tree: every GPU test of the engine (pipeline, FP8, LoRA, runtime,
# transformer, edit, engine core, step cache, kernels and fast VAE on CUDA), then the edit presets'
# quality table with CUDA graphs on (the graph pool fix: no eager fallback when the preset changes).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_pipeline.py tests/test_fp8.py tests/test_lora.py \
    tests/test_runtime_memory.py tests/test_transformer.py tests/test_edit.py tests/test_engine_core.py \
    tests/test_step_cache.py tests/test_kernels.py tests/test_vae_fast.py -k "not interpreter" 2>&1 | tail -4 | tee "$OUT/gpu.log"
timeout 150 python3 -m qwenfast.cli bench quality --model edit --cache balanced --cache fast --results "$OUT" \
    > "$OUT/quality_edit.log" 2>&1
grep -v '^{' "$OUT/quality_edit.log" | tail -6 | tee -a "$OUT/gpu.log"
echo "graph capture failures: $(grep -c 'capture failed' "$OUT/quality_edit.log")" | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
