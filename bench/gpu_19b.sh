#!/usr/bin/env bash
# Issue 19 (ControlNet + Layered), one H200: the CUDA-only checks of the ControlNet residual path
# (graphs on, fused kernels), then full-size random-weight rows vs diffusers 0.42.1, same weights,
# same run (qwenfast/benchmarks/tasks.py): a 60-block ControlNet (diffusers' default config, +FP8),
# InstantX-Union with two conditions, InstantX-Inpainting, Layered (4 layers at 640). Peak < 100 GiB,
# about 4 minutes. Prints a table and JSON lines; appends them to $OUT/tasks.jsonl.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_19b.log"
# tiny-model tests incl. the GPU one: CUDA graphs replay new ControlNet residuals == eager == diffusers
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_controlnet.py -k "cuda_graphs or one_controlnet or inpaint" 2>&1 \
    | tail -3 | tee -a "$OUT/gpu_19b.log"
timeout 420 python3 -m qwenfast.benchmarks.tasks --results "$OUT" 2>&1 | grep -v 'Warning\|warn(' | tee -a "$OUT/gpu_19b.log"
echo done | tee -a "$OUT/gpu_19b.log"
