"""Where a cached step's time goes: one full and one cached transformer forward at 1024², full-size
random weights, timed as graph replays (CUDA events) and profiled eagerly (top kernels). GPU only
(H100 / H200), about 2 minutes.

    python bench/profile_cached_step.py
"""

from __future__ import annotations

import json

import torch

from qwenfast.benchmarks.pipeline import build
from qwenfast.runtime.blocks import StepContext
from qwenfast.runtime.cache import CachePolicy


def timed(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


@torch.no_grad()
def main() -> None:
    ours, _ = build(False, diffusers_transformer=False)
    ours.configure(cache=CachePolicy(kind="static", warmup=1, tail=0, every=10**6, taylor=1))
    dev, dt = ours.device, ours.dtype
    emb, mask = ours.encode_prompt(["a lighthouse at dusk"])
    x = torch.randn(1, 4096, 64, device=dev, dtype=dt)
    t = torch.full((1,), 0.5, device=dev, dtype=dt)
    shapes = [(1, 64, 64)]
    steps = {"first": StepContext(0, 10, 1.0), "full": StepContext(1, 10, 0.9), "cached": StepContext(3, 10, 0.7)}
    res = {}
    for graphs in (True, False):
        ours.configure(cuda_graphs=graphs)
        for name in ("first", "full", "cached"):
            ms = timed(lambda s=steps[name]: ours._forward(x, emb, mask, t, shapes, s))
            res[f"{'graph' if graphs else 'eager'}_{name}_ms"] = round(ms, 3)
    ours.configure(cuda_graphs=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ours._forward(x, emb, mask, t, shapes, steps["cached"])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
