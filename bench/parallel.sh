#!/usr/bin/env bash
# The several-GPUs table (docs/multi-gpu.md): transformer forward with `ulysses=N` (bf16, FP8, both
# Ulysses exchanges), 1024² 50 steps with `cfg=2`, 1024² 4 steps with `ulysses=N`, each against the
# one-GPU run of the same process group, and diffusers 0.42.1's own Ulysses. Needs 2 (or 4) GPUs of one
# host (nvidia-h100-x2 / nvidia-h200-x2); about 9 minutes. GPUS=2,4 runs both layouts on a 4-GPU machine.
source bench/env.sh
$QF bench parallel --gpus "${GPUS:-2}" --results "$RESULTS"
