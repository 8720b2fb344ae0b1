#!/usr/bin/env bash
# Session 10, H200: VAE resnets with the conv biases folded into the norm / residual passes (both VAEs),
# 2.1's narrow output conv; GPU kernel tests; 2.1 VAE profile; Qwen-Image VAE vs diffusers (bench
# pipeline --vae); 2.1 stages (with the text encoder's bf16 noise floor against fp32).
set -uo pipefail
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_vae21.py tests/test_vae_fast.py tests/test_vae.py -k "not interpreter" 2>&1 | tail -3 | tee -a "$LOG"
timeout 120 python3 bench/vae21_profile.py 2>&1 | grep "^{" | tee -a "$LOG"
timeout 200 python3 -m qwenfast.cli bench pipeline --vae --no-e2e --results "$OUT" 2>&1 | grep "VAE " | tee -a "$LOG"
timeout 300 python3 bench/h21_stages.py --out "$OUT/h21_stages.jsonl" 2>&1 | grep "^{" | tail -1 | tee -a "$LOG"
echo done | tee -a "$LOG"
