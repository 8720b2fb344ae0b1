"""FP8 forward with the per-token quantisation fused into its producers (kernels/fp8_rows.py), before/after.

Full-size Qwen-Image transformer (60 blocks, random bf16 weights), one GPU. Per size (1024², 1328²):
bf16 fused + CUDA graph (the reference output), then the FP8 block Linears with the fusion OFF
(`set_fp8_fusion(False)`: a separate `quantize_rows` pass per GEMM, as before) and ON, each under its
own CUDA graph: median ms, rel. err vs bf16, the kernel-time split (torch.profiler of one eager fused
forward: gemm / attention / quant / gelu / norm / other, plus the top kernels). At 1024² also the
three fused kernels alone vs their unfused pairs (time, and how many e4m3 codes differ), and both
settings with an unmerged rank-64 LoRA on every FP8 Linear (the producers then also write bf16).
Prints tables and JSON lines; `--results DIR` appends them to DIR/fp8_fused.jsonl.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from qwenfast.benchmarks import emit, median_ms, rel_err, versions
from qwenfast.benchmarks.transformer import _fp8_modules, _swap, build
from qwenfast.kernels.adaln import layernorm_modulate, layernorm_modulate_fp8
from qwenfast.kernels.fp8_linear import FP8Linear, quantize_activation
from qwenfast.kernels.fp8_rows import set_fp8_fusion
from qwenfast.kernels.gated_residual import (
    gated_residual_layernorm_modulate,
    gated_residual_layernorm_modulate_fp8,
)
from qwenfast.kernels.gelu import gelu_tanh_fp8
from qwenfast.runtime.cuda_graphs import CudaGraphRunner

CATS = {  # first match wins
    "attention": ("flash", "fmha", "attention", "sdpa", "cudnn_generated"),
    "quant": ("_quant_rows_kernel",),
    "gelu": ("gelu",),
    "norm": ("_layernorm_modulate_kernel", "_gated_residual_kernel"),
    "gemm": ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "_mm"),
}


def profile(fn) -> dict:
    """Kernel time of one call of fn by category (ms and %), and the top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats = dict.fromkeys([*CATS, "other"], 0.0)
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        n = e.key.lower()
        cat = next((c for c, keys in CATS.items() if any(k in n for k in keys)), "other")
        cats[cat] += t
        kernels.append((t, e.count, cat, e.key[:90]))
    total = sum(cats.values()) or 1.0
    kernels.sort(reverse=True)
    return {"total_ms": round(total / 1e3, 2), "ms": {k: round(v / 1e3, 2) for k, v in cats.items()},
            "pct": {k: round(100 * v / total, 1) for k, v in cats.items()},
            "top": [{"ms": round(t / 1e3, 2), "calls": c, "cat": cat, "name": k} for t, c, cat, k in kernels[:12]]}  # fmt: skip


def code_diff(a, b) -> dict:
    """How the fused rows differ from the unfused ones: share of equal scales, of differing codes,
    the largest code step."""
    same = (a.scale == b.scale).float().mean().item()
    d = (a.q.view(torch.uint8).int() - b.q.view(torch.uint8).int()).abs()
    return {"scales_equal": round(same, 6), "codes_differ": float(f"{(d > 0).float().mean().item():.2e}"),
            "max_code_step": int(d.max().item())}  # fmt: skip


def ops_bench() -> dict:
    """The three fused kernels vs their unfused pairs at the 1024² image-stream shapes."""
    dev, dt, L, D = "cuda", torch.bfloat16, 4096, 3072
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, L, D, device=dev, dtype=dt, generator=g) * 2
    y = torch.randn(1, L, D, device=dev, dtype=dt, generator=g)
    sh, sc, gate = torch.randn(1, 3 * D, device=dev, dtype=dt, generator=g).chunk(3, dim=-1)
    h = torch.randn(1, L, 4 * D, device=dev, dtype=dt, generator=g) * 3
    cases = {
        "layernorm_modulate": (lambda: quantize_activation(layernorm_modulate(x, sh, sc)),
                               lambda: layernorm_modulate_fp8(x, sh, sc)),
        "gated_residual_layernorm_modulate": (
            lambda: quantize_activation(gated_residual_layernorm_modulate(x, y, gate, sh, sc)[1]),
            lambda: gated_residual_layernorm_modulate_fp8(x, y, gate, sh, sc)[1]),
        "gelu_tanh": (lambda: quantize_activation(F.gelu(h, approximate="tanh")), lambda: gelu_tanh_fp8(h)),
    }  # fmt: skip
    out = {}
    with torch.no_grad():
        for name, (unfused, fused) in cases.items():
            out[name] = {"unfused_us": round(1e3 * median_ms(unfused, 5, 50), 1),
                         "fused_us": round(1e3 * median_ms(fused, 5, 50), 1), **code_diff(fused(), unfused())}  # fmt: skip
    return out


def add_lora(model, rank: int = 64) -> None:
    from qwenfast.loading.lora_fp8 import set_side_lora

    g = torch.Generator(device="cuda").manual_seed(3)
    for m in model.modules():
        if isinstance(m, FP8Linear):
            N, K = m.out_features, m.in_features
            up = torch.randn(N, rank, device="cuda", generator=g) * 0.01
            down = torch.randn(rank, K, device="cuda", generator=g) / K**0.5
            set_side_lora(m, [(None, up, down, 1.0)], pieces=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 1328])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--txt-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--results", default=None)
    ap.add_argument("--label", default="hfp8q: FP8 quantisation fused into producers")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, _ = build(args.layers, compare=False)
    fp8_mods = _fp8_modules(model)
    head = {**versions(), "layers": args.layers, "txt_len": args.txt_len, "label": args.label}
    print(f"GPU {head['gpu']}, torch {head['torch']}, triton {head['triton']}; built in {time.perf_counter() - t0:.0f} s")
    ops = ops_bench()
    print(f"\n{'op (1024², bf16)':36}{'unfused us':>12}{'fused us':>10}{'scales eq':>11}{'codes diff':>12}{'max step':>9}")
    for k, r in ops.items():
        print(f"{k:36}{r['unfused_us']:>12.1f}{r['fused_us']:>10.1f}{r['scales_equal']:>11.4f}"
              f"{r['codes_differ']:>12.1e}{r['max_code_step']:>9}")  # fmt: skip
    emit({**head, "kind": "ops", "ops": ops}, "fp8_fused.jsonl", args.results)

    for size in args.sizes:
        run_size(model, fp8_mods, size, args, head, lora=size == args.sizes[0])


def run_size(model, fp8_mods: dict, size: int, args, head: dict, lora: bool) -> None:
    """One image size: bf16, FP8 fusion off/on (and with a LoRA), timings, errors, profiles."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    h = w = size // 16
    g = torch.Generator(device=dev).manual_seed(size)
    x = torch.randn(1, h * w, 64, device=dev, dtype=dt, generator=g)
    txt = torch.randn(1, args.txt_len, 3584, device=dev, dtype=dt, generator=g)
    t = torch.tensor([0.7], device=dev)
    shapes = [(1, h, w)]
    rows, profs, outs = {}, {}, {}

    def timed(name: str, runner: CudaGraphRunner) -> None:
        fn = lambda: runner(x, txt, None, t, shapes)  # noqa: E731
        with torch.no_grad():
            outs[name] = fn().clone()
            rows[name] = {"ms": round(median_ms(fn, 3, args.iters), 2)}

    model.fused = True
    timed("bf16 fused + CUDA graph", CudaGraphRunner(model))
    bf16 = _swap(model, fp8_mods)
    variants = [("FP8 + CUDA graph, fusion off", False, False, False),
                ("FP8 + CUDA graph, fusion on", True, False, False),  # QWENFAST_FP8_FUSE=norm: LayerNorm producers only
                ("FP8 + CUDA graph, fusion on + GELU", True, True, False)]  # the default since session 8
    if lora:
        variants += [("FP8 + LoRA r64 + graph, fusion off", False, False, True),
                     ("FP8 + LoRA r64 + graph, fusion on", True, False, True)]  # fmt: skip
    for name, on, gelu, with_lora in variants:
        if with_lora and not any(m.lora is not None for m in model.modules() if isinstance(m, FP8Linear)):
            add_lora(model)
        set_fp8_fusion(on, gelu=gelu)
        timed(name, CudaGraphRunner(model))  # a fresh graph per setting: graphs keep what they captured
        if not with_lora:
            with torch.no_grad():
                profs[name] = profile(lambda: model(x, txt, None, t, shapes))
    set_fp8_fusion(True, gelu=False)
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.lora = None
    _swap(model, bf16)
    ref = outs["bf16 fused + CUDA graph"]
    for name, r in rows.items():
        r["rel_err_vs_bf16"] = float(f"{rel_err(outs[name], ref):.3e}")
    on, off = "FP8 + CUDA graph, fusion on", "FP8 + CUDA graph, fusion off"
    rel_on_off = float(f"{rel_err(outs[on], outs[off]):.3e}")
    lora_on_off = None
    if "FP8 + LoRA r64 + graph, fusion on" in outs:
        lora_on_off = float(f"{rel_err(outs['FP8 + LoRA r64 + graph, fusion on'], outs['FP8 + LoRA r64 + graph, fusion off']):.3e}")  # fmt: skip
    print(f"\n{size}x{size} ({h * w} image tokens, {args.txt_len} text tokens)")
    print(f"{'variant':38}{'ms':>9}{'rel err vs bf16':>17}")
    for name, r in rows.items():
        print(f"{name:38}{r['ms']:>9.2f}{r['rel_err_vs_bf16']:>17.3e}")
    print(f"fusion on vs off: rel diff {rel_on_off:.2e}" + ("" if lora_on_off is None else f"; with LoRA {lora_on_off:.2e}"))
    for name, p in profs.items():
        ms = "  ".join(f"{k} {v:.2f} ({p['pct'][k]}%)" for k, v in p["ms"].items())
        print(f"kernel ms, {name} (eager, {p['total_ms']} ms): {ms}")
        for k in p["top"][:8]:
            print(f"    {k['ms']:8.2f} ms {k['calls']:5d}x {k['cat']:9} {k['name']}")
    emit({**head, "kind": "forward", "size": size, "variants": rows, "profile": profs,
          "rel_on_vs_off": rel_on_off, "rel_on_vs_off_lora": lora_on_off}, "fp8_fused.jsonl", args.results)  # fmt: skip


if __name__ == "__main__":
    main()
