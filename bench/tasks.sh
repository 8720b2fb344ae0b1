#!/usr/bin/env bash
# The tasks table (docs/benchmarks.md, "Tasks"): img2img, inpaint and edit-inpaint (30 steps), and
# ControlNet, ControlNet-Union, ControlNet-Inpainting and Layered (20 steps) at 1024² with true CFG,
# against the diffusers 0.42.1 pipeline of each task with the same random full-size weights.
# One H200 (the ControlNet rows hold two 60-block models: 87 GiB); about 9 minutes.
#   STAGE=control  only the ControlNet and Layered rows
#   STAGE=edit-2048  only Edit-2511 on a 2048² input to a 2048² output, 8 steps with true CFG, bf16 and FP8,
#                  with each engine's peak memory (one H100 or H200, about 4 minutes)
source bench/env.sh
if [ "${STAGE:-all}" = edit-2048 ]; then
    $QF bench pipeline --task edit-2511 --size 2048 --steps 8 --fp8 --results "$RESULTS"
    exit
fi
if [ "${STAGE:-all}" != control ]; then
    $QF bench pipeline --task img2img --task inpaint --task edit-inpaint --results "$RESULTS"
fi
python3 -m qwenfast.benchmarks.tasks --results "$RESULTS"
