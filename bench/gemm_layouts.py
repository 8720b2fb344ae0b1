"""Which split of a Qwen-Image-2.1 block's GEMMs runs fastest under sustained load (GPU only, ~1 minute).

A GEMM timed in short bursts runs at full clock; under sustained load an H100/H200 holds its power limit
by lowering the SM clock, and GEMM layouts can differ there. Each layout is one CUDA graph of the 32
blocks' GEMMs at the cached step's shapes (M = 4096 image tokens, bf16, random weights): "fused"
(Q|K|V, out, gate|up, down), "qk + v" (V by its own GEMM, what the model runs), "split gate/up" (gate
and up as two N = 12288 GEMMs), "diffusers" (q, k, v, out, gate, up, down). Rounds interleave the
layouts, each replayed back to back for ~1.5 s; reported: median ms per replay, TFLOP/s and the median
SM clock while it ran.  `python bench/gemm_layouts.py [--results DIR]` (record: DIR/gemm_layouts.jsonl)
"""

import argparse
import statistics
import time

import torch
from profile_forward import _with_clocks

from qwenfast.benchmarks import emit

LAYOUTS = {  # output widths of the GEMMs of one block, K = 4096 unless noted (down: K = 12288)
    "fused": [12288, 4096, 24576, "down"],
    "qk + v": [8192, 4096, 4096, 24576, "down"],
    "split gate/up": [12288, 4096, 12288, 12288, "down"],
    "diffusers": [4096, 4096, 4096, 4096, 12288, 12288, "down"],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--results", default=None, help="append the record to DIR/gemm_layouts.jsonl")
    a = p.parse_args()
    dev, dt, M, D, F = "cuda", torch.bfloat16, 4096, 4096, 12288
    x = torch.randn(M, D, device=dev, dtype=dt)
    xd = torch.randn(M, F, device=dev, dtype=dt)
    graphs, flops, keep = {}, {}, []  # keep: the graphs read these weights and outputs
    for name, widths in LAYOUTS.items():
        ws = [[torch.randn(D, F, device=dev, dtype=dt) * F**-0.5 if n == "down"
               else torch.randn(n, D, device=dev, dtype=dt) * D**-0.5 for n in widths]
              for _ in range(a.layers)]  # fmt: skip
        outs = [torch.empty(M, w.shape[0], device=dev, dtype=dt) for w in ws[0]]

        def seq(ws=ws, outs=outs):
            for layer in ws:
                for w, o in zip(layer, outs):
                    torch.mm(xd if w.shape[1] == F else x, w.t(), out=o)

        seq()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            seq()
        graphs[name] = g
        flops[name] = sum(2 * M * w.shape[0] * w.shape[1] for w in ws[0]) * a.layers
        keep.append((ws, outs))
    res = {k: {"ms": [], "mhz": []} for k in graphs}
    for _ in range(a.rounds):
        for name, g in graphs.items():
            g.replay()
            torch.cuda.synchronize()

            def burst(g=g):
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < a.seconds:
                    g.replay()
                    n += 1
                    if n % 4 == 0:
                        torch.cuda.synchronize()
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / n * 1000

            ms, clk, *_ = _with_clocks(burst)
            res[name]["ms"].append(ms)
            res[name]["mhz"].append(clk["median"])
    rec = {"bench": "gemm_layouts", "what": "2.1 block GEMMs under sustained load", "layers": a.layers}
    print(f"{'layout':<15} {'ms':>8} {'TFLOP/s':>8} {'MHz':>6}  rounds")
    for name, r in res.items():
        ms = statistics.median(r["ms"])
        rec[name] = {"ms": round(ms, 2), "tflops": round(flops[name] / ms / 1e9, 1), "mhz": statistics.median(r["mhz"]),
                     "rounds_ms": [round(v, 2) for v in r["ms"]]}  # fmt: skip
        print(f"{name:<15} {ms:>8.2f} {rec[name]['tflops']:>8} {rec[name]['mhz']:>6}  {rec[name]['rounds_ms']}")
    emit(rec, "gemm_layouts.jsonl", a.results)


if __name__ == "__main__":
    main()
