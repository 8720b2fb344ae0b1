#!/usr/bin/env bash
# Session 10, H200: GPU tests of the code shared with Qwen-Image that session 10 changed (VAE resnets,
# TextEncoderGraphs): the pipeline, VAE and demo tests; then the demo quality gate's pipeline paths.
set -uo pipefail
source bench/gpu_env.sh
timeout 420 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_pipeline.py tests/test_vae.py tests/test_demo.py tests/test_edit.py 2>&1 | grep -v "^SKIPPED" | tail -8 | tee -a "$LOG"
timeout 150 python3 -m qwenfast.cli bench quality --paths --results "$OUT" 2>&1 | grep -v '^{' | tail -10 | tee -a "$LOG"
echo done | tee -a "$LOG"
