#!/usr/bin/env bash
# Session 9, H200, last check of the tree: every GPU test of the engine after today's changes (the QK-norm
# kernel's new e4m3 outputs, the 8-bit attention joint path, quantize_heads).
set -uo pipefail
source bench/gpu_env.sh
export QWENFAST_FP8_ATTENTION=fa3
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_attention_fp8.py tests/test_transformer.py \
  tests/test_pipeline.py tests/test_edit.py tests/test_fp8.py tests/test_fp8_fused.py tests/test_engine_core.py \
  tests/test_step_cache.py tests/test_modulation_table.py -k "not interpreter" 2>&1 | grep -v "^SKIPPED" | tail -6 | tee -a "$LOG"
echo done | tee -a "$LOG"
