#!/usr/bin/env bash
# Session 11, nvidia-h200-x2: the multi-GPU acceptance run — `qwenfast bench parallel` (forward 1024² /
# 1328² bf16 + FP8, both exchanges, diffusers' own Ulysses-2; end to end cfg=2 50 steps true CFG and
# ulysses=2 4 steps), with the interleaved exchange writes and the once-per-mask cfg trim.
set -uo pipefail
source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF
echo "== bench parallel" | tee -a "$LOG"
timeout ${BENCH_TIMEOUT:-400} python3 -m qwenfast.cli bench parallel ${BENCH_ARGS:-} --results "$OUT" 2>&1 | grep -v '^{' \
    | grep -v "it/s\]" | cut -c1-1500 | tee -a "$LOG"
echo done | tee -a "$LOG"
