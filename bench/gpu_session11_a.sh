#!/usr/bin/env bash
# Session 11, nvidia-h200-x2 (lent again): where Ulysses-2 loses (kernel time by name, one GPU vs
# rank 0, CUDA-graph replays), then `qwenfast bench parallel` with the current engine.
set -uo pipefail
source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF  # symmetric memory and graphs: the allocator bench parallel has always used
echo "== kernels" | tee -a "$LOG"
timeout 200 python3 bench/parallel_kernels.py 2>&1 | grep -v Warning | tee -a "$LOG"
echo "== bench parallel" | tee -a "$LOG"
timeout ${BENCH_TIMEOUT:-330} python3 -m qwenfast.cli bench parallel ${BENCH_ARGS:-} --results "$OUT" 2>&1 | grep -v '^{' \
    | grep -v "it/s\]" | cut -c1-1500 | tee -a "$LOG"
echo done | tee -a "$LOG"
