#!/usr/bin/env bash
# Issue 18 (Qwen-Image-2.1), one H200.
# 1. tests/test_transformer21_paths.py on the GPU (real Triton): our 2.1 transformer's paths (fused kernels and
#    torch reference blocks; prefill, extract and two cached steps; bf16 and fp32; 32 heads x 128) against diffusers,
#    the silu_mul kernel, and the pipeline's cached-step CUDA graphs vs eager (capture, then replay on a 2nd call).
# 2. python -m qwenfast.benchmarks.qwenimage21: full size, random weights, the 2.1 transformer vs diffusers'
#    QwenImage21Transformer2DModel in the same run: prefill and cached step at 1024² (eager and CUDA graph), bf16 and
#    FP8, rel. errors (vs the from_pretrained-equivalent oracle, and vs the old `.to(bf16)` oracle that gave "0.12"),
#    40/4-step loops, and the top CUDA kernels of a cached step (--profile). Writes $OUT/issue18.jsonl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transformer21_paths.py -k "cuda or pipeline" -rs 2>&1 \
  | tail -25 | tee -a "$OUT/gpu.log"
timeout 330 python3 -m qwenfast.benchmarks.qwenimage21 --size 1024 --profile --out "$OUT/issue18.jsonl" 2>&1 \
  | grep -v "should be kept in float32" | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
