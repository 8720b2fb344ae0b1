"""Profile one Ulysses-2 transformer forward at 1024² on rank 0 (2 GPUs, NCCL): where the time goes."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(minutes=5),
                            device_id=torch.device("cuda", rank))  # fmt: skip
    from qwenfast.benchmarks.transformer import build
    from qwenfast.runtime.blocks import StepContext
    from qwenfast.runtime.parallel import ParallelConfig, ParallelForward, ParallelGroups

    with torch.no_grad():
        ours, _ = build(60, compare=False)
        groups = ParallelGroups(ParallelConfig(ulysses=world))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        txt = torch.randn(1, 128, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
        t = torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16)
        step = StepContext(0, 1, 0.5)
        par = ParallelForward(lambda *a, shard=None: ours(*a[:5], step=a[5], shard=shard), groups)
        for _ in range(3):
            par(x, txt, None, t, [(1, 64, 64)], step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        par(x, txt, None, t, [(1, 64, 64)], step)
        cpu_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        act = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=act) as prof:
            par(x, txt, None, t, [(1, 64, 64)], step)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"one forward: host returns after {cpu_s * 1e3:.1f} ms, done after {wall * 1e3:.1f} ms")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    dist.destroy_process_group()


if __name__ == "__main__":
    from qwenfast.launch import free_port

    mp.spawn(worker, args=(2, free_port()), nprocs=2, join=True)
