#!/usr/bin/env bash
# The FP8 table (docs/memory.md): a ComfyUI-format FP8 transformer file loaded as stored (GPU peak),
# a rank-64 LoRA unmerged beside the FP8 GEMMs (quality vs bf16 + fused LoRA, switch time), and
# 1024² 4 steps under 24 and 16 GiB caps (block offload with a budget), each cap in a fresh process.
# One H100 or H200 and ~25 GB of /tmp; about 9 minutes.
source bench/env.sh
$QF bench fp8 --stages load,lora --results "$RESULTS"
for cap in 24 16; do
    $QF bench fp8 --stages budget --caps "$cap" --budget-graphs on --results "$RESULTS"
done
