#!/usr/bin/env bash
# Session 11, nvidia-h200-x2: the exchange kernels interleave local and remote (NVLink) writes
# (one token's head groups / entries are neighbouring programs); kernel times at 1328², where the
# end-to-end runs lose time (GPU timeline of rank 0), then `qwenfast bench parallel`.
set -uo pipefail
source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF
echo "== kernels" | tee -a "$LOG"
timeout 150 python3 bench/parallel_kernels.py --size 1328 2>&1 | grep -v -i warn | head -16 | tee -a "$LOG"
echo "== e2e profile" | tee -a "$LOG"
timeout 240 python3 bench/parallel_e2e_profile.py 2>&1 | grep -v -i warn | grep -v "it/s\]" | tee -a "$LOG"
echo "== bench parallel" | tee -a "$LOG"
timeout ${BENCH_TIMEOUT:-330} python3 -m qwenfast.cli bench parallel ${BENCH_ARGS:-} --results "$OUT" 2>&1 | grep -v '^{' \
    | grep -v "it/s\]" | cut -c1-1500 | tee -a "$LOG"
echo done | tee -a "$LOG"
