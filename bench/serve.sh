#!/usr/bin/env bash
# The serving tables (docs/serving.md). One H100 or H200 each stage.
#   STAGE=uniform  `qwenfast serve`'s throughput and p50/p95 latency at concurrency 1, 2, 4, 8 with batching
#                  on and off, full-size random weights, 8 steps without CFG, at 1024² and 512² (about 6 minutes)
#   STAGE=mixed    many users at once: the seeded mixed workload (sizes, 4/8/50 steps, random LoRAs, streams,
#                  hang-ups) at concurrency 4, 8, 16 with per-row LoRAs, against the old batcher and a plain
#                  diffusers loop in the same run (about 9 minutes; GRAPHS=1 adds --cuda-graphs, GRAPH_SLOTS=N
#                  --graph-slots N, TEXT_BUCKET=N --text-bucket N, CONCURRENCY="8 16" other levels,
#                  WARM_SHAPES=1 --warm-shapes: every shape of the load once before each server's levels)
#   STAGE=rows     only the per-row LoRA overhead of one forward (batch 4, four rank-64 LoRAs, 1024²), eager
#                  and CUDA-graphed, beside FP8 and beside bf16 GEMMs (about 3 minutes)
#   STAGE=soak     the mixed workload for 8 minutes at concurrency 8 with CUDA graphs, every shape of the load
#                  run once first (--warm-shapes, into an LRU of GRAPH_SLOTS graphs, default 160: the shapes
#                  make ~80, the soak's only warm-up), a broken LoRA dropped into the folder halfway
#                  (about 13 minutes with the build, the warm-up and the drain: more than one 10-minute
#                  device call, so start it detached and collect the record in a second call:
#                  (RESULTS=/tmp/soak STAGE=soak setsid nohup bash bench/serve.sh > /tmp/soak/log 2>&1 &)
#                  then wait for /tmp/soak/serve_mixed.jsonl; DURATION=240 is a shorter check that fits one call)
#   STAGE=tiles    the per-row LoRA kernels' tile sweep on the image stream's layer shapes, then STAGE=rows at the
#                  fastest tiles (python -m qwenfast.benchmarks.lora_tiles; about 5 minutes)
#   STAGE=pair     two GPUs of one host: the soak on the first and the mixed levels on the second at once, each
#                  with its own LoRA folder ($LORAS/0, $LORAS/1) and records ($RESULTS/soak, $RESULTS/mixed); the
#                  other variables as above (about 15 minutes: start it detached, as the soak, with RESULTS under
#                  /tmp, and collect both records in a second call)
# The random LoRAs are written once to $LORAS (default .bench_loras) and reused by later stages on the same machine.
source bench/env.sh
LORAS=${LORAS:-.bench_loras}
case "${STAGE:-uniform}" in
    uniform) for size in 1024 512; do $QF bench serve --model random-full --size "$size" --results "$RESULTS"; done ;;
    mixed) $QF bench serve --workload mixed --model random-full --lora-folder "$LORAS" --diffusers-s 45 \
               ${GRAPHS:+--cuda-graphs} ${GRAPH_SLOTS:+--graph-slots $GRAPH_SLOTS} \
               ${TEXT_BUCKET:+--text-bucket $TEXT_BUCKET} ${CONCURRENCY:+--concurrency $CONCURRENCY} \
               ${WARM_SHAPES:+--warm-shapes} \
               --results "$RESULTS" ;;
    rows) for w in fp8 bf16; do
              $QF bench serve --workload rows --weights "$w" --lora-folder "$LORAS" --results "$RESULTS"
          done ;;
    soak) $QF bench serve --workload mixed --model random-full --lora-folder "$LORAS" --cuda-graphs --warm-shapes \
              --graph-slots "${GRAPH_SLOTS:-160}" ${TEXT_BUCKET:+--text-bucket $TEXT_BUCKET} \
              --duration "${DURATION:-480}" --concurrency 8 --results "$RESULTS" ;;
    tiles) python3 -m qwenfast.benchmarks.lora_tiles --rows --lora-folder "$LORAS" --results "$RESULTS" ;;
    pair) mkdir -p "$RESULTS/soak" "$RESULTS/mixed"
          CUDA_VISIBLE_DEVICES=0 RESULTS="$RESULTS/soak" LORAS="$LORAS/0" STAGE=soak bash bench/serve.sh \
              > "$RESULTS/soak/log" 2>&1 &
          CUDA_VISIBLE_DEVICES=1 RESULTS="$RESULTS/mixed" LORAS="$LORAS/1" STAGE=mixed bash bench/serve.sh \
              > "$RESULTS/mixed/log" 2>&1 &
          wait ;;
    *) echo "STAGE must be uniform, mixed, rows, soak, tiles or pair" >&2; exit 2 ;;
esac
