"""Where a Ulysses-2 forward loses against half of the one-GPU forward: kernel time by kernel name,
one GPU vs rank 0 of Ulysses-2 (peer exchange), both CUDA-graph replays, full size, bf16. Needs 2 GPUs
(nvidia-h100-x2 / nvidia-h200-x2), about 3 minutes.

    python bench/profile_parallel.py [--size 1328] [--layers 60]

Prints, per size, the kernels (summed per forward) sorted by "2-GPU time minus half the one-GPU time":
the top rows are what the split does not halve (the exchange, the replicated text stream, barriers).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwenfast.benchmarks.parallel import forward_inputs, init_worker

REPLAYS = 3


def _kernels(fn) -> tuple[dict[str, float], float]:
    """{kernel name: µs per call} over REPLAYS calls of fn, and the wall µs per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(REPLAYS):
            fn()
        end.record()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out[e.key[:90]] += t / REPLAYS
    return out, start.elapsed_time(end) * 1e3 / REPLAYS


@torch.no_grad()
def worker(rank: int, world: int, port: int, a: argparse.Namespace) -> None:
    init_worker(rank, world, port)
    from qwenfast.benchmarks.transformer import build
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner
    from qwenfast.runtime.parallel import ParallelConfig, ParallelForward, ParallelGroups

    ours, _ = build(a.layers, compare=False)
    groups = ParallelGroups(ParallelConfig(ulysses=world), exchange="peer")
    for size in a.size:
        x, txt, t, shapes, step, mods = forward_inputs(ours, size)
        one_graphs = CudaGraphRunner(ours)
        one = {}
        if rank == 0:
            one, one_wall = _kernels(lambda: one_graphs(x, txt, None, t, shapes, step=step, modulations=mods))  # noqa: B023
        dist.barrier()
        graphs = CudaGraphRunner(ours)
        par = ParallelForward(lambda *a_, shard=None: graphs(*a_[:5], step=a_[5], shard=shard, modulations=mods), groups)  # noqa: B023
        par(x, txt, None, t, shapes, step)  # both ranks capture their graphs before either profiles:
        torch.cuda.synchronize()  # otherwise rank 0's first barrier waits out rank 1's capture
        dist.barrier()
        two, two_wall = _kernels(lambda: par(x, txt, None, t, shapes, step))  # noqa: B023
        if rank == 0:
            names = set(one) | set(two)
            rows = sorted(((two.get(k, 0.0) - one.get(k, 0.0) / world, one.get(k, 0.0), two.get(k, 0.0), k) for k in names),
                          reverse=True)  # fmt: skip
            print(f"== {size}²: one GPU {one_wall / 1e3:.2f} ms wall, {sum(one.values()) / 1e3:.2f} ms kernels; "
                  f"ulysses={world} rank 0 {two_wall / 1e3:.2f} ms wall, {sum(two.values()) / 1e3:.2f} ms kernels")  # fmt: skip
            print(f"{'excess µs':>10} {'1 GPU µs':>10} {'2 GPU µs':>10}  kernel")
            for ex, o, w, k in rows[:22]:
                print(f"{ex:10.0f} {o:10.0f} {w:10.0f}  {k}")
            print(json.dumps({"size": size, "one_wall_us": round(one_wall), "two_wall_us": round(two_wall),
                              "top": [[round(ex), round(o), round(w), k] for ex, o, w, k in rows[:22]]}))  # fmt: skip
        one_graphs.clear()
        graphs.clear()
        torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from qwenfast.launch import free_port

    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, action="append")
    p.add_argument("--layers", type=int, default=60)
    a = p.parse_args()
    a.size = a.size or [1024, 1328]
    mp.spawn(worker, args=(2, free_port(), a), nprocs=2, join=True)
