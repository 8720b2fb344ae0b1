#!/usr/bin/env bash
# One device call for the transformer-speed issue: GPU kernel/FP8 tests, then the benchmark at
# 1024² and 1328² against diffusers (eager + regional compile) with every qwenfast variant.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout 120 python3 -m pytest -q -x tests/test_fp8.py tests/test_kernels.py -k "not interpreter" 2>&1 | tail -4
python3 -m qwenfast.cli bench transformer --size 1024 --size 1328 --compare diffusers --iters 10 --results "$OUT"
