#!/usr/bin/env bash
# Session 10, H200: Qwen-Image-2.1's stages besides the denoise loop (bench/h21_stages.py): prompt
# encoding, VAE decode/encode at 1024² (reference modules vs the new fast path), turbo-4 end to end vs
# diffusers, and the top kernels of the text encoder, the VAE decode and our prefill step.
set -uo pipefail
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_vae21.py tests/test_vae_fast.py -k "not interpreter" 2>&1 | tail -3 | tee -a "$LOG"
timeout 400 python3 bench/h21_stages.py --out "$OUT/h21_stages.jsonl" 2>&1 | grep -v "should be kept in float32" | tee -a "$LOG"
echo done | tee -a "$LOG"
