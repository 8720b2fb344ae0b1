#!/usr/bin/env bash
# Session 12, H200 (issue 18): the 2.1 benchmarks from the CLI with V projected into the KV cache —
# `qwenfast bench transformer --model-type 2.1` (prefill / cached step, bf16 + FP8, diffusers eager and
# regional compile); STAGE=e2e: `qwenfast bench pipeline --model-type 2.1 --fp8` (a second device call).
set -uo pipefail
source bench/gpu_env.sh
if [ "${STAGE:-transformer}" = transformer ]; then
    timeout 500 python3 -m qwenfast.cli bench transformer --model-type 2.1 --results "$OUT" 2>&1 | grep -v '^{' \
        | grep -v -i warn | tail -8 | tee -a "$LOG"
else
    timeout 560 python3 -m qwenfast.cli bench pipeline --model-type 2.1 --fp8 --results "$OUT" 2>&1 | grep -v '^{' \
        | grep -v "should be kept in float32" | grep -v -i warn | tee -a "$LOG"
fi
echo done | tee -a "$LOG"
