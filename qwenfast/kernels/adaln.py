"""LayerNorm (no affine) + adaptive modulation in one pass: `y = LN(x) * (1 + scale) + shift`.

Why fuse (memory traffic): eager torch runs `nn.LayerNorm` (read x, write n), `1 + scale` (tiny),
`n * (1 + scale)` (read n, write t) and `t + shift` (read t, write y): 6 passes over the (B, L, D)
activation. The fused kernel reads x once and writes y once (2 passes) and keeps the statistics in
registers. For a 1024x1024 image (L = 4096 tokens, D = 3072, bf16: 25 MB per pass) that is 50 MB
instead of 150 MB, for norm1 of both streams and for the final `norm_out`. Measured on H200
(triton 3.6, bf16, 4096 x 3072): 24 us vs 91 us eager (3.8x).

Numerics: the reference is `F.layer_norm(x)` in x.dtype (fp32 statistics), then
`n * (1 + scale) + shift` in x.dtype: the op order of `transformer._modulate` and
`AdaLayerNormOut`. The kernel computes in fp32 but rounds to x.dtype at the same points as torch
(the norm output, `1 + scale`, the product; the sum on store), so in bf16/fp16 it matches the
reference bit for bit on all but ~1e-5 of the elements (H200: 99.9998% in bf16); those differ by
one ulp of an intermediate, from last-bit differences of the fp32 statistics (two-pass here,
Welford in torch).

`split` covers `zero_cond_t` checkpoints (edit models): shift/scale then hold 2B rows, and tokens
`l >= split` (the reference images) take row `B + b` (the t=0 modulation) instead of row `b`,
i.e. `torch.where(index, shift[B:], shift[:B])` in `_modulate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import FLOAT_DTYPES, _num_warps, _on_device, _tl_dtype, interpreting, triton_available, use_triton
from .fp8_linear import quantize_activation
from .fp8_rows import QuantizedRows, empty_rows, quantize_rows_ref_padded

__all__ = [
    "layernorm_modulate",
    "layernorm_modulate_ref",
    "layernorm_modulate_fp8",
    "layernorm_modulate_fp8_ref",
    "select_rows",
]

EPS = 1e-6
MAX_D = 65536  # one program holds a whole row in registers

if triton_available():
    import triton
    import triton.language as tl

    from .fp8_rows import _quant_row

    # How `_round` rounds fp32 to bf16/fp16 and back. Two Triton pitfalls rule out the plain
    # `v.to(tl.bfloat16).to(tl.float32)`: on the GPU (triton 3.6, H200) the compiler drops such
    # round trips in places (with or without fp_downcast_rounding="rtne"), so the result silently
    # stops matching torch; and the CPU interpreter truncates fp32 -> bf16 instead of rounding to
    # nearest even. So: inline PTX `cvt.rn` on NVIDIA GPUs (never folded; ~10% slower than the
    # folded cast), integer round-to-nearest-even under the interpreter (too slow for the GPU:
    # 2.5x on the gated residual), the plain cast elsewhere (ROCm).
    _PTX, _SOFT, _PLAIN = 0, 1, 2  # `_ROUNDING == 0/1/2` in the kernels below
    _ROUNDING = tl.constexpr(_SOFT if interpreting() else (_PLAIN if torch.version.hip else _PTX))

    @triton.jit
    def _round(v, DT: tl.constexpr):
        """Round fp32 `v` to DT (nearest even) and back: an intermediate torch result in DT."""
        if DT == tl.float32:
            r = v
        elif DT == tl.bfloat16:
            if _ROUNDING == 0:
                r = tl.inline_asm_elementwise(
                    "{ .reg .b16 t, z; mov.b16 z, 0; cvt.rn.bf16.f32 t, $1; mov.b32 $0, {z, t}; }",
                    "=r,r",
                    [v],
                    dtype=tl.float32,
                    is_pure=True,
                    pack=1,
                )
            elif _ROUNDING == 1:
                u = v.to(tl.uint32, bitcast=True)
                u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
                r = tl.where(v != v, v, u.to(tl.float32, bitcast=True))  # NaN stays NaN
            else:
                r = v.to(DT).to(tl.float32)
        else:
            if _ROUNDING == 0:
                r = tl.inline_asm_elementwise(
                    "{ .reg .b16 t; cvt.rn.f16.f32 t, $1; cvt.f32.f16 $0, t; }",
                    "=r,r",
                    [v],
                    dtype=tl.float32,
                    is_pure=True,
                    pack=1,
                )
            else:
                r = v.to(DT).to(tl.float32)  # numpy's float16 cast rounds to nearest even
        return r

    @triton.jit
    def _cast(v, DT: tl.constexpr):
        """fp32 -> DT for a store, rounding to nearest even (also under the interpreter)."""
        if _ROUNDING == 1:
            r = _round(v, DT).to(DT)  # exact cast of a value already in DT
        else:
            r = v.to(DT)
        return r

    @triton.jit
    def _ln_modulate_row(x, mask, shift, scale, D, eps, DT: tl.constexpr):
        """LayerNorm of one fp32 row `x` (masked lanes 0), then *(1+scale)+shift; fp32 out.

        Rounds to DT where torch materialises a DT tensor: LayerNorm output, `1 + scale`, product.
        """
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / D
        rstd = tl.rsqrt(var + eps)
        y = _round(xc * rstd, DT)  # nn.LayerNorm output in x.dtype
        y = _round(y * _round(1.0 + scale, DT), DT)
        return y + shift  # rounded by the caller's store

    @triton.jit
    def _row_coords(L, D, B, split, BLOCK: tl.constexpr):
        """One program per token row: (sample, token, column offsets, column mask, modulation row).

        The modulation row is `b`, or `b + B` (the t=0 half) for tokens from `split` on (zero_cond_t).
        """
        row = tl.program_id(0).to(tl.int64)
        b = row // L
        tok = row % L
        cols = tl.arange(0, BLOCK)
        return b, tok, cols, cols < D, b + tl.where(tok >= split, B, 0)

    @triton.jit
    def _layernorm_modulate_kernel(
        x_ptr,
        shift_ptr,
        scale_ptr,
        out_ptr,
        q_ptr,
        qs_ptr,
        L,
        D,
        B,
        split,
        sx_b,
        sx_l,
        so_b,
        so_l,
        s_shift,
        s_scale,
        eps,
        BLOCK: tl.constexpr,
        DT: tl.constexpr,
        STORE: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        """STORE: write y (B, L, D) in DT; QUANT: write y's e4m3 rows (q (B*L, D), scales (B*L,)),
        quantised from y as stored (rounded to DT), i.e. `quantize_rows(y)` without re-reading y."""
        b, tok, cols, mask, mrow = _row_coords(L, D, B, split, BLOCK)
        x = tl.load(x_ptr + b * sx_b + tok * sx_l + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + mrow * s_shift + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + mrow * s_scale + cols, mask=mask, other=0.0).to(tl.float32)
        y = _ln_modulate_row(x, mask, shift, scale, D, eps, DT)
        if STORE:
            tl.store(out_ptr + b * so_b + tok * so_l + cols, _cast(y, DT), mask=mask)
        if QUANT:
            _quant_row(_round(y, DT), cols, mask, q_ptr, qs_ptr, b * L + tok, D)


def select_rows(t: torch.Tensor, L: int, split: int | None) -> torch.Tensor:
    """(B|2B, D) per-sample vectors -> broadcastable (B, 1|L, D), as `transformer._modulate` does."""
    if split is None:
        return t[:, None]
    b = t.shape[0] // 2
    index = (torch.arange(L, device=t.device) >= split)[None, :, None]  # (1, L, 1)
    return torch.where(index, t[b:, None], t[:b, None])


def layernorm_modulate_ref(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = EPS,
    split: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, op for op what the model does: `_modulate(LayerNorm(x), ...)`."""
    L, D = x.shape[1], x.shape[-1]
    n = F.layer_norm(x, (D,), eps=eps)
    y = n * (1 + select_rows(scale, L, split)) + select_rows(shift, L, split)
    if out is not None:
        return out.copy_(y)
    return y


def _mod_ok(t: torch.Tensor, x: torch.Tensor, split: int | None) -> bool:
    rows = x.shape[0] * (1 if split is None else 2)
    return t.dim() == 2 and tuple(t.shape) == (rows, x.shape[-1]) and t.dtype == x.dtype and t.stride(-1) == 1


def _out_ok(out: torch.Tensor | None, x: torch.Tensor) -> bool:
    return out is None or (out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1)


def _ok(x, shift, scale, split, out) -> bool:
    return (
        x.dim() == 3
        and x.dtype in FLOAT_DTYPES
        and x.stride(-1) == 1
        and 0 < x.shape[-1] <= MAX_D
        and x.numel() > 0
        and _mod_ok(shift, x, split)
        and _mod_ok(scale, x, split)
        and _out_ok(out, x)
        and use_triton(x, shift, scale, *(() if out is None else (out,)))
    )


def layernorm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = EPS,
    split: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`LayerNorm(x) * (1 + scale[:, None]) + shift[:, None]`, one fused pass on CUDA.

    x: (B, L, D) fp32/bf16/fp16, last dim contiguous (B and L strides free, e.g. a slice);
    shift, scale: (B, D) same dtype, last dim contiguous (chunks of the modulation vector are fine);
    with `split`, (2B, D) and tokens `l >= split` use rows B..2B-1. `out`: optional (B, L, D) buffer.
    Anything else (or CPU tensors, or backend "torch") returns `layernorm_modulate_ref`.
    """
    if not _ok(x, shift, scale, split, out):
        return layernorm_modulate_ref(x, shift, scale, eps, split, out)
    return _launch(x, shift, scale, eps, split, out, store=True, quant=False)[0]


def _launch(x, shift, scale, eps, split, out, store: bool, quant: bool, qout=None):
    B, L, D = x.shape
    y = (torch.empty((B, L, D), dtype=x.dtype, device=x.device) if out is None else out) if store else x
    q, qs = empty_rows(B * L, D, x.device, out=qout) if quant else (x, x)  # (x: an unused dummy pointer)
    block = triton.next_power_of_2(D)
    with _on_device(x):
        _layernorm_modulate_kernel[(B * L,)](
            x,
            shift,
            scale,
            y,
            q,
            qs,
            L,
            D,
            B,
            L if split is None else split,
            x.stride(0),
            x.stride(1),
            y.stride(0),
            y.stride(1),
            shift.stride(0),
            scale.stride(0),
            eps,
            BLOCK=block,
            DT=_tl_dtype(x.dtype),
            STORE=store,
            QUANT=quant,
            num_warps=_num_warps(block),
        )
    return (y if store else None), q, qs


def layernorm_modulate_fp8_ref(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = EPS,
    split: int | None = None,
    keep: bool = False,
) -> QuantizedRows:
    """Plain torch: `layernorm_modulate_ref`, then `quantize_rows_ref` of its (B*L, D) rows."""
    return quantize_rows_ref_padded(layernorm_modulate_ref(x, shift, scale, eps, split), keep)


def layernorm_modulate_fp8(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = EPS,
    split: int | None = None,
    keep: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedRows:
    """`layernorm_modulate` for an `FP8Linear` consumer: the output's rows in e4m3 + fp32 scales
    (`QuantizedRows`, padded to `gemm_rows`), written by the same pass; with `keep`, the (B, L, D)
    output in x.dtype too (for a LoRA side GEMM), from the same registers. `out`: (q, scale) buffers
    (see `fp8_rows.empty_rows`) for the kernel to write instead of new ones.

    The bytes equal `quantize_rows(layernorm_modulate(x, ...))`: the row is quantised as stored. A
    layout the kernel does not take runs exactly that, the two passes.
    """
    if not _ok(x, shift, scale, split, None):  # the unfused pair (each op falls back on its own)
        return quantize_activation(layernorm_modulate(x, shift, scale, eps, split), keep, out)
    y, q, s = _launch(x, shift, scale, eps, split, None, store=keep, quant=True, qout=out)
    return QuantizedRows(q, s, x.shape, x.dtype, y)
