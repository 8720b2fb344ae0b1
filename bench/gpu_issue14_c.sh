#!/usr/bin/env bash
# Multi-GPU issue, device call (nvidia-h200-x2): the peer-memory Ulysses exchange.
# 1) bench/peer_micro.py: one layer's exchanges, peer vs NCCL, eager and CUDA graph (and equality);
# 2) `qwenfast bench parallel`: forward 1024² and 1328², one GPU vs Ulysses-2 with the peer and the
#    collective exchange, bf16 and FP8 (each its own CUDA graphs), diffusers' own Ulysses at 1024²,
#    then end to end 1024² 50 steps true CFG (cfg=2) and 4 steps no CFG (ulysses=2).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.log"
echo "== peer micro" | tee -a "$OUT/gpu.log"
timeout 120 python3 bench/peer_micro.py 2>&1 | grep -v Warning | tail -20 | tee -a "$OUT/gpu.log"
echo "== bench parallel" | tee -a "$OUT/gpu.log"
timeout ${BENCH_TIMEOUT:-420} python3 -m qwenfast.cli bench parallel ${BENCH_ARGS:-} --results "$OUT" 2>&1 | grep -v '^{' \
    | grep -v "it/s\]" | cut -c1-1500 | tee -a "$OUT/gpu.log"
echo done | tee -a "$OUT/gpu.log"
