#!/usr/bin/env bash
# Issue 21, nvidia-h200-x4 (not lent so far): `qwenfast bench parallel` for 4 GPUs (forward ulysses=4 at
# 1024²/1328² bf16 + FP8, diffusers' own Ulysses-4; end to end cfg=2,ulysses=2 50 steps true CFG and
# ulysses=4 4 steps), each against the one-GPU baseline of the same run. GPUS=2 (a second device call:
# one command may run 10 minutes) gives the 2-GPU rows on the same machine: `GPUS=2 bash bench/gpu_issue21.sh`.
set -uo pipefail
source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF
nvidia-smi topo -m | head -8 | tee -a "$LOG"
echo "== bench parallel --gpus ${GPUS:-4}" | tee -a "$LOG"
timeout ${BENCH_TIMEOUT:-560} python3 -m qwenfast.cli bench parallel --gpus "${GPUS:-4}" ${BENCH_ARGS:-} --results "$OUT" 2>&1 \
    | grep -v '^{' | grep -v "it/s\]" | cut -c1-1500 | tee -a "$LOG"
echo done | tee -a "$LOG"
