"""INT8 W8A8 GEMMs for the transformer blocks' Linears: a Triton int8 GEMM (int32 accumulation) with
the dequantisation, bias and output cast fused in its epilogue.

Why: on the cards most people own the fastest tensor-core precision is INT8, not bf16 or FP8
(runtime/arch.py: RTX 3090 ~36 TFLOP/s bf16 with fp32 accumulation vs ~284 TOP/s INT8; RTX 4090 ~165
bf16 / ~330 FP8 / ~660 INT8; A100 312 bf16 / 624 INT8 and no FP8 at all). On Hopper INT8 and FP8 run at
the same rate, so there it is a second 8-bit path with the same memory savings.

Scheme (SmoothQuant's W8A8 without smoothing, the same granularity as the FP8 path):
- weights: quantised once per output channel: w ≈ w8 · sw, sw = amax(|row|) / 127, w8 in [-127, 127];
- activations: per token on every call: x ≈ x8 · sx, sx = amax(|row|) / 127 (one Triton pass,
  `quantize_rows_int8`), rounded half away from zero;
- y = (x8 · w8ᵀ in int32) · sx · swᵀ + bias, cast to the activations' dtype in the GEMM's epilogue.
The error is that of 7-bit uniform codes per row (an outlier channel of an activation coarsens its whole
row): lossy, OFF by default, measured by the demo quality gate.

CPU, or a GPU where Triton cannot run, computes `int8_linear_ref`: the same codes, multiplied exactly in
fp32 (int8 products summed in fp32 are exact up to 2^24, i.e. K ≤ 1040 at full scale, and off by float
rounding beyond), so the kernels are checked against it, in the Triton interpreter on the CPU too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from . import _on_device, triton_available, use_triton
from .lowbit import LowBitLinear, replace_layers

__all__ = [
    "Int8Linear",
    "quantize_rows_int8",
    "quantize_rows_int8_ref",
    "int8_gemm",
    "int8_gemm_ref",
    "int8_linear_ref",
    "quantize_model_int8",
]

QMAX = 127.0
EPS = 1e-12  # an all-zero row: scale EPS / 127, codes 0 (never a division by zero)


def quantize_rows_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (codes (M, K) int8, scales (M, 1) fp32), per row, rounded half away from zero."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(EPS) / QMAX
    v = xf / scale
    q = torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5)).clamp(-QMAX, QMAX)
    return q.to(torch.int8), scale


def int8_gemm_ref(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None, out_dtype
) -> torch.Tensor:
    """(M, K) int8 · (N, K) int8ᵀ, scaled by sa (M, 1) and sb (N, 1), + bias (N,) -> (M, N) out_dtype."""
    y = (a.float() @ b.float().t()) * sa * sb.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int8_linear_ref(
    x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """What the INT8 layer computes, in fp32 on any device."""
    x8, sx = quantize_rows_int8_ref(x.reshape(-1, x.shape[-1]))
    return int8_gemm_ref(x8, sx, w8, sw, bias, out_dtype).view(*x.shape[:-1], w8.shape[0])


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_rows_int8_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
        """One row per program: amax, scale, codes (the row in chunks of BLOCK, read twice)."""
        row = tl.program_id(0)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 127.0
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32) / scale
            r = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            tl.store(q_ptr + row * stride_q + offs, r.to(tl.int8), mask=offs < K)

    @triton.jit
    def _int8_gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        sa_ptr,
        sb_ptr,
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_bn,
        stride_cm,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C (M, N) = (A (M, K) int8 · B (N, K) int8ᵀ, int32) · sa (M) · sb (N) + bias (N)."""
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n  # programs of GROUP_M row blocks sweep the columns together (L2 reuse)
        first_m = (pid // group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        am, bn = rm % M, rn % N  # wrapped rows / columns: in-bounds loads, the store is masked
        a_p = a_ptr + am[:, None] * stride_am + rk[None, :]
        b_p = b_ptr + bn[None, :] * stride_bn + rk[:, None]  # (BLOCK_K, BLOCK_N) of Bᵀ
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_p)
                b = tl.load(b_p)
            else:
                a = tl.load(a_p, mask=rk[None, :] < K - k0, other=0)
                b = tl.load(b_p, mask=rk[:, None] < K - k0, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_p += BLOCK_K
            b_p += BLOCK_K
        sa = tl.load(sa_ptr + am)
        sb = tl.load(sb_ptr + bn)
        c = acc.to(tl.float32) * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            c += tl.load(bias_ptr + bn).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c.to(c_ptr.dtype.element_ty), mask=mask)


def quantize_rows_int8(
    x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes and fp32 scales of a 2-D activation; one Triton program per row on CUDA (and
    in the interpreter), else the reference. `out`: (codes (M, K), scales (M, 1)) to write into (tests
    poison them)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not use_triton(x) or x.shape[0] == 0:
        return quantize_rows_int8_ref(x)
    M, K = x.shape
    if out is None:
        out = (torch.empty(M, K, dtype=torch.int8, device=x.device), torch.empty(M, 1, device=x.device))
    q, s = out
    block = min(4096, max(128, 1 << (K - 1).bit_length()))
    with _on_device(x):
        _quant_rows_int8_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block, num_warps=4)
    return q, s


def _blocks(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): big tiles on a GPU, small ones in the interpreter
    (and for the short text stream)."""
    if device.type != "cuda":
        return 32, 32, 32, 4, 1
    if M <= 64:
        return 64, 128, 128, 4, 4
    return 128, 128, 128, 8, 4


def int8_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, K) int8 · (N, K) int8ᵀ · sa · sbᵀ + bias -> (M, N) out_dtype: the Triton kernel, else the reference.
    `out`: an (M, N) buffer to write (tests poison it)."""
    M, K = a.shape
    N = b.shape[0]
    if not use_triton(a, b) or a.stride(-1) != 1 or b.stride(-1) != 1 or M == 0:
        return int8_gemm_ref(a, sa, b, sb, bias, out_dtype)
    c = torch.empty(M, N, dtype=out_dtype, device=a.device) if out is None else out
    bm, bn, bk, warps, stages = _blocks(M, N, a.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    with _on_device(a):
        _int8_gemm_kernel[grid](
            a,
            b,
            c,
            sa.reshape(-1),
            sb.reshape(-1),
            bias if bias is not None else c,
            M,
            N,
            K,
            a.stride(0),
            b.stride(0),
            c.stride(0),
            HAS_BIAS=bias is not None,
            EVEN_K=K % bk == 0,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=8,
            num_warps=warps,
            num_stages=stages,
        )
    return c


class Int8Linear(LowBitLinear):
    """Drop-in for an `nn.Linear` with int8 weights and per-channel scales (bias kept in bf16); LoRAs run
    unmerged beside it (`LowBitLinear`)."""

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias, out_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)  # (N, K) int8
        self.register_buffer("weight_scale", weight_scale)  # (N, 1) fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self.lora = None  # unmerged LoRA factors (LowBitLinear), written by the LoRA manager

    @property
    def weight_device(self) -> torch.device:
        return self.weight_int8.device

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Int8Linear:
        w8, sw = quantize_rows_int8_ref(lin.weight.detach())
        return cls(w8, sw, None if lin.bias is None else lin.bias.detach(), lin.weight.dtype)

    @classmethod
    def from_lowbit(cls, layer: LowBitLinear) -> Int8Linear:
        """From an `FP8Linear` (an FP8 checkpoint loaded as stored): its e4m3 weights times their scales,
        requantised per channel; no bf16 copy of the whole model is ever made (one layer at a time)."""
        w = layer.weight_fp8.float() * layer.weight_scale  # (N, K) fp32, this layer only
        w8, sw = quantize_rows_int8_ref(w)
        q = cls(w8, sw, None if layer.bias is None else layer.bias.detach(), layer.out_dtype)
        q.lora = layer.lora
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N): per-token codes (one pass), then the fused GEMM."""
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        x8, sx = quantize_rows_int8(x2)
        bias = None if self.bias is None else self.bias.to(self.out_dtype)
        y = int8_gemm(x8, sx, self.weight_int8, self.weight_scale, bias, self.out_dtype)
        if self.lora is not None:
            y = self.add_lora(x2, y)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rowwise"


def quantize_model_int8(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Replace the layers the model names (`names`, else `model.fp8_linears()`: the big block GEMMs the
    model marks for 8-bit weights) with `Int8Linear` in place: `nn.Linear`s from their float weights,
    FP8 layers (an FP8 file loaded as stored) from their e4m3 weights; returns how many were replaced."""

    def make(lin: nn.Module) -> nn.Module | None:
        if isinstance(lin, nn.Linear):
            return Int8Linear.from_linear(lin)
        if isinstance(lin, LowBitLinear) and not isinstance(lin, Int8Linear):
            return Int8Linear.from_lowbit(lin)
        return None

    return replace_layers(model, names, make)
