#!/usr/bin/env bash
# Session 11, H200: attention "auto" now runs FA3 (the carried fa3-fwd wheel) on Hopper. GPU tests of the
# backends, then the Qwen-Image transformer (1024², 1328², bf16 + FP8, vs diffusers eager) with cuDNN
# forced and with the default, each its own process and diffusers baseline; then the 2.1 transformer.
set -uo pipefail
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backends.py tests/test_attention_fp8.py 2>&1 | tail -3 | tee -a "$LOG"
for att in cudnn auto; do
  echo "== transformer, QWENFAST_ATTENTION=$att" | tee -a "$LOG"
  QWENFAST_ATTENTION=$att timeout 300 python3 -m qwenfast.cli bench transformer --size 1024 --size 1328 --compare diffusers \
      --no-compile --results "$OUT" 2>&1 | grep -v '^{' | grep -v -i warn | tail -12 | tee -a "$LOG"
done
echo "== 2.1 transformer, default attention" | tee -a "$LOG"
timeout 240 python3 -m qwenfast.benchmarks.qwenimage21 --out "$OUT/issue18.jsonl" 2>&1 | grep -v '^{' | grep -v -i warn | tail -5 | tee -a "$LOG"
echo done | tee -a "$LOG"
