#!/usr/bin/env bash
# The transformer forward table (docs/benchmarks.md, "Transformer forward"): the full-size 60-layer
# transformer with random bf16 weights, 1024² and 1328², every qwenfast variant (reference, fused,
# CUDA graph, modulation table, FP8) against diffusers 0.42.1 eager and regional torch.compile, same
# weights, same process. One H100 or H200; about 5 minutes.
source bench/env.sh
$QF bench transformer --size 1024 --size 1328 --compare diffusers --results "$RESULTS"
