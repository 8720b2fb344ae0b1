#!/usr/bin/env bash
# Session 10, H200: the 2.1 VAE's shortcut fused into the upsampler, the 2.1 text encoder's CUDA graph
# (GPU tests), the VAE decode profile by shape + output-conv micro-benchmark, then the stage bench again.
set -uo pipefail
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_vae21.py tests/test_vae_fast.py tests/test_qwenimage21.py -k "not interpreter" 2>&1 | tail -3 | tee -a "$LOG"
timeout 150 python3 bench/vae21_profile.py 2>&1 | grep -v "should be kept in float32" | tee -a "$LOG"
timeout 300 python3 bench/h21_stages.py --out "$OUT/h21_stages.jsonl" 2>&1 | grep -v "should be kept in float32" | grep "^{" | tail -1 | tee -a "$LOG"
echo done | tee -a "$LOG"
