"""Is the diffusers baseline what a diffusers user gets? diffusers' 60-layer forward at 1024² (mask None),
timed alone in a fresh process or after the transformer bench's setup (qwenfast's model built over the
same weights, optionally the compiler imported): median GPU ms (CUDA events) and median host ms to
enqueue one forward. Run each configuration in its own process:

    python bench/diffusers_baseline.py alone|bench|bench+inductor [--busy N] [--results bench/results]

--busy N: N other processes keep N CPU cores busy while it runs (a host shared with other work, e.g. a
compile's worker pool). --slow-host: a no-op line tracer (sys.settrace) makes this process's host side
slower (as a slower CPU would): were diffusers' eager forward launch-bound, its GPU time would follow.
--leave-gib G: a filler tensor takes all but G GiB of the free GPU memory before the timing (the headroom an
80 GB card has with two 41 GB models resident, as in the transformer bench); the record gives free and
reserved memory and the caching allocator's retries (a cudaFree + cudaMalloc after a failed allocation).

With FlashAttention-3 installed or not, and PYTORCH_CUDA_ALLOC_CONF set or not, as the environment has
it (the record says which). One H100 / H200 GPU, under a minute a configuration.
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, warmup: int = 3, iters: int = 10) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    return round(statistics.median(gpu), 1), round(statistics.median(host), 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["alone", "bench", "bench+inductor"])
    p.add_argument("--busy", type=int, default=0, help="CPU-spinning processes during the run (default 0)")
    p.add_argument("--slow-host", action="store_true", help="a no-op line tracer on every Python line")
    p.add_argument("--leave-gib", type=float, default=None, help="fill the GPU but this many GiB")
    p.add_argument("--results", help="append the record to DIR/diffusers_baseline.jsonl")
    a = p.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        run(a)
    finally:
        for s in spinners:
            s.kill()


def run(a: argparse.Namespace) -> None:
    if a.mode == "alone":  # nothing of qwenfast imported
        from diffusers import QwenImageTransformer2DModel

        torch.manual_seed(0)
        with torch.device("cuda"):
            torch.set_default_dtype(torch.bfloat16)
            ref = QwenImageTransformer2DModel(num_layers=60).eval().requires_grad_(False)
            torch.set_default_dtype(torch.float32)
    else:
        from qwenfast.benchmarks.transformer import build

        if a.mode == "bench+inductor":
            from qwenfast.runtime.cuda_graphs import compile_blocks  # noqa: F401  (what the bench imports)
        _, ref = build(60, True)
    g = torch.Generator(device="cuda").manual_seed(1024)
    x = torch.randn(1, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    txt = torch.randn(1, 128, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([0.7], device="cuda")

    def fwd():
        return ref(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=None, timestep=t,
                   img_shapes=[[(1, 64, 64)]], return_dict=False)[0]  # fmt: skip

    filler = None
    if a.leave_gib is not None:
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(max(0, free - int(a.leave_gib * 2**30)), dtype=torch.uint8, device="cuda")
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    mem = {"free_gib_before": round(torch.cuda.mem_get_info()[0] / 2**30, 2),
           "reserved_minus_allocated_gib": round((torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**30, 2)}  # fmt: skip
    if a.slow_host:

        def trace(*_):
            return trace

        sys.settrace(trace)
    with torch.no_grad():
        first = timed(fwd)
        time.sleep(2)
        again = timed(fwd)
    sys.settrace(None)
    mem["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    mem["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del filler
    from qwenfast.benchmarks import emit

    fa3 = any(importlib.util.find_spec(m) for m in ("fa3_fwd_interface", "flash_attn_interface"))
    emit({"bench": "diffusers_baseline", "mode": a.mode, "busy_cpu_processes": a.busy, "slow_host": a.slow_host, "fa3_installed": fa3, "leave_gib": a.leave_gib, **mem,
          "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "ms": first[0], "host_ms": first[1],
          "ms_after_2s_idle": again[0], "host_ms_after_2s_idle": again[1]},
         "diffusers_baseline.jsonl", a.results)  # fmt: skip


if __name__ == "__main__":
    main()
