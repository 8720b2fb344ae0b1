#!/usr/bin/env bash
# The Qwen-Image-2.1 table (docs/benchmarks.md, "Qwen-Image-2.1"): the 32-layer transformer's prefill
# and cached step (bf16, FP8) against diffusers 0.42.1 eager and regional compile, then end to end
# (random Qwen3-VL of the 8B shape as text encoder): 40 steps, the step-cache presets, turbo-4, FP8.
# One H100 or H200; about 9 minutes in two parts:
#   STAGE=transformer (default) | STAGE=e2e
source bench/env.sh
if [ "${STAGE:-transformer}" = transformer ]; then
    $QF bench transformer --model-type 2.1 --results "$RESULTS"
else
    $QF bench pipeline --model-type 2.1 --fp8 --results "$RESULTS"
fi
