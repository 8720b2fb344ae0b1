#!/usr/bin/env bash
# The end-to-end tables (README "Performance", docs/benchmarks.md "End to end", "VAE", "Memory and
# offload"): text encoder (random Qwen2.5-VL-7B) + denoise + VAE decode against diffusers 0.42.1's
# QwenImagePipeline with the same random full-size weights, in one process: bf16, FP8 and the `fast`
# step cache, 1024² 50 steps with true CFG and 1024² 4 steps. One H100 or H200, about 8 minutes.
#   STAGE=sizes   1328² 50 steps with true CFG and the VAE timings (about 6 minutes)
#   STAGE=memory  the memory planner's calibration and the offload modes (about 8 minutes)
source bench/env.sh
case "${STAGE:-e2e}" in
    e2e) $QF bench pipeline --case 1024:50:cfg --case 1024:4:nocfg --fp8 --cache fast --results "$RESULTS" ;;
    sizes) $QF bench pipeline --case 1328:50:cfg --fp8 --vae --results "$RESULTS" ;;
    memory) $QF bench pipeline --no-e2e --memory --offload --results "$RESULTS" ;;
    *) echo "STAGE must be e2e, sizes or memory" >&2; exit 2 ;;
esac
