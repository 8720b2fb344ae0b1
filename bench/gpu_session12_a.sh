#!/usr/bin/env bash
# Session 12, H200 (issue 18): V projected straight into the 2.1 KV cache — the GPU tests, the cached
# step's variants in interleaved rounds against diffusers eager (bench/h21_ab.py), and where an
# end-to-end 40-step call's wall time goes beyond the transformer (bench/h21_e2e_gaps.py).
set -uo pipefail
source bench/gpu_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "qk_norm_rope" 2>&1 | tail -1 | tee -a "$LOG"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transformer21_paths.py tests/test_attention_backends.py 2>&1 | tail -2 | tee -a "$LOG"
cd bench
timeout 300 python3 h21_ab.py --out "$OUT" 2>&1 | grep -v -i warn | tee -a "$LOG"
timeout 240 python3 h21_e2e_gaps.py 2>&1 | grep -v -i warn | grep -v "should be kept in float32" | tee -a "$LOG"
echo done | tee -a "$LOG"
