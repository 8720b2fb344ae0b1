"""INT8 vs FP8 vs bf16 GEMMs on the transformer blocks' shapes: the Triton int8 GEMM of
kernels/int8_linear.py (int32 accumulation, dequantisation in the epilogue), cuBLAS's int8 GEMM
(`torch._int_mm`, int32 out, no epilogue) for reference, the FP8 rowwise `torch._scaled_mm` the FP8
path runs, and bf16 `F.linear`; CUDA-event medians, TOP/s or TFLOP/s, rel. error vs fp32. One H100 / H200 GPU,
about a minute.

    python bench/int8_gemm.py [--results DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwenfast.benchmarks import emit, median_ms, rel_err  # noqa: E402
from qwenfast.kernels.fp8_linear import FP8Linear  # noqa: E402
from qwenfast.kernels.int8_linear import Int8Linear, int8_gemm, quantize_rows_int8  # noqa: E402

# (name, M, K, N): 1024² image stream (4096 tokens) and the 128-token text stream of one block
SHAPES = [("img qkv", 4096, 3072, 9216), ("img out", 4096, 3072, 3072), ("img mlp up", 4096, 3072, 12288),
          ("img mlp down", 4096, 12288, 3072), ("txt mlp up", 128, 3072, 12288)]  # fmt: skip


def measure(name: str, M: int, K: int, N: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(M + K + N)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    lin = torch.nn.Linear(K, N, device=dev, dtype=torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    i8, f8 = Int8Linear.from_linear(lin), FP8Linear.from_linear(lin)
    x8, sx = quantize_rows_int8(x)
    flop = 2 * M * K * N
    r = {"shape": name, "M": M, "K": K, "N": N}
    cases = {
        "bf16": lambda: F.linear(x, lin.weight, lin.bias),
        "int8 gemm (Triton, fused epilogue)": lambda: int8_gemm(
            x8, sx, i8.weight_int8, i8.weight_scale, i8.bias, torch.bfloat16
        ),  # fmt: skip
        "int8 layer (quantise + gemm)": lambda: i8(x),
        "int8 cuBLAS _int_mm (int32 out)": lambda: torch._int_mm(x8, i8.weight_int8.t()),
        "fp8 layer (quantise + _scaled_mm)": lambda: f8(x),
    }
    for case, fn in cases.items():
        ms = median_ms(fn, 5, 20)
        r[case] = {"ms": round(ms, 4), "t_ops": round(flop / ms / 1e9, 1)}
        if "cuBLAS" not in case:
            r[case]["rel_err_vs_fp32"] = float(f"{rel_err(fn().float(), want):.2e}")
    return r


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results")
    a = p.parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(shape[0], {k: v for k, v in rows[-1].items() if isinstance(v, dict)}, flush=True)
    emit({"bench": "int8_gemm", "rows": rows}, "int8.jsonl", a.results)


if __name__ == "__main__":
    main()
