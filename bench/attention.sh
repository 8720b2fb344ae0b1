#!/usr/bin/env bash
# The 8-bit attention tables (docs/speed.md): each attention engine per layer at 4224 and 7017 tokens
# (speed, error vs fp32, NaN checks, CUDA-graph replay), the 60-layer FP8 forward with bf16 and 8-bit
# attention, and the demo quality gate with 8-bit attention (text-to-image and edits).
# One H100 or H200 (Hopper: FA3's FP8 kernel; `pip install fa3-fwd` or carry its wheel); about 9 minutes.
source bench/env.sh
$QF bench attention micro --results "$RESULTS"
$QF bench attention transformer --results "$RESULTS"
$QF bench attention quality --results "$RESULTS"
$QF bench attention quality --model edit --results "$RESULTS"
# the int8 engine (INT8 Q·Kᵀ + FP8 P·V, the one that keeps the gate): forward and gate
QWENFAST_FP8_ATTENTION=int8 $QF bench attention transformer --results "$RESULTS"
QWENFAST_FP8_ATTENTION=int8 $QF bench attention quality --results "$RESULTS"
QWENFAST_FP8_ATTENTION=int8 $QF bench attention quality --model edit --results "$RESULTS"
