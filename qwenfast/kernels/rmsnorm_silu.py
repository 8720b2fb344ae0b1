"""The VAE's channel RMSNorm (optionally followed by SiLU) in one pass: `silu(x/||x||_C * sqrt(C) * gamma)`.

Why fuse (memory traffic): the VAE's resnets run `F.silu(RMSNorm(x))` before every 3x3 conv. Eager
torch does `F.normalize` (a norm pass, a clamp, a divide), `* scale`, `* gamma`, `silu`: ~6 passes
over a (B, C, H, W) activation, plus fp32 temporaries in bf16 (diffusers normalises in fp32). At the
decoder's last stage (1328², 96 channels, bf16) one pass is 340 MB, so the glue costs more than the
convs it feeds. The kernel reads x once and writes y once.

Layouts: channels-last (the fast VAE path: a pixel's C channels are contiguous) and plain NCHW
both work, because H and W always merge into one pixel axis; each program normalises a
(BLOCK_P pixels x all C channels) tile, reducing over C in registers.

Numerics follow `qwenfast.models.vae.RMSNorm` exactly in op order: fp32 statistics; in bf16/fp16 the
normalised value is rounded to x.dtype, then `* scale` and `* gamma` each round to x.dtype, and SiLU
(computed in fp32) rounds on store, as torch does. The norm is clamped at 1e-12 like F.normalize.
The last bit can differ where the fp32 sum of squares does (torch's reduction order is not ours).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import FLOAT_DTYPES, _on_device, _tl_dtype, triton_available, use_triton

__all__ = ["rmsnorm_silu", "rmsnorm_silu_ref"]

EPS = 1e-12  # F.normalize's clamp
MAX_C = 4096
TILE = 8192  # elements per program (BLOCK_P * BLOCK_C)

if triton_available():
    import triton
    import triton.language as tl

    from .adaln import _cast, _round

    @triton.jit
    def _rmsnorm_silu_kernel(
        x_ptr,
        g_ptr,
        bias_ptr,
        out_ptr,
        P,
        C,
        scale,
        sx_b,
        sx_c,
        sx_p,
        so_b,
        so_c,
        so_p,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DT: tl.constexpr,
    ):
        b = tl.program_id(1).to(tl.int64)
        p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
        c = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        mask = (p < P)[:, None] & (c < C)[None, :]  # (BLOCK_P, BLOCK_C)
        offs = b * sx_b + p[:, None] * sx_p + c[None, :] * sx_c
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the previous conv's bias: its stored (rounded) output is what gets normalised
            x = _round(x + tl.load(bias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :], DT)
        g = tl.load(g_ptr + c, mask=c < C, other=0.0).to(tl.float32)  # (BLOCK_C,)
        norm = tl.sqrt(tl.sum(x * x, axis=1))  # (BLOCK_P,)
        n = _round(x / tl.maximum(norm, 1e-12)[:, None], DT)  # F.normalize (fp32), cast to x.dtype
        n = _round(n * scale, DT)  # * sqrt(C)
        y = n * g[None, :]  # * gamma
        if SILU:
            y = _round(y, DT)
            y = y / (1.0 + tl.exp(-y))
        o = b * so_b + p[:, None] * so_p + c[None, :] * so_c
        tl.store(out_ptr + o, _cast(y, DT), mask=mask)


def rmsnorm_silu_ref(
    x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool = True, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain torch, op for op `qwenfast.models.vae.RMSNorm.forward` (then `F.silu` when `silu`).

    x: (B, C, H, W); gamma: (C, 1, 1) or (C,); scale = sqrt(C); bias: (C,) added to x first (the
    bias of the conv that produced x, run without it).
    """
    if bias is not None:
        x = x + bias.reshape(1, -1, 1, 1)
    g = gamma.reshape(-1, 1, 1)
    if x.element_size() < 4:
        y = F.normalize(x.float(), dim=1).to(x.dtype) * scale * g
    else:
        y = F.normalize(x, dim=1) * scale * g
    return F.silu(y) if silu else y


def _pixel_stride(t: torch.Tensor) -> int | None:
    """Stride of the merged H*W axis of a 4D tensor, or None when H and W do not merge (a crop)."""
    if t.shape[3] == 1:
        return t.stride(2)
    if t.shape[2] == 1 or t.stride(2) == t.shape[3] * t.stride(3):
        return t.stride(3)
    return None


def rmsnorm_silu(
    x: torch.Tensor,
    gamma: torch.Tensor,
    scale: float,
    silu: bool = True,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`silu(RMSNorm_C(x [+ bias]) * gamma)` (or without SiLU), one fused pass on CUDA; same layout out as in.

    x: (B, C, H, W) fp32/bf16/fp16, contiguous or channels-last (any layout where H and W merge);
    gamma (and bias): C elements, same dtype; out: optional buffer like x (tests poison it). Anything
    else, CPU tensors, or backend "torch" -> the reference (copied into `out` when given).
    """
    ok = (
        x.dim() == 4
        and x.dtype in FLOAT_DTYPES
        and gamma.dtype == x.dtype
        and gamma.numel() == x.shape[1]
        and 0 < x.shape[1] <= MAX_C
        and x.numel() > 0
        and _pixel_stride(x) is not None
        and use_triton(x, gamma)
        and (
            bias is None or (bias.dtype == x.dtype and bias.numel() == x.shape[1] and bias.device == x.device)
        )
    )
    if out is not None:
        ok = ok and out.shape == x.shape and out.dtype == x.dtype and _pixel_stride(out) is not None
    if not ok:
        y = rmsnorm_silu_ref(x, gamma, scale, silu, bias)
        return y if out is None else out.copy_(y)
    B, C, H, W = x.shape
    if out is None:
        out = torch.empty_like(x)  # keeps channels-last / contiguous
        if _pixel_stride(out) is None:  # empty_like of an odd-strided dense tensor: plain NCHW
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sp_out = _pixel_stride(out)
    g = gamma.reshape(-1).contiguous()
    block_c = triton.next_power_of_2(C)
    block_p = max(1, min(128, TILE // block_c))
    P = H * W
    with _on_device(x):
        _rmsnorm_silu_kernel[(triton.cdiv(P, block_p), B)](
            x,
            g,
            g if bias is None else bias.reshape(-1).contiguous(),
            out,
            P,
            C,
            float(scale),
            x.stride(0),
            x.stride(1),
            _pixel_stride(x),
            out.stride(0),
            out.stride(1),
            sp_out,
            SILU=silu,
            HAS_BIAS=bias is not None,
            BLOCK_P=block_p,
            BLOCK_C=block_c,
            DT=_tl_dtype(x.dtype),
            num_warps=4,
        )
    return out
