#!/usr/bin/env bash
# The quality-gate tables (docs/quality.md, docs/speed.md): the demo model's held-out suites scored on
# every code path (fp32 reference, bf16, fused kernels, CUDA graphs, batched CFG, FP8), then the
# step-cache presets at 50 steps with CFG against the uncached images of the same seeds.
# One H100 or H200; about 8 minutes. (The default-settings scores run on a CPU:
# `qwenfast bench quality --n 120 --results bench/results` and `... --model edit`.)
source bench/env.sh
for model in demo edit; do
    m=$([ "$model" = edit ] && echo "--model edit" || true)
    $QF bench quality --paths $m --results "$RESULTS"
    $QF bench quality --cache balanced --cache fast $m --results "$RESULTS"
done
