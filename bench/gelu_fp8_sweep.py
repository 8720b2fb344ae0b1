"""The MLP's GELU + per-row FP8 quantisation in one kernel (kernels/gelu.py `gelu_tanh_fp8`), GPU only.

1. The op at 1024² (4096 image rows and 128 text rows x 12288, bf16): torch's GELU then the separate
   quantisation pass (the default path) vs the chunked kernel over a sweep of chunk / warps; e4m3
   codes that differ.
2. The full FP8 transformer forward (60 blocks, random weights, CUDA graph + modulation table) with
   the GELU fusion off (default so far) and on with the best configuration; kernel time by category.
Prints a table and JSON lines (`--out DIR`: appended to DIR/gelu_fp8.jsonl).
"""

import argparse
import os

import torch
import torch.nn.functional as F

from qwenfast.benchmarks import emit, median_ms, rel_err, versions
from qwenfast.kernels import gelu as G
from qwenfast.kernels.fp8_linear import quantize_activation
from qwenfast.kernels.fp8_rows import set_fp8_fusion


def op_sweep() -> dict:
    rows = {}
    for m in (4096, 128):
        h = torch.randn(m, 12288, device="cuda", dtype=torch.bfloat16) * 3
        ref = quantize_activation(F.gelu(h, approximate="tanh"))
        base = median_ms(lambda h=h: quantize_activation(F.gelu(h, approximate="tanh")), 5, 50) * 1e3
        r = {"unfused_us": round(base, 1)}
        for ch in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                G.CONFIG.update(chunk=ch, warps=warps)
                got = G.gelu_tanh_fp8(h)
                differ = float((got.q.view(torch.uint8) != ref.q.view(torch.uint8)).float().mean())
                us = median_ms(lambda h=h: G.gelu_tanh_fp8(h), 5, 50) * 1e3
                r[f"{ch}/{warps}"] = {"us": round(us, 1), "codes_differ": differ,
                                      "scale_rel_err": rel_err(got.scale, ref.scale)}  # fmt: skip
        rows[m] = r
    return rows


def forward(best: dict) -> dict:
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from fp8_gaps import cat, fp8_forward, timeline

    from qwenfast.benchmarks.transformer import _fp8_modules, _swap, _table_fwd
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    model, _, (x, txt, t, shapes) = fp8_forward(1024, fp8=False)
    with torch.no_grad():
        ref = model(x, txt, None, t, shapes)
    _swap(model, _fp8_modules(model))
    res = {}
    G.CONFIG.update(best)
    for name, gelu in (("FP8, GELU fusion off", False), ("FP8, GELU fusion on", True)):
        set_fp8_fusion(True, gelu=gelu)
        fn = _table_fwd(model, CudaGraphRunner(model), x, txt, t, shapes)
        with torch.no_grad():
            out = fn().clone()
            ms = median_ms(fn, 3, 20)
            by = {}
            for s, e, n in timeline(fn):
                by[cat(n)] = by.get(cat(n), 0.0) + (e - s) / 1e3
        res[name] = {"ms": round(ms, 2), "rel_err_vs_bf16": float(f"{rel_err(out, ref):.2e}"),
                     "kernel_ms": {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}}  # fmt: skip
        print(f"{name:24} {ms:7.2f} ms  rel err {res[name]['rel_err_vs_bf16']:.2e}  {res[name]['kernel_ms']}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ops = op_sweep()
    img = ops[4096]
    best_key = min((k for k in img if "/" in k), key=lambda k: img[k]["us"] + ops[128][k]["us"])
    ch, warps = best_key.split("/")
    print(f"op (us)      unfused   best {best_key}")
    for m, r in ops.items():
        print(f"  {m:5} rows  {r['unfused_us']:7.1f}   {r[best_key]['us']:7.1f} (codes differ {r[best_key]['codes_differ']:.1e})")
    for k in sorted((k for k in img if "/" in k), key=lambda k: img[k]["us"])[:8]:
        print(f"  {k:22} img {img[k]['us']:7.1f} us  txt {ops[128][k]['us']:6.1f} us")
    fwd = forward({"chunk": int(ch), "warps": int(warps)})
    res = {**versions(), "op_us": ops, "best": best_key, "forward_1024": fwd}
    emit(res, "gelu_fp8.jsonl", a.out)


if __name__ == "__main__":
    main()
