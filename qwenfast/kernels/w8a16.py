"""FP8 weights on GPUs without FP8 GEMMs: a Triton GEMM that reads the e4m3 weight bytes and widens them to
bf16 inside its main loop (W8A16), the per-channel scale and the bias in its epilogue.

Why: an FP8 checkpoint (ComfyUI's) on an Ampere card (runtime/arch.py: no FP8 tensor cores) should keep
its 1-byte weights in memory, but dequantising a whole layer to bf16 before each GEMM costs a write and a
read of 2 bytes per weight on every call (an H100 playing sm_86 measured the 1024² forward at about twice
bf16's time that way). Here the GEMM reads 1 byte per weight and never writes a bf16 copy.

The activations are not quantised (weight-only): y = (x · w8ᵀ) · swᵀ + bias with x in bf16, the products
of bf16 x and the exactly widened e4m3 codes accumulated in fp32. The e4m3 -> bf16 widening is done on the
bits (sign, 4-bit exponent, 3-bit mantissa into an fp32 pattern; subnormals as m · 2^-9), so no FP8
instruction is needed and the Triton interpreter runs it too. `fp8_weight_gemm_ref` is the same computation in torch.
"""

from __future__ import annotations

import torch

from . import _on_device, interpreting, triton_available, use_triton

__all__ = ["fp8_weight_gemm", "fp8_weight_gemm_ref"]


def fp8_weight_gemm_ref(
    x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """(M, K) · (N, K) e4m3ᵀ · swᵀ + bias -> (M, N) out_dtype, in fp32."""
    y = (x.float() @ w8.float().t()) * sw.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _e4m3_to_bf16(b):
        """uint8 e4m3fn codes -> bf16, exactly (the NaN code never occurs in quantised weights)."""
        bi = b.to(tl.int32)
        s = (bi >> 7) & 1
        e = (bi >> 3) & 15
        m = bi & 7
        normal = ((s << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # fp32 bits
        sub = m.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * s.to(tl.float32))  # e == 0: m · 2^-9
        return tl.where(e == 0, sub, normal).to(tl.bfloat16)  # <= 4 significant bits: exact in bf16

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, c_ptr, sw_ptr, bias_ptr, M, N, K, stride_xm, stride_wn, stride_cm,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, F32_DOT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        am, bn = rm % M, rn % N
        x_p = x_ptr + am[:, None] * stride_xm + rk[None, :]
        w_p = w_ptr + bn[None, :] * stride_wn + rk[:, None]  # (BLOCK_K, BLOCK_N) of w8ᵀ
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_p)
                b = tl.load(w_p)
            else:
                a = tl.load(x_p, mask=rk[None, :] < K - k0, other=0.0)
                b = tl.load(w_p, mask=rk[:, None] < K - k0, other=0)
            w = _e4m3_to_bf16(b)
            if F32_DOT:  # the interpreter multiplies bf16 dot operands as raw bits: widen first (exact)
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(a, w, acc)
            x_p += BLOCK_K
            w_p += BLOCK_K
        c = acc * tl.load(sw_ptr + bn)[None, :]
        if HAS_BIAS:
            c += tl.load(bias_ptr + bn).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c.to(c_ptr.dtype.element_ty), mask=mask)


def fp8_weight_gemm(
    x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """(M, K) bf16 · (N, K) e4m3ᵀ · sw (N, 1)ᵀ + bias (N,) -> (M, N) out_dtype: the Triton kernel for bf16
    activations on a GPU (or in the interpreter), else the reference."""
    M, K = x.shape
    N = w8.shape[0]
    if (
        x.dtype != torch.bfloat16
        or not use_triton(x, w8)
        or x.stride(-1) != 1
        or w8.stride(-1) != 1
        or M == 0
    ):
        return fp8_weight_gemm_ref(x, w8, sw, bias, out_dtype)
    c = torch.full(
        (M, N), float("nan"), dtype=out_dtype, device=x.device
    )  # poisoned before the kernel writes
    bm, bn, bk, warps, stages = (32, 32, 32, 4, 1) if x.device.type != "cuda" else (128, 128, 64, 8, 4)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    with _on_device(x):
        _w8a16_kernel[grid](
            x, w8.view(torch.uint8), c, sw.reshape(-1).float(), bias if bias is not None else c, M, N, K,
            x.stride(0), w8.stride(0), c.stride(0), HAS_BIAS=bias is not None, EVEN_K=K % bk == 0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, F32_DOT=interpreting(), num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return c
