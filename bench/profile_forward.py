"""Where the FP8 transformer forward's time goes: kernel time by category and idle time between kernels.

GPU only (H100 / H200), full-size random weights, about 2 minutes. Builds the 60-layer transformer, FP8 block Linears, the modulation table entry and a CUDA graph (what a
denoising step runs), times the replay (CUDA events), then profiles one replay and reads the kernel
timeline from the Chrome trace: kernel-time sum by category, the idle time between consecutive kernels
(total, and by the pair of kernels around each gap), and the kernel count. Prints a table and a JSON line.
`python bench/profile_forward.py [--size 1024] [--gelu sigmoid|tanhf] [--results DIR]` (record:
DIR/profile_forward.jsonl); --gelu times the MLP's GELU kernel in either form (the A/B of its change).
"""

import argparse
import collections
import json
import os
import tempfile

import torch

from qwenfast.benchmarks import emit, median_ms, versions
from qwenfast.benchmarks.transformer import _fp8_modules, _swap, _table_fwd, build
from qwenfast.kernels import gelu
from qwenfast.runtime.cuda_graphs import CudaGraphRunner


def cat(name: str) -> str:
    n = name.lower()
    for key, words in (("attention", ("sdpa", "flash", "fmha", "attention")),
                       ("gemm", ("nvjet", "gemm", "cutlass", "xmma")), ("quant", ("quant",)),
                       ("gelu", ("gelu",)), ("norm", ("residual", "layernorm", "rmsnorm")),
                       ("qk_norm_rope", ("qk_norm",))):  # fmt: skip
        if any(w in n for w in words):
            return key
    return "other"


def timeline(fn) -> list[tuple[float, float, str]]:
    """(start_us, end_us, name) of every GPU kernel in one call of fn, in start order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    ks = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(ks)


def kernel_summary(ks: list[tuple[float, float, str]]) -> tuple[collections.Counter, list[float], collections.Counter]:
    """Of a `timeline`: (kernel us by category, each idle gap between consecutive kernels in us,
    idle us by the (category before, category after) pair)."""
    busy, gaps, pairs = collections.Counter(), [], collections.Counter()
    for s, e, n in ks:
        busy[cat(n)] += e - s
    for (_s0, e0, n0), (s1, _, n1) in zip(ks, ks[1:]):
        gaps.append(max(0.0, s1 - e0))
        pairs[(cat(n0), cat(n1))] += gaps[-1]
    return busy, gaps, pairs


def _with_clocks(f):
    """f() while `nvidia-smi` samples the SM clock, the power draw and whether the software power cap is
    holding the clock down, every ~10-50 ms: (result, {min, median, max, n} MHz, {median, max} W, the
    share of samples with the power cap active (None where the driver has no such field))."""
    import subprocess
    import threading

    fields = "clocks.sm,power.draw,clocks_event_reasons.sw_power_cap"
    samples, stop = [], threading.Event()

    def poll() -> None:
        nonlocal fields
        while not stop.is_set():
            r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode and fields.count(",") == 2:  # an older driver: no event reasons field
                fields = "clocks.sm,power.draw"
                continue
            if r.returncode:  # nvidia-smi itself failed: no samples (n = 0), not a loop of failed calls
                return
            row = [v.strip() for v in r.stdout.splitlines()[0].split(",")] if r.stdout.strip() else []
            if row and row[0].isdigit():
                samples.append(row)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        r = f()
    finally:
        stop.set()
        th.join()
    clk = sorted(int(x[0]) for x in samples) or [0]
    watts = sorted(float(x[1]) for x in samples if x[1].replace(".", "", 1).isdigit()) or [0.0]
    caps = [x[2] == "Active" for x in samples if len(x) > 2]
    return (
        r,
        {"min": clk[0], "median": clk[len(clk) // 2], "max": clk[-1], "n": len(samples)},
        {"median": watts[len(watts) // 2], "max": watts[-1]},
        round(sum(caps) / len(caps), 3) if caps else None,
    )


def fp8_forward(size: int = 1024, fp8: bool = True):
    """The 60-block transformer (random bf16 weights) with FP8 block Linears (`fp8`), fused, and the
    forward a denoising step replays: CUDA graph, modulation rows from a table entry. Returns (model,
    forward, its inputs (x, txt, t, img_shapes))."""
    model, _ = build(60, compare=False)
    h = w = size // 16
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, h * w, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    txt = torch.randn(1, 128, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([0.7], device="cuda")
    if fp8:
        _swap(model, _fp8_modules(model))
    model.fused = True
    inputs = (x, txt, t, [(1, h, w)])
    return model, _table_fwd(model, CudaGraphRunner(model), x, txt, t, [(1, h, w)]), inputs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--results", default=None, help="append the record to DIR/profile_forward.jsonl")
    p.add_argument("--gelu", choices=("sigmoid", "tanhf"), default=None,
                   help="the MLP's GELU + FP8 kernel form (kernels/gelu.py CONFIG['sigmoid']); default: the module's")  # fmt: skip
    a = p.parse_args()
    if a.gelu:
        gelu.CONFIG["sigmoid"] = a.gelu == "sigmoid"
    model, fn, _ = fp8_forward(a.size)
    with torch.no_grad():
        fn()  # the CUDA graph's capture, outside the sampled loop (its idle seconds would skew the clock)
        torch.cuda.synchronize()
        wall, clocks, watts, capped = _with_clocks(lambda: median_ms(fn, 3, 40))
        spaced = median_ms(fn, 0, 8, pause_s=0.3)
        ks = timeline(fn)
    busy, gaps, pairs = kernel_summary(ks)
    span = ks[-1][1] - ks[0][0]
    res = {"bench": "profile_forward", **versions(), "size": a.size,
           "gelu": "sigmoid" if gelu.CONFIG["sigmoid"] else "tanhf", "wall_ms": round(wall, 2), "spaced_ms": round(spaced, 2),
           "sm_clock_mhz_in_loop": clocks, "power_w_in_loop": watts, "power_capped_share": capped, "profiled_span_ms": round(span / 1e3, 2),
           "kernels": len(ks), "kernel_ms": round(sum(busy.values()) / 1e3, 2),
           "gap_ms": round(sum(gaps) / 1e3, 2), "gap_us_median": round(sorted(gaps)[len(gaps) // 2], 2),
           "by_category_ms": {k: round(v / 1e3, 2) for k, v in busy.most_common()},
           "gap_ms_by_pair": {f"{a}->{b}": round(v / 1e3, 2) for (a, b), v in pairs.most_common(12)}}  # fmt: skip
    print(f"back to back: {res['wall_ms']} ms, SM clock {clocks}, power {watts} W, power cap active in "
          f"{capped} of the samples; after 0.3 s idle each: {res['spaced_ms']} ms")  # fmt: skip
    print(f"FP8 forward {a.size}²: wall {res['wall_ms']} ms (replay), profiled span {res['profiled_span_ms']} ms, "
          f"{res['kernels']} kernels, kernel time {res['kernel_ms']} ms, idle between kernels {res['gap_ms']} ms "
          f"(median gap {res['gap_us_median']} us)")  # fmt: skip
    for k, v in res["by_category_ms"].items():
        print(f"  {k:14} {v:8.2f} ms")
    for k, v in res["gap_ms_by_pair"].items():
        print(f"  gap {k:26} {v:8.2f} ms")
    emit(res, "profile_forward.jsonl", a.results)


if __name__ == "__main__":
    main()
