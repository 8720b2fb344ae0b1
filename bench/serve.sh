#!/usr/bin/env bash
# The serving table (docs/serving.md): `qwenfast serve`'s throughput and p50/p95 latency at concurrency
# 1, 2, 4, 8 with batching on and off, full-size random weights, 8 steps without CFG, at 1024² and 512².
# One H100 or H200; about 6 minutes.
source bench/env.sh
for size in 1024 512; do
    $QF bench serve --model random-full --size "$size" --results "$RESULTS"
done
