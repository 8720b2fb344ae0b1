"""The rowwise FP8 GEMM's epilogue as its own pass, for short activations: `y = acc * (sx * sw) + bias`.

Why: `FP8Linear` multiplies per-token-scaled activations by per-channel-scaled weights, and cuBLASLt
applies both scales in the GEMM's epilogue ("outer vector" scaling). For short activations (the text
stream: ~30-300 tokens, or twice that with batched CFG) the kernels cuBLASLt picks for that scaling run
at half the speed of its tensorwise ones: measured on an H200 (same run, interleaved, CUDA graphs,
M = 160 rows at the block's four shapes) the rowwise GEMMs of one text stream took 84 us per block,
the tensorwise ones 45 us. Short activations are weight-bound (the whole FP8 weight is read for a
few rows), so writing the raw fp32 accumulator and applying the scales here costs a few us.

So for M <= `fp8_linear.SMALL_M` rows `FP8Linear` runs `_scaled_mm` with unit scales into fp32 (the
accumulator, unrounded) and this pass writes `round(acc * (sx[row] * sw[col]) + bias[col])` in the
activation dtype: the formula of the fused epilogue, in fp32, rounded once. It differs from the fused
GEMM only by the order of the K-sum inside the two cuBLASLt kernels and last-bit differences of the
fp32 products (FMA contraction), i.e. by at most one ulp of the output in rare elements.

Layout: acc (Mp, N) fp32 contiguous (Mp >= M: `gemm_rows` padding, rows past M are not read), sx (Mp,
1) fp32, sw (N, 1) fp32 (`FP8Linear.weight_scale`), bias (N,) or None; out (M, N) in `dtype`.
"""

from __future__ import annotations

import torch

from . import FLOAT_DTYPES, _on_device, _tl_dtype, triton_available, use_triton

__all__ = ["scale_epilogue", "scale_epilogue_ref"]

BLOCK_M, BLOCK_N = 16, 256

if triton_available():
    import triton
    import triton.language as tl

    from .adaln import _cast

    @triton.jit
    def _scale_epilogue_kernel(
        acc_ptr,
        sx_ptr,
        sw_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        HAS_BIAS: tl.constexpr,
        DT: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        """One (BM, BN) tile: acc * (sx * sw) (+ bias) in fp32, rounded to DT on store."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        rm, cm = rows < M, cols < N
        m = rm[:, None] & cm[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        acc = tl.load(acc_ptr + offs, mask=m, other=0.0)
        sx = tl.load(sx_ptr + rows, mask=rm, other=0.0)
        sw = tl.load(sw_ptr + cols, mask=cm, other=0.0)
        y = acc * (sx[:, None] * sw[None, :])
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, _cast(y, DT), mask=m)


def scale_epilogue_ref(
    acc: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Plain torch: rows [0, M) of acc (Mp, N) fp32 times sx (Mp, 1) * sw (N, 1)ᵀ, + bias, in `dtype`."""
    y = acc[:M].float() * (sx[:M].float() * sw.float().t())
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def scale_epilogue(
    acc: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`scale_epilogue_ref`, one Triton pass on CUDA (or under the interpreter); other layouts, devices
    or dtypes run the reference. `out`: an (M, N) contiguous buffer in `dtype` to write instead."""
    N = acc.shape[-1]
    ok = (
        acc.dim() == 2
        and acc.dtype == torch.float32
        and acc.is_contiguous()
        and sx.dtype == sw.dtype == torch.float32
        and sx.is_contiguous()
        and sw.is_contiguous()
        and tuple(sw.shape) == (N, 1)
        and sx.shape[0] >= M > 0
        and (bias is None or (bias.shape == (N,) and bias.is_contiguous()))
        and dtype in FLOAT_DTYPES
        and use_triton(acc, sx, sw, *(() if bias is None else (bias,)))
    )
    if out is not None and not (out.shape == (M, N) and out.dtype == dtype and out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous ({M}, {N}) {dtype} tensor, got {tuple(out.shape)} {out.dtype}"
        )
    if not ok:
        y = scale_epilogue_ref(acc, sx, sw, bias, M, dtype)
        return y if out is None else out.copy_(y)
    out = torch.empty(M, N, dtype=dtype, device=acc.device) if out is None else out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    with _on_device(acc):
        _scale_epilogue_kernel[grid](
            acc,
            sx,
            sw,
            acc if bias is None else bias,  # (acc: an unused dummy pointer)
            out,
            M,
            N,
            HAS_BIAS=bias is not None,
            DT=_tl_dtype(dtype),
            BM=BLOCK_M,
            BN=BLOCK_N,
            num_warps=4,
        )
    return out
