"""Ulysses exchange microbenchmark on 2+ GPUs: one attention call's exchanges (q/k/v in, output out)
at Qwen-Image's 1024² and 1328² shapes, through the peer-memory exchange (runtime/ulysses_peer.py)
and through NCCL all-to-alls (parallel.UlyssesAttention), eager and as a CUDA graph; the attention
itself is left out (inner = identity on q), so the figures are what the exchange adds per layer.
Also checks that both exchanges give the same output bit for bit. Needs 2+ GPUs (nvidia-h100-x2 /
nvidia-h200-x2), about 1 minute: `python bench/ulysses_exchange.py`."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwenfast.benchmarks import median_ms


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(minutes=3),
                            device_id=torch.device("cuda", rank))  # fmt: skip
    from qwenfast.runtime.parallel import ParallelConfig, ParallelGroups, UlyssesAttention, split_sizes
    from qwenfast.runtime.ulysses_peer import PeerUlyssesAttention

    g = ParallelGroups(ParallelConfig(ulysses=world))
    plans: dict = {}
    inner = lambda q, k, v, m: q * 1  # noqa: E731 - a stand-in attention: (B, h, S, D), a fresh tensor
    for size in (1024, 1328):
        B, H, D, Lt, N = 1, 24, 128, 128, (size // 16) ** 2
        sizes = split_sizes(N, world)
        n = sizes[rank]
        gen = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v = (torch.randn(B, Lt + n, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                   for _ in range(3))  # fmt: skip
        peer = PeerUlyssesAttention(g, sizes, Lt, plans)
        coll = UlyssesAttention(g, sizes, Lt)
        a, b = peer(inner, q, k, v, None), coll(inner, q, k, v, None)
        same = bool(torch.equal(a, b))
        row = {"size": size, "rank": rank, "peer_equals_collective": same}
        for name, w in (("peer", peer), ("collective", coll)):
            fn = lambda w=w, q=q, k=k, v=v: w(inner, q, k, v, None)  # noqa: E731
            dist.barrier()
            row[f"{name}_eager_us"] = round(median_ms(fn, 5, 50) * 1e3, 1)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    out = fn()
                graph.replay()
                torch.cuda.synchronize()
                row[f"{name}_graph_equals"] = bool(torch.equal(out, b))
                dist.barrier()
                row[f"{name}_graph_us"] = round(median_ms(graph.replay, 5, 50) * 1e3, 1)
            except Exception as e:  # noqa: BLE001 - reported
                row[f"{name}_graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    world = torch.cuda.device_count()
    print(torch.cuda.get_device_name(0), torch.__version__, "gpus", world, flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port), nprocs=world, join=True)
