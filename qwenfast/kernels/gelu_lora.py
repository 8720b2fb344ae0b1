"""The MLP's middle when its first Linear has per-row LoRAs: y + each row's low-rank update, GELU(tanh),
and for an FP8 second Linear its e4m3 rows + scales, in one kernel.

Why: with per-row LoRAs (kernels/lora_rows.py) the first Linear's output y (B, L, 4D), the block's
biggest activation, was written by the GEMM, read and written again by the expand (y += h · upᵀ), then
read by the GELU pass. Here the GELU pass adds h · upᵀ to each tile of y as it reads it, so the
expand's read and write of y are gone. Counted at 1024², batch 4: y is 16,384 x 12,288 bf16 = 0.4 GB,
so ~0.8 GB less traffic per block, ~16 ms of an FP8 forward's 60 blocks at 3 TB/s; the price is the
low-rank product once per pass over y (the FP8 form makes two: the rows' max, then the codes), a
B·L·N·R·S multiply-adds each, which a tensor core does in a fraction of the time y's tile takes to load.

`gelu_lora_tanh_fp8` is `gelu.gelu_tanh_fp8` of the updated y (the same max-of-h amax shortcut, the same
GELU formula and e4m3 rounding, so the bytes are those of the unfused pair up to the reduction order of
the low-rank sum); `gelu_lora_tanh` writes the GELU in y's dtype (float weights: their GEMM had a
cuBLASLt GELU epilogue, which a LoRA'd layer cannot take). Each program holds BM tokens of one batch
row (one row's adapter slots) and walks the whole width in tiles of BN. `gelu_lora_tanh_ref`: the
update in fp32, rounded to y's dtype as the expand stores it, then the plain GELU (and quantisation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import FLOAT_DTYPES, _on_device, _tl_dtype, triton_available, use_triton
from .fp8_linear import quantize_activation
from .fp8_rows import QuantizedRows, empty_rows, quantize_rows_ref_padded
from .lora_rows import RowUpdate

__all__ = ["gelu_lora_tanh", "gelu_lora_tanh_fp8", "gelu_lora_tanh_ref"]

# BM tokens x BN columns per tile, warps, software-pipeline stages (module state: benchmark sweeps)
GELU_LORA_CONFIG = {"rows": 64, "cols": 128, "warps": 8, "stages": 3}

if triton_available():
    import triton
    import triton.language as tl

    from .adaln import _cast, _round
    from .fp8_rows import _codes, _row_scale
    from .gelu import _gelu
    from .lora_rows import _dot

    @triton.jit
    def _updated_tile(
        y_ptr,
        u0,
        u1,
        h0,
        h1,
        yrow,
        rows,
        cols,
        T,
        N,
        R,
        s_uo,
        RP: tl.constexpr,
        S: tl.constexpr,
        DT: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """y[rows, cols] + h0 · up0[cols]ᵀ (+ h1 · up1[cols]ᵀ) in fp32, rounded to DT as the expand stores
        it, and the tile's mask. A slot of 0 points at the zero adapter: its product adds zeros."""
        m = (rows[:, None] < T) & (cols[None, :] < N)
        y = tl.load(y_ptr + yrow[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rr = tl.arange(0, RP)
        um = (cols[:, None] < N) & (rr[None, :] < R)
        uo = cols[:, None].to(tl.int64) * s_uo + rr[None, :]
        acc = _dot(h0, tl.trans(tl.load(u0 + uo, mask=um, other=0.0)), IEEE)
        if S == 2:
            acc += _dot(h1, tl.trans(tl.load(u1 + uo, mask=um, other=0.0)), IEEE)
        return _round(y + acc, DT), m

    @triton.jit
    def _gelu_lora_kernel(
        y_ptr,
        h_ptr,
        u_ptr,
        idx_ptr,
        g_ptr,
        q_ptr,
        qs_ptr,
        T,
        N,
        R,
        s_yb,
        s_yt,
        s_hb,
        s_ht,
        s_un,
        s_uo,
        s_ib,
        s_is,
        s_g,
        BM: tl.constexpr,
        BN: tl.constexpr,
        RP: tl.constexpr,
        S: tl.constexpr,
        DT: tl.constexpr,
        IEEE: tl.constexpr,
        QUANT: tl.constexpr,
        STORE: tl.constexpr,
    ):
        """BM tokens of batch row b, its S (1 or 2) slots' h tiles (BM x RP, R of them real) held for the
        whole row walk, so each column tile is loads, one or two tl.dot and elementwise work (a loop
        Triton pipelines). With QUANT: pass 1 takes each token's max of the updated y, whose GELU is
        the token's amax when >= 0.171 (gelu.py's `_gelu_fp8_kernel` says why); tokens below take a pass
        over |GELU| (only when the block has one). Last pass: GELU once per element, e4m3 codes (row
        stride N) and scales, and with STORE the GELU in DT (row stride s_g). Output rows are
        b * T + token (the (M, N) layout of the second Linear's input)."""
        mt, b = tl.program_id(0), tl.program_id(1)
        rows = mt * BM + tl.arange(0, BM)
        live = rows < T
        cs = tl.arange(0, BN)
        rr = tl.arange(0, RP)
        out_row = b.to(tl.int64) * T + rows
        yrow = b.to(tl.int64) * s_yb + rows.to(tl.int64) * s_yt
        hm = live[:, None] & (rr[None, :] < R)
        hrow = h_ptr + b.to(tl.int64) * s_hb + rows[:, None].to(tl.int64) * s_ht + rr[None, :]
        h0 = tl.load(hrow, mask=hm, other=0.0)
        u0 = u_ptr + tl.load(idx_ptr + b * s_ib).to(tl.int64) * s_un
        h1, u1 = h0, u0
        if S == 2:
            h1 = tl.load(hrow + R, mask=hm, other=0.0)
            u1 = u_ptr + tl.load(idx_ptr + b * s_ib + s_is).to(tl.int64) * s_un
        if QUANT:
            hi = tl.full([BM, BN], float("-inf"), dtype=tl.float32)
            for c in range(0, N, BN):
                v, m = _updated_tile(
                    y_ptr, u0, u1, h0, h1, yrow, rows, c + cs, T, N, R, s_uo, RP, S, DT, IEEE
                )
                hi = tl.maximum(hi, tl.where(m, v, float("-inf")))
            amax = _gelu(tl.where(live, tl.max(hi, axis=1), 1.0), DT)
            if tl.min(amax, axis=0) < 0.171:
                a2 = tl.zeros([BM, BN], dtype=tl.float32)
                for c in range(0, N, BN):
                    v, m = _updated_tile(
                        y_ptr, u0, u1, h0, h1, yrow, rows, c + cs, T, N, R, s_uo, RP, S, DT, IEEE
                    )
                    a2 = tl.maximum(a2, tl.where(m, tl.abs(_gelu(v, DT)), 0.0))
                amax = tl.where(amax < 0.171, tl.max(a2, axis=1), amax)
            scale = _row_scale(amax)
            tl.store(qs_ptr + out_row, scale, mask=live)
        for c in range(0, N, BN):
            v, m = _updated_tile(y_ptr, u0, u1, h0, h1, yrow, rows, c + cs, T, N, R, s_uo, RP, S, DT, IEEE)
            g = _gelu(v, DT)
            cols = c + cs
            if STORE:
                tl.store(g_ptr + out_row[:, None] * s_g + cols[None, :], _cast(g, DT), mask=m)
            if QUANT:
                tl.store(q_ptr + out_row[:, None] * N + cols[None, :], _codes(g, scale[:, None]), mask=m)


def _updated_ref(y: torch.Tensor, update: RowUpdate) -> torch.Tensor:
    """y (B, L, N) + the update in fp32, rounded to y's dtype."""
    h, up, idx = update.h, update.up, update.idx
    B, S = idx.shape
    R = up.shape[2]
    out = y.float().clone()
    for b in range(B):
        for s in range(S):
            out[b] += h[b, :, s * R : (s + 1) * R].float() @ up[int(idx[b, s])].float().t()
    return out.to(y.dtype)


def gelu_lora_tanh_ref(y: torch.Tensor, update: RowUpdate, quantize: bool, keep: bool = False):
    """The unfused chain in torch: the update, GELU(tanh), and (`quantize`) `quantize_rows_ref` of its rows
    (`QuantizedRows`, with the GELU output too when `keep`); else the GELU output."""
    g = F.gelu(_updated_ref(y, update), approximate="tanh")
    return quantize_rows_ref_padded(g, keep) if quantize else g


def _ok(y: torch.Tensor, update: RowUpdate) -> bool:
    h, up, idx = update.h, update.up, update.idx
    return (
        y.dim() == 3
        and y.dtype in FLOAT_DTYPES
        and y.dtype == up.dtype == h.dtype
        and y.shape[1] > 0
        and y.stride(-1) == 1
        and h.stride(-1) == 1
        and up.is_contiguous()
        and idx.dtype == torch.long
        and 1 <= idx.shape[1] <= 2
        and up.shape[2] <= 256
        and h.shape[:2] == y.shape[:2]
        and up.shape[1] == y.shape[2]
        and use_triton(y, h, up, idx)
    )


def _launch(y, update, g, q, qs, quant: bool, store: bool) -> None:
    B, T, N = y.shape
    h, up, idx = update.h, update.up, update.idx
    R = up.shape[2]
    bm, bn, w = (GELU_LORA_CONFIG[k] for k in ("rows", "cols", "warps"))
    bn = min(bn, max(16, triton.next_power_of_2(N)))
    with _on_device(y):
        _gelu_lora_kernel[(triton.cdiv(T, bm), B)](
            y,
            h,
            up,
            idx,
            g,
            q,
            qs,
            T,
            N,
            R,
            y.stride(0),
            y.stride(1),
            h.stride(0),
            h.stride(1),
            up.stride(0),
            up.stride(1),
            idx.stride(0),
            idx.stride(1),
            g.stride(-2),
            BM=bm,
            BN=bn,
            RP=max(16, triton.next_power_of_2(R)),
            S=idx.shape[1],
            DT=_tl_dtype(y.dtype),
            IEEE=y.dtype == torch.float32,
            QUANT=quant,
            STORE=store,
            num_warps=w,
            num_stages=GELU_LORA_CONFIG["stages"],
        )


def gelu_lora_tanh_fp8(
    y: torch.Tensor,
    update: RowUpdate,
    keep: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedRows:
    """`gelu.gelu_tanh_fp8` of y (B, L, N) plus `update` (a `RowUpdate` of the Linear that wrote y), one
    kernel; `keep`: the GELU output in y's dtype too. Other layouts or devices: the expand, then the
    unfused GELU + quantisation. `out`: (q, scale) buffers (see `fp8_rows.empty_rows`)."""
    if not _ok(y, update):
        return quantize_activation(F.gelu(update.apply(y), approximate="tanh"), keep, out)
    B, T, N = y.shape
    q, qs = empty_rows(B * T, N, y.device, out=out)
    g = torch.empty(B * T, N, dtype=y.dtype, device=y.device) if keep else y  # (y: an unused pointer)
    _launch(y, update, g, q, qs, quant=True, store=keep)
    return QuantizedRows(q, qs, y.shape, y.dtype, g.view(y.shape) if keep else None)


def gelu_lora_tanh(y: torch.Tensor, update: RowUpdate) -> torch.Tensor:
    """GELU(tanh) of y (B, L, N) plus `update`, in y's dtype, one kernel (else the expand, then `F.gelu`)."""
    if not _ok(y, update):
        return F.gelu(update.apply(y), approximate="tanh")
    g = torch.empty_like(y, memory_format=torch.contiguous_format)
    _launch(y, update, g, y, y, quant=False, store=True)  # (q and its scales: unused pointers)
    return g
