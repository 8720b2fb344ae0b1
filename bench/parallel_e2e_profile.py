"""Where a cfg=2 (and ulysses=2) end-to-end run spends its time beyond the forwards: the GPU timeline of
rank 0 (kernel busy time, idle gaps and what surrounds the largest), one GPU vs two, full-size random
weights, 1024², true CFG.

    python bench/parallel_e2e_profile.py [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwenfast.benchmarks.parallel import generate, init_worker


def _timeline(prof) -> dict:
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                key=lambda e: e.time_range.start)  # fmt: skip
    if not ev:
        return {}
    busy, gaps, end = 0.0, [], ev[0].time_range.start
    prev = ev[0].name
    for e in ev:
        s, f = e.time_range.start, e.time_range.end
        if s > end:
            gaps.append((s - end, prev[:60], e.name[:60]))
        busy += max(0.0, f - max(s, end))
        if f > end:
            end, prev = f, e.name
    span = end - ev[0].time_range.start
    gaps.sort(reverse=True)
    return {"span_ms": round(span / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "gaps_over_20us_ms": round(sum(g for g, *_ in gaps if g > 20) / 1e3, 2),
            "top_gaps_us": [[round(g), a, b] for g, a, b in gaps[:8]]}  # fmt: skip


@torch.no_grad()
def worker(rank: int, world: int, port: int, a: argparse.Namespace) -> None:
    init_worker(rank, world, port)
    from torch.profiler import ProfilerActivity, profile

    from qwenfast.benchmarks.pipeline import build

    ours, _ = build(False, diffusers_transformer=False)
    ours.set_progress_bar_config(disable=True)

    def call(steps, cfg):
        return generate(ours, steps, cfg)

    for layout, cfg in ((None, True), ("cfg=2", True), (None, False), ("ulysses=2", False)):
        ours.configure(parallel=layout, cuda_graphs=True, batched_cfg="auto")
        if layout is None and rank != 0:
            dist.barrier()
            continue
        call(2, cfg)
        walls = {}
        for steps in (a.steps, 2 * a.steps):
            ours.text_encoder.clear_cache()
            torch.cuda.synchronize()
            if layout is not None:
                dist.barrier()
            t0 = time.perf_counter()
            call(steps, cfg)
            torch.cuda.synchronize()
            walls[steps] = time.perf_counter() - t0
        per_step = (walls[2 * a.steps] - walls[a.steps]) / a.steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call(a.steps, cfg)
            torch.cuda.synchronize()
        rec = {"layout": layout or "one GPU", "cfg": cfg, "rank": rank, "per_step_ms": round(per_step * 1e3, 2),
               "rest_ms": round((walls[a.steps] - a.steps * per_step) * 1e3, 1), **_timeline(prof)}  # fmt: skip
        print(json.dumps(rec), flush=True)
        if layout is None:
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from qwenfast.launch import free_port

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    mp.spawn(worker, args=(2, free_port(), p.parse_args()), nprocs=2, join=True)
