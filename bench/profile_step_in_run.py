"""Where a denoising step's time goes inside a real run: 1024², 50 steps, true CFG, full-size random
weights, FP8 and/or bf16, with a step-cache preset (or --cache off), true CFG or not (--cfg 1). Each
step's GPU time is the interval between CUDA events recorded by the step callback (no sync inside the
run); each step's host time likewise with perf_counter. Then one profiled run (CPU and CUDA
activities): the top host operations and kernels. GPU only (H100 / H200), about 3 minutes.

    python bench/profile_step_in_run.py [--fp8] [--cache fast|off] [--first N] [--steps N] [--cfg 1]
        [--no-profile] [--results DIR]

--first N runs the preset with N first blocks on a cached step (the cost of the cache's Fn); --no-profile
skips the profiled run (the step times alone, about a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwenfast.benchmarks import emit  # noqa: E402
from qwenfast.benchmarks.harness import PROMPT  # noqa: E402
from qwenfast.benchmarks.pipeline import build  # noqa: E402
from qwenfast.options import resolve_policy  # noqa: E402


def run_once(pipe, steps: int, seed: int = 1, record: list | None = None, cfg: float = 4.0):
    def cb(i, n, x):
        if record is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            record.append((i, e, time.perf_counter()))

    start = torch.cuda.Event(enable_timing=True)
    if record is not None:
        start.record()
        record.append((-1, start, time.perf_counter()))
    return pipe(PROMPT, negative_prompt=" " if cfg > 1 else None, height=1024, width=1024,
                num_inference_steps=steps, true_cfg_scale=cfg, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent", callback=cb)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--cache", default="fast")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--cfg", type=float, default=4.0, help="true CFG scale (1: no CFG, one forward a step)")
    p.add_argument("--first", type=int, help="the preset's first blocks (Fn) replaced by this many")
    p.add_argument("--no-profile", action="store_true", help="the step times only, no profiled run")
    p.add_argument("--results")
    a = p.parse_args()
    pipe, _ = build(False, diffusers_transformer=False)
    pipe.set_progress_bar_config(disable=True)
    if a.fp8:
        pipe.enable_fp8()
    cache = a.cache
    if a.first is not None and a.cache != "off":
        cache = dataclasses.replace(resolve_policy(a.cache), first=a.first)
    pipe.configure(cache=cache)
    policy = getattr(pipe.block_runner, "policy", None)  # None: --cache off, every step full
    run_once(pipe, a.steps, cfg=a.cfg)  # capture graphs
    torch.cuda.synchronize()
    rec: list = []
    t0 = time.perf_counter()
    run_once(pipe, a.steps, record=rec, cfg=a.cfg)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    gpu = {i: prev[1].elapsed_time(e) for prev, (i, e, _) in zip(rec, rec[1:])}
    host = {i: 1e3 * (h - prev[2]) for prev, (i, _, h) in zip(rec, rec[1:])}
    full = [i for i in gpu if i == 0 or policy is None or policy.static_full(i, a.steps)]
    cached = [i for i in gpu if i not in full]
    med = lambda d, ks: round(statistics.median(d[k] for k in ks), 3) if ks else None  # noqa: E731
    res = {"bench": "profile_step_in_run", "size": 1024, "steps": a.steps, "cfg": a.cfg, "fp8": a.fp8,
           "cache": a.cache, "first": None if policy is None else policy.first,
           "total_s": round(total, 3), "full_steps": len(full), "cached_steps": len(cached),
           "gpu_ms_full_median": med(gpu, full), "gpu_ms_cached_median": med(gpu, cached),
           "host_ms_full_median": med(host, full), "host_ms_cached_median": med(host, cached),
           "gpu_ms_step0": round(gpu[0], 3), "gpu_ms_by_step": [round(gpu[i], 2) for i in sorted(gpu)]}  # fmt: skip
    print({k: v for k, v in res.items() if k != "gpu_ms_by_step"}, flush=True)
    if a.no_profile:
        emit(res, "profile_forward.jsonl", a.results)
        return
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run_once(pipe, a.steps, cfg=a.cfg)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    print(ka.table(sort_by="self_device_time_total", row_limit=20), flush=True)
    emit(res, "profile_forward.jsonl", a.results)


if __name__ == "__main__":
    main()
