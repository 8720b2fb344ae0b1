#!/usr/bin/env bash
# FP8 issue (16), helper hfp8q, one H200: per-token FP8 quantisation fused into the kernels that produce
# the FP8 GEMM inputs (kernels/fp8_rows.py). 1) the GPU cases of tests/test_fp8_fused.py and
# tests/test_fp8.py; 2) bench/fp8_fused_bench.py: full-size random weights at 1024² and 1328², FP8 +
# CUDA graph forward with the fusion off (before) and on (after) in the same run, rel. err vs bf16,
# kernel-time split (gemm / attention / quant / gelu / norm / other), the fused kernels alone, LoRA r64.
# JSON lines -> $OUT/fp8_fused.jsonl (for bench/results/).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py tests/test_fp8.py -k "not subprocess" 2>&1 \
  | tail -4 | tee -a "$OUT/gpu.log"
timeout 330 python3 bench/fp8_fused_bench.py --results "$OUT" 2>&1 | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
