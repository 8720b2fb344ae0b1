#!/usr/bin/env bash
# The 8-bit attention tables (docs/speed.md): each attention engine per layer at 4224, 7017, 16512 and 24777
# tokens (speed, error vs fp32, NaN checks, CUDA-graph replay), the int8 kernel over its tiles, the 60-layer
# FP8 forward with bf16 and 8-bit attention, and the demo quality gate with 8-bit attention (text-to-image
# and edits), for the auto engine and the int8 engine (the one that keeps the gate).
# One H100 or H200 (Hopper: FA3's FP8 kernel; `pip install fa3-fwd` or carry its wheel); about 11 minutes.
#   STAGE=sage: SageAttention 2's Hopper kernel (the "sage" engine) instead: built from .sage/ first
#   (bench/build_sageattention.py says how to fill it), then the per-layer table with it, its forward and
#   its gate (the build a few minutes, the rest about 7).
source bench/env.sh
if [ "${STAGE:-all}" = sage ]; then
    python3 bench/build_sageattention.py --src "${SAGE_SRC:-.sage}" --target /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    $QF bench attention micro --results "$RESULTS"
    for m in "" "--model edit"; do QWENFAST_FP8_ATTENTION=sage $QF bench attention quality $m --results "$RESULTS"; done
    QWENFAST_FP8_ATTENTION=sage exec $QF bench attention transformer --results "$RESULTS"
fi
$QF bench attention micro --results "$RESULTS"
$QF bench attention tiles --results "$RESULTS"
$QF bench attention transformer --results "$RESULTS"
$QF bench attention quality --results "$RESULTS"
$QF bench attention quality --model edit --results "$RESULTS"
# the int8 engine (INT8 Q·Kᵀ + FP8 P·V, the one that keeps the gate): forward and gate
QWENFAST_FP8_ATTENTION=int8 $QF bench attention transformer --results "$RESULTS"
QWENFAST_FP8_ATTENTION=int8 $QF bench attention quality --results "$RESULTS"
QWENFAST_FP8_ATTENTION=int8 $QF bench attention quality --model edit --results "$RESULTS"
