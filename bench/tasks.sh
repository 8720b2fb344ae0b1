#!/usr/bin/env bash
# The tasks table (docs/benchmarks.md, "Tasks"): img2img, inpaint and edit-inpaint (30 steps), and
# ControlNet, ControlNet-Union, ControlNet-Inpainting and Layered (20 steps) at 1024² with true CFG,
# against the diffusers 0.42.1 pipeline of each task with the same random full-size weights.
# One H200 (the ControlNet rows hold two 60-block models: 87 GiB); about 9 minutes.
#   STAGE=control  only the ControlNet and Layered rows
source bench/env.sh
if [ "${STAGE:-all}" != control ]; then
    $QF bench pipeline --task img2img --task inpaint --task edit-inpaint --results "$RESULTS"
fi
python3 -m qwenfast.benchmarks.tasks --results "$RESULTS"
