#!/usr/bin/env bash
# Session 12, H200: the GPU tests touched by this session's changes (the QK-norm kernel's Q|K-only mode and
# its callers in Qwen-Image and 2.1, FP8 attention's e4m3 Q/K outputs, the 2.1 pipeline and step cache).
set -uo pipefail
source bench/gpu_env.sh
timeout 560 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_transformer.py tests/test_attention_fp8.py \
    tests/test_fp8.py tests/test_qwenimage21.py tests/test_step_cache21.py tests/test_lora21.py tests/test_pipeline.py \
    -k "not interpreter" 2>&1 | grep -v "^SKIPPED" | tail -6 | tee -a "$LOG"
echo done | tee -a "$LOG"
