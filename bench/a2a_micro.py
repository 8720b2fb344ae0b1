"""Ulysses exchange microbenchmark on 2 GPUs: what one layer's q/k/v all-to-all (and the output one)
costs through NCCL, against a direct peer copy of the same bytes (copy engine over NVLink).

Per layer at 1024² with 2 ranks: q, k, v of 2112 tokens x 3072 = 39 MB sent as one all-to-all (half
stays local), the output 13 MB. Run: `python bench/a2a_micro.py` on nvidia-h200-x2."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwenfast.benchmarks import median_ms


def _time(fn) -> float:
    """Median microseconds (qwenfast's CUDA-event timer)."""
    return median_ms(fn, 5, 50) * 1e3


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(minutes=2), device_id=torch.device("cuda", rank))
    for mb in (13, 39, 78):
        n = mb * 2**20 // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        us = _time(lambda x=x, y=y: dist.all_to_all_single(y, x))
        gbs = (n * 2 / 2) / (us * 1e-6) / 1e9  # bytes that cross the link, each way
        if rank == 0:
            print(f"nccl all_to_all_single {mb} MB: {us:.0f} us, {gbs:.0f} GB/s per direction", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def peer_copies() -> None:
    for mb in (6.5, 19.5, 39):
        n = int(mb * 2**20 // 2)
        a = torch.randn(n, device="cuda:0", dtype=torch.bfloat16)
        b = torch.empty(n, device="cuda:1", dtype=torch.bfloat16)
        us = _time(lambda a=a, b=b: b.copy_(a, non_blocking=True))
        print(f"peer copy cuda:0 -> cuda:1 {mb} MB: {us:.0f} us, {n * 2 / (us * 1e-6) / 1e9:.0f} GB/s "
              f"(can_access_peer={torch.cuda.can_device_access_peer(0, 1)})", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), torch.__version__, "nccl", torch.cuda.nccl.version(), flush=True)
    peer_copies()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2, join=True)
