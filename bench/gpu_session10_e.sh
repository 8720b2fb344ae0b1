#!/usr/bin/env bash
# Session 10, H200: the 2.1 / VAE GPU tests (summary printed), then the 2.1 transformer bench (prefill
# attention written token-major) vs diffusers eager, default attention.
set -uo pipefail
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_qwenimage21.py tests/test_step_cache21.py tests/test_transformer21_paths.py tests/test_vae21.py 2>&1 | grep -v "^SKIPPED" | tail -8 | tee -a "$LOG"
timeout 240 python3 -m qwenfast.benchmarks.qwenimage21 --out "$OUT/issue18.jsonl" 2>&1 | grep -v '^{' | grep -v -i warn | tail -5 | tee -a "$LOG"
echo done | tee -a "$LOG"
