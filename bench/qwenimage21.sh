#!/usr/bin/env bash
# The Qwen-Image-2.1 table (docs/benchmarks.md, "Qwen-Image-2.1"): the 32-layer transformer's prefill
# and cached step (bf16, FP8) against diffusers 0.42.1 eager and regional compile, then end to end
# (random Qwen3-VL of the 8B shape as text encoder): 40 steps, the step-cache presets, turbo-4, FP8.
# One H100 or H200; about 9 minutes in two parts:
#   STAGE=transformer (default) | STAGE=e2e | STAGE=e2e-2048 (the same end to end at 2048², 2.1's own
#   default size: about 9 minutes)
source bench/env.sh
case "${STAGE:-transformer}" in
    transformer) $QF bench transformer --model-type 2.1 --results "$RESULTS" ;;
    e2e) $QF bench pipeline --model-type 2.1 --fp8 --results "$RESULTS" ;;
    e2e-2048) $QF bench pipeline --model-type 2.1 --fp8 --size 2048 --results "$RESULTS" ;;
    *) echo "STAGE must be transformer, e2e or e2e-2048" >&2; exit 2 ;;
esac
