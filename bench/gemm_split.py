"""Does one wide GEMM or several narrow ones run faster on this GPU? (issue 18: the 2.1 cached step is
78 of 100 ms cuBLAS, and its fused gate+up GEMM (N = 24576) got a 320x128 kernel at ~732 TFLOP/s while
diffusers' separate N = 12288 GEMMs ran at ~770 in the same run — clock or kernel choice?)

Times, interleaved A/B/A/B in one process (medians of `triton.testing.do_bench`), bf16, M = the 2.1
cached step's 4096 image tokens: gate+up as one N=24576 GEMM vs two N=12288; QKV as one N=12288 vs
three N=4096; each under cuBLAS and cuBLASLt (`torch.backends.cuda.preferred_blas_library`).

    python bench/gemm_split.py [--m 4096] [--rounds 3]
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    M, K = a.m, a.k
    x = torch.randn(M, K, device=dev, dtype=dt)
    cases = {"gate_up": (24576, 2), "qkv": (12288, 3)}
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (N, parts) in cases.items():
            w = torch.randn(N, K, device=dev, dtype=dt) * K**-0.5
            ws = [t.contiguous() for t in w.chunk(parts)]
            want = F.linear(x, w)
            got = torch.cat([F.linear(x, t) for t in ws], -1)
            assert torch.equal(want.isnan(), torch.zeros_like(want, dtype=torch.bool))
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            fused_ms, split_ms = [], []
            for _ in range(a.rounds):
                fused_ms.append(triton.testing.do_bench(lambda: F.linear(x, w), warmup=50, rep=300, return_mode="median"))
                split_ms.append(triton.testing.do_bench(lambda: [F.linear(x, t) for t in ws], warmup=50, rep=300,
                                                        return_mode="median"))  # fmt: skip
            flop = 2 * M * K * N
            r = {"bench": "gemm_split", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "lib": lib,
                 "case": name, "M": M, "K": K, "N": N, "parts": parts, "fused_ms": [round(v, 4) for v in fused_ms],
                 "split_ms": [round(v, 4) for v in split_ms], "fused_tflops": round(flop / min(fused_ms) / 1e9, 1),
                 "split_tflops": round(flop / min(split_ms) / 1e9, 1), "rel_err_split_vs_fused": err}  # fmt: skip
            rows.append(r)
            print(json.dumps(r))
    print(f"{'lib':>8} {'case':>8} {'N':>6} {'fused ms':>9} {'split ms':>9} {'fused TF':>9} {'split TF':>9}")
    for r in rows:
        print(f"{r['lib']:>8} {r['case']:>8} {r['N']:>6} {min(r['fused_ms']):>9.4f} {min(r['split_ms']):>9.4f} "
              f"{r['fused_tflops']:>9} {r['split_tflops']:>9}")


if __name__ == "__main__":
    main()
