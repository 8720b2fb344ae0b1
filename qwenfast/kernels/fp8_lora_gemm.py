"""An FP8 (e4m3, rowwise-scaled) GEMM whose epilogue adds each batch row's own LoRA update: y = x8·w8ᵀ·sx·sw
+ bias + h·up[slot]ᵀ, the last term per row of the batch (the per-row LoRA's expand, kernels/lora_rows.py).

Why: per-row LoRAs beside FP8 GEMMs cost ~23% of an H100 forward at batch 4 (1024², four rank-64 LoRAs),
three quarters of it the expand, which reads and writes every layer's output once more after the GEMM
wrote it, at ~2.2 TB/s. Fused consumers (QK-norm, GELU) and the update by concatenation along K measured
slower (kernels/row_lora.py, lora_rows.py). Here the update is a few more tensor-core products on the
accumulator the GEMM already holds (rank 64 against K = 3072: ~2% of the products), and the output is
written once. What it costs instead: cuBLASLt's FP8 GEMM (`torch._scaled_mm`) is replaced by this Triton
one for layers with a per-row LoRA in use (only then: rows without LoRAs keep cuBLAS); worth it only if it
runs close to cuBLAS's rate (`python -m qwenfast.benchmarks.lora_tiles --gemm` times both per layer).

The shrink (h = x·downᵀ·strength, (B, T, S·R)) runs first as before (`lora_rows._shrink`, on the same e4m3
codes). A tile of M rows may straddle two batch rows (T tokens each: 1328² makes 6,889): it adds each
row's update over its own tokens. With `ranges` (the qkv stack, kernels/lora_rows.py: Q, K and V take their
own third of a rank-192 stack), each tile walks its column block's [lo, hi) of the rank only.

Measured (H100, batch 4, 1024², each row its own rank-64 LoRA, commit 9932aea, `python -m
qwenfast.benchmarks.lora_tiles --gemm ... --rows --weights fp8`): per block of the image stream's four
layers 3.17 ms at 128 x 256 x 128 (8 warps, 4 stages) against 3.62 for cuBLAS + the expand (cuBLAS alone
2.65: this GEMM without a LoRA runs at ~75-85% of cuBLAS's rate, what is left to gain); the forward
CUDA-graphed 393 ms against 411 with the side path and 334 without LoRAs (+17.8% against +23.1%); eagerly
431 against 415 ms (it then ran in captured forwards only; eagerly too since it measured faster there in
every run from d583209 on, `RowLora.fused`). The output differs from the unfused pair's by ~3e-3 per layer
(one bf16 rounding less, another accumulation order), ~1% over a forward.
With the shrink through TMA too (`lora_rows.TILES["shrink_tma"]`, commit d583209, `... --gemm "128 256 128
8 4 8 32" --rows --weights fp8`): graphed 381 ms against 403 with the side path and 330 without LoRAs
(+15.5% against +22.2%); eagerly 384 against 405 (faster that time, slower the two times before).
Persistent (one program per SM walking the tiles, each tile's output store under the next tile's
products; H100, 2026-11-28): per block 3.18 ms against 3.34 one program a tile (commit 6c83634), 3.11 at
GROUP_M 16 (90056f6); the forward CUDA-graphed 372 ms against 399 with the side path and 327 without
LoRAs (+13.7%, eagerly +14.3%; commit 682d9fb; +13.9% / +15.6% at 90056f6). Its tile and K loops
flattened (Triton pipelines the next tile's loads under the epilogue, which then has no loop: its rows and
rank steps unrolled): without a LoRA 0.68 ms on the qkv layer against 0.64 for cuBLAS and 0.86 one program
a tile, but the unrolled update cost 0.3 ms more there (taken out after commit 682d9fb).

`fp8_lora_gemm_ref` is the dequantised fp32 product it must equal (within the FP8 GEMM's accumulation
order and one bf16 rounding: the unfused pair rounds the GEMM's output before adding the update)."""

from __future__ import annotations

import functools

import torch

from . import _on_device, triton_available

__all__ = ["FUSED_GEMM", "fp8_lora_gemm", "fp8_lora_gemm_ref", "fits"]

# gemm: (BM, BN, BK, warps, stages, GROUP_M, BR, P, SUB): the GEMM's tile, its launch grouping (GROUP_M
# tiles of M walk one column of tiles, so their w tiles stay in L2), the rank the epilogue takes at a time
# (no spills for sm_90a with a LoRA of one or two slots, ranged or not), P programs per SM walking the tiles
# (persistent; 0: one program a tile) and SUB (1: the output stored in two halves); on: FP8 layers with
# per-row LoRAs in use run it instead of cuBLAS + the expand (`RowLora.fused`: 2 also eagerly, 1 in captured
# forwards only, 0 never)
FUSED_GEMM = {"gemm": (128, 256, 128, 8, 3, 16, 16, 1, 1), "on": 2}

if triton_available():
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .lora_rows import _slot, _slot_product

    @triton.jit
    def _tile(tile, npm, npn, GROUP_M: tl.constexpr):
        """(pm, pn) of the tile-th tile: GROUP_M tiles of M walk one column of tiles (w's in L2)."""
        group = tile // (GROUP_M * npn)
        first = group * GROUP_M
        gm = min(npm - first, GROUP_M)
        return first + (tile % (GROUP_M * npn)) % gm, (tile % (GROUP_M * npn)) // gm

    @triton.jit
    def _kernel(
        x_desc,
        w_desc,
        y_desc,
        sx_ptr,
        sw_ptr,
        b_ptr,
        h_ptr,
        u_ptr,
        idx_ptr,
        rr_ptr,
        M,
        N,
        K,
        T,
        R,
        G,
        NG,
        s_hb,
        s_ht,
        s_un,
        s_uo,
        s_ib,
        s_is,
        S: tl.constexpr,
        LORA: tl.constexpr,
        RANGES: tl.constexpr,
        BIAS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BR: tl.constexpr,
        GROUP_M: tl.constexpr,
        FP8_DOT: tl.constexpr,
        IEEE: tl.constexpr,
        SUB: tl.constexpr,
    ):
        """BM x BN tiles of y, from the program's id on, a grid's width apart (a grid of one program per
        tile, or a few per SM walking them, persistent: a program's output stores, TMA and asynchronous,
        then overlap its next tile's products): the e4m3 products over K in fp32 (x and w through TMA
        descriptors: no tile of pointers held in registers; the pointer-tile form spilled ~1 KB a thread at
        every tile compiled for sm_90a), times the rows' and the columns' scales, + bias, + for each batch
        row the tile's tokens belong to (one, or two where a tile straddles rows) and each of its S slots,
        h[rows, slot's R] · up[slot, cols]ᵀ (slot 0: none)."""
        npm, npn = tl.cdiv(M, BM), tl.cdiv(N, BN)
        for tile in range(tl.program_id(0), npm * npn, tl.num_programs(0)):
            pm, pn = _tile(tile, npm, npn, GROUP_M)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):  # (K % BK == 0: the launcher checks)
                a = x_desc.load([pm * BM, k0])  # (BM, BK)
                b = w_desc.load([pn * BN, k0])  # (BN, BK): w's rows are y's columns
                if FP8_DOT:
                    acc = tl.dot(a, b.T, acc)
                else:  # (Triton's interpreter: the e4m3 values widened, products exact in fp32)
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            rows = pm * BM + tl.arange(0, BM)
            cols = pn * BN + tl.arange(0, BN)
            rmask, cmask = rows < M, cols < N
            sx = tl.load(sx_ptr + rows, mask=rmask, other=0.0)
            sw = tl.load(sw_ptr + cols, mask=cmask, other=0.0)
            acc = acc * sx[:, None] * sw[None, :]
            if BIAS:
                acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if LORA:
                b0 = (pm * BM) // T
                b1 = tl.minimum(pm * BM + BM - 1, M - 1) // T
                for i in range(0, b1 - b0 + 1):
                    bb = b0 + i
                    t = rows - bb * T  # the tile's tokens inside row bb (others masked)
                    mine = rmask & (t >= 0) & (t < T)
                    hb = h_ptr + bb.to(tl.int64) * s_hb
                    for s in tl.static_range(S):
                        slot, ub, lo, hi = _slot(
                            idx_ptr, bb, s, s_ib, s_is, u_ptr, s_un, rr_ptr, G, NG, pn * BN, R, RANGES
                        )
                        hi = tl.where(slot != 0, hi, lo)  # the zero slot: nothing to add
                        acc = _slot_product(
                            acc, hb, ub, t, mine, cols, cmask, s * R, lo, hi, slot != 0, s_ht, s_uo, BR, IEEE
                        )
            if SUB:  # two (BM, BN / 2) stores: half the shared memory staging the tile's output
                a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                y_desc.store([pm * BM, pn * BN], a0.to(y_desc.dtype))
                y_desc.store([pm * BM, pn * BN + BN // 2], a1.to(y_desc.dtype))
            else:
                y_desc.store([pm * BM, pn * BN], acc.to(y_desc.dtype))


@functools.cache
def _sms(device: torch.device) -> int:
    """The GPU's SM count (a persistent launch's programs); Triton's interpreter: 4."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def fits(K: int, N: int) -> bool:
    """Whether the kernel takes a (K -> N) layer: whole BK tiles, rows of y 16-byte aligned (TMA)."""
    return K % FUSED_GEMM["gemm"][2] == 0 and N % 8 == 0


def fp8_lora_gemm(
    x8: torch.Tensor,
    sx: torch.Tensor,
    w8: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    lora: tuple | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, N) = rows [0, M) of x8 (Mp, K) e4m3 · sx (Mp, 1) times w8 (N, K) e4m3 · sw (N, 1), + bias (N),
    + with `lora` = (h (B, T, S·R), up (n, N, R), idx (B, S) int64, ranges (n, G, 2) int32 or None) each
    batch row's update (B·T = M). `out`: an (M, N) buffer to write (tests hand a poisoned one)."""
    N, K = w8.shape
    if not fits(K, N) or x8.stride() != (K, 1) or w8.stride() != (K, 1):
        raise ValueError(f"fp8_lora_gemm: K {K} must be whole tiles and x8 / w8 contiguous")
    y = torch.empty(M, N, dtype=out_dtype, device=x8.device) if out is None else out
    bm, bn, bk, w, st, gm, br, per_sm, sub = FUSED_GEMM["gemm"]
    if lora is None:
        h = up = idx = rr = sx  # (unread pointers)
        T, R, S, G, s_h, s_u, s_i, ranged = M, 1, 1, 1, (0, 0), (0, 0), (0, 0), False
    else:
        h, up, idx, rr = lora
        B, T, _ = h.shape
        R, S = up.shape[2], idx.shape[1]
        if B * T != M or up.shape[1] != N or not up.is_contiguous():
            raise ValueError(
                f"fp8_lora_gemm: h {tuple(h.shape)} / up {tuple(up.shape)} do not match ({M}, {N})"
            )
        G = 1 if rr is None else rr.shape[1]
        ranged = rr is not None and (N // G) % bn == 0
        rr = rr if ranged else idx
        s_h, s_u, s_i = (
            (h.stride(0), h.stride(1)),
            (up.stride(0), up.stride(1)),
            (idx.stride(0), idx.stride(1)),
        )
    fp8_dot = x8.is_cuda  # (the interpreter widens: numpy has no e4m3 products)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    with _on_device(x8):
        _kernel[(min(tiles, per_sm * _sms(x8.device)) if per_sm else tiles,)](
            TensorDescriptor.from_tensor(x8, [bm, bk]),
            TensorDescriptor.from_tensor(w8, [bn, bk]),
            TensorDescriptor.from_tensor(y, [bm, bn // 2 if sub else bn]),  # (the TMA clips rows past M)
            sx,
            sw,
            sx if bias is None else bias,
            h,
            up,
            idx,
            rr,
            M,
            N,
            K,
            T,
            R,
            G,
            N // G,
            *s_h,
            *s_u,
            *s_i,
            S=S,
            LORA=lora is not None,
            RANGES=ranged,
            BIAS=bias is not None,
            BM=bm,
            BN=bn,
            BK=bk,
            BR=min(br, max(16, triton.next_power_of_2(R))),
            GROUP_M=gm,
            FP8_DOT=fp8_dot,
            IEEE=lora is not None and up.dtype == torch.float32,
            SUB=sub > 0,
            num_warps=w,
            num_stages=st,
        )
    return y


def fp8_lora_gemm_ref(
    x8: torch.Tensor,
    sx: torch.Tensor,
    w8: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    lora: tuple | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_lora_gemm` dequantised, in fp32, rounded once to `out_dtype` (the up factors are zero outside
    `ranges`, so the whole rank is summed here)."""
    y = (x8[:M].float() * sx[:M]) @ (w8.float() * sw).t()
    if bias is not None:
        y = y + bias.float()
    if lora is not None:
        h, up, idx, _ = lora
        B, T, _ = h.shape
        R = up.shape[2]
        y = y.view(B, T, -1)
        for b in range(B):
            for s in range(idx.shape[1]):
                y[b] += h[b, :, s * R : (s + 1) * R].float() @ up[int(idx[b, s])].float().t()
        y = y.view(M, -1)
    return y.to(out_dtype)
