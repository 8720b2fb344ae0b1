#!/usr/bin/env bash
# Issue 18 (Qwen-Image-2.1), one H200: the 2.1 transformer, qwenfast vs diffusers' QwenImage21Transformer2DModel,
# same random full-size weights (32 x 4096, ~14 GiB bf16 each; < 50 GiB peak): prefill and cached-step forward
# at 1024², bf16 and FP8, relative error of the cached step (fused Triton path) vs diffusers, and 40-step and
# 4-step denoise loops (no CFG) from those forwards. The 8B Qwen3-VL text encoder is not loaded (random
# embeddings). Writes $OUT/issue18.jsonl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
timeout 400 python3 -m qwenfast.benchmarks.qwenimage21 --size 1024 --out "$OUT/issue18.jsonl" 2>&1 | tee "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
