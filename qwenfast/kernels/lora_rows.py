"""Per-row LoRA: each batch row adds its own low-rank updates beside a shared base GEMM (Punica-style).

Why: a server batching requests that use different LoRAs cannot fuse them into the weights (a weight
holds one set), and running one LoRA group at a time serialises the batch. So the adapters resident on
the GPU are stacked per layer, and every row picks its own: with `down` (n, R, K) and `up` (n, N, R) the
stacked factors of n adapter slots (ranks zero-padded to R; slot 0 all zeros: "no LoRA"), `idx` (B, S)
the slots each row uses (up to S per row; unused entries 0) and `scale` (B, S) each one's strength,

    y[b] += Σ_s scale[b, s] · (x[b] · down[idx[b, s]]ᵀ) · up[idx[b, s]]ᵀ.

Shapes never depend on which adapters a row picks (the zero slot stands in for none), so one captured
CUDA graph serves any mix: the selection lives in device tensors that the host rewrites before a replay.

`lora_rows` gathers each row's factors and runs two batched GEMMs over all its selected slots at once: a
row pays for its own rank (B · L · R · (K + N) multiply-adds per slot), not for every resident adapter's,
as one GEMM over all of them concatenated would. That is the captured path (static shapes); an eager
forward knows the selection on the host: nothing when no row has a LoRA, plain GEMMs at the adapter's
own rank when the rows with one share it, else the gathered pass cut to the used columns (`RowLora.add`).
`lora_rows_ref` is the per-row loop it must equal.

On CUDA (and in Triton's interpreter) the gathered pass is two segmented Triton kernels instead
(`lora_rows_triton`): `_shrink_kernel` reads each row's down factor in the stack where it lies (no
gathered copy) and writes h = x · downᵀ · strength; `_expand_kernel` adds h · upᵀ into y tile by tile,
one read and one write of y, rows of the zero slot untouched (no load, no store). Why: the torch pass
spent 18.4 of its 88 ms a forward copying each row's factors (`index_select`; H100, FP8, 1024², batch 4,
four rank-64 LoRAs); cuBLAS's batched GEMMs in place of either kernel measured within 1.5% (commit
9a30567). The shrink splits K into fp32 parts when its rows make few programs (the text stream's 128-odd
tokens per image), summed in order by a second kernel (`TILES["programs"]`; summed inside the expand they
were re-read once per tile of y: +40% per forward instead of +27%, commit d6f97ce).

Registers (ptxas -v for sm_90a, `qwenfast.testing.ptxas`, no GPU needed): the expand once spilled ~3 KB
per thread at every tile compiled, its y tile addressed through a (BM, BN) tile of 64-bit pointers live
across the products; it now addresses y after them with 32-bit offsets inside one row of y and one slot of
up (the launcher checks they fit), S a compile-time count. The shrink covers 64 of the rank at a time, the
rank tiles of one block of rows side by side (they read those rows of x from L2). The default tiles
compile without spills (`test_default_tiles_do_not_spill`).

Measured on an H100 (FP8, batch 4, 1024², four rank-64 LoRAs; the sweep `python -m
qwenfast.benchmarks.lora_tiles`, the image stream's four layers summed per block): the expand 0.940 ms at
128 x 128, 0.818 at 64 x 128 (BR 32, 8 warps, the default: 2.2 TB/s counting one read and one write of
the outputs; commit 802e1aa); no `prefetch`, register cap (two programs an SM) or K split of the shrink
into more programs beat the defaults (commit dd7437f). Per layer (ms, TB/s of the bytes each must move):
qkv (rank 192, three blocks) expand 0.364 / 1.66, shrink 0.077 / 0.65; attention out 0.077 / 2.61, 0.040 /
1.28; MLP fc1 0.293 / 2.75, 0.041 / 1.24; fc2 0.078 / 2.59, 0.114 / 1.77. The forward with this side path
adds ~22-25% to the FP8 forward and ~21% to the bf16 one; in FP8 forwards whose rows differ the expand
now runs inside the base GEMM instead (`fp8_lora_gemm.py`, `RowLora.fused`).

The shrink of e4m3 codes (the FP8 path) reads its tiles through TMA descriptors (`_shrink_tma_kernel`,
`TILES["shrink_tma"]`): on an H100 (2026-11-28) about 0.25-0.3 ms per block of the image stream against
0.336 for the pointer kernel (commit d583209), which keeps bf16 / fp32 inputs and the split-K parts of few
rows.

Column blocks: a LoRA with separate Q, K and V factors stacks to rank 192 on the fused qkv projection,
but each third of its output columns has nonzero up factors in one third of that rank only
(`loading.lora_fp8.piece_ranks` -> `RowLora.ranges`, (n, G, 2)). With `ranges` the expand walks each
tile's block of columns over its own [lo, hi) of each slot's rank: a third of the products and of up's
reads it made over the zeros before (a tile straddling two blocks walks all of it; the result is the
same either way).

On an FP8 layer whose input a fused producer quantised (`QuantizedRows`), the shrink reads those e4m3
rows and their scales (`x_scale`) instead of a bf16 copy the producer would keep for it: counted at
1024², batch 4, the copies of the qkv, fc1 and fc2 inputs are ~0.6 GB written and read again per block
(~12 ms of the FP8 forward at 3 TB/s), and the codes halve what the shrink reads. The update is then the
dequantised input's: its e4m3 rounding (what the GEMM beside it multiplies) is also in the LoRA term.

Tried and taken out (commit 5180a74, `--row-wide`): the updates inside the layer's own GEMM by
concatenation along K (the weight widened by each (row, adapter)'s up factors, the input by each row's h
in its own block of columns). On an H100 (batch 4, 1024², four rank-64 LoRAs, CUDA graphs) bf16 took
28.2% over no LoRA against 20.8% for the side path (a copy of the input, +25% products on the qkv stack);
on FP8 the random LoRAs' products did not fit e4m3's range beside the weights' row scales. The epilogue
form that replaced it for FP8 is `fp8_lora_gemm.py`.

The layer side (kernels/row_lora.py): `RowSelection`, `RowLora` (one layer's stacks; its `add` picks the
path) and `RowLoraLinear`, a float Linear (bf16 / fp32 weights) with the same side path: the per-row
adapters cannot be fused into one weight, so such a layer runs its GEMM as is and adds each row's updates
after.
"""

from __future__ import annotations

import torch

from . import FLOAT_DTYPES, _on_device, triton_available, use_triton
from .fp8_rows import FP8

__all__ = ["lora_rows", "lora_rows_ref", "lora_rows_triton"]

# tiles (module state: benchmark sweeps): shrink (BM rows, BK of K, warps, software-pipeline stages, the rank
# a program covers at most: a wider stack takes several programs); expand (BM x BN of y, BR of the rank at a
# time, warps, stages[, a register cap per thread: 128 lets two programs share an SM]); both chosen without
# spills in ptxas -v for sm_90a (module docstring; 64 x 128 x 32 at 8 warps capped at 128 spills 16 bytes,
# uncapped it takes 183 registers: candidates for a GPU sweep); programs: the
# shrink splits K while it would launch fewer than half of these (0: never; 200: the text stream's few
# rows split, the image stream's 128 programs at batch 4 do not); prefetch: the expand reads y's tile before
# its products (`_expand_kernel`), a candidate for GPU sweeps, off until one measures it faster
TILES = {
    "shrink": (128, 64, 8, 3, 64),
    "expand": (64, 128, 32, 8, 3),
    "programs": 200,
    "prefetch": 0,
    # e4m3 codes in, one K part: `_shrink_tma_kernel` at (BM, BK, warps, stages, BR max), or None: the
    # pointer kernel above (H100, commit d583209: 0.244 ms per block of the image stream against 0.336).
    # Its tiles within noise of each other over five sweeps (d583209 and four on 2026-11-28: 128 x 256
    # 0.295 ms per block on average, 64 x 128 0.303, 128 x 128 0.316): the one the rows record at 90056f6
    # ran with
    "shrink_tma": (128, 256, 8, 3, 64),
}

if triton_available():
    import triton
    import triton.language as tl

    from . import interpreting

    # Triton's CPU interpreter multiplies bf16/fp16 tiles wrongly in tl.dot (3.7: values of 1e10 on
    # small inputs): there the tiles go to fp32 first, which the GPU path does not need
    _DOT_F32 = tl.constexpr(1 if interpreting() else 0)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b in fp32: IEEE fp32 for fp32 tiles (tl.dot would round them to TF32)."""
        if IEEE:
            r = tl.dot(a, b, input_precision="ieee")
        elif _DOT_F32 == 1:
            r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            r = tl.dot(a, b)
        return r

    @triton.jit
    def _slot(idx_ptr, b, s, s_ib, s_is, u_ptr, s_un, rr_ptr, G, NG, col0, R, RANGES: tl.constexpr):
        """Batch row b's s-th slot: (slot index, its up factor's base, the rank range [lo, hi) its column
        tile at col0 reads; all of R without RANGES): the expand's and the fused FP8 GEMM's lookup."""
        slot = tl.load(idx_ptr + b * s_ib + s * s_is)
        ub = u_ptr + slot.to(tl.int64) * s_un
        lo, hi = 0, R
        if RANGES:
            rp = rr_ptr + (slot * G + col0 // NG) * 2
            lo, hi = tl.load(rp), tl.load(rp + 1)
        return slot, ub, lo, hi

    @triton.jit
    def _slot_product(
        acc, hb, ub, t, tmask, cols, cmask, h0, lo, hi, live, s_ht, s_uo, BR: tl.constexpr, IEEE: tl.constexpr
    ):
        """acc (BM, BN) + one slot's h[t, h0 + r] · up[cols, r] over r in [lo, hi), BR at a time (h at
        `hb`, the slot's up at `ub`; `live` False: nothing read): the expand's walk, and the fused FP8
        GEMM's epilogue (`fp8_lora_gemm.py`)."""
        rs = tl.arange(0, BR)
        for r0 in range(lo, hi, BR):
            rm = (r0 + rs < hi) & live
            ha = tl.load(
                hb + (t[:, None] * s_ht + (h0 + r0) + rs[None, :]),
                mask=tmask[:, None] & rm[None, :],
                other=0.0,
            )
            ua = tl.load(  # (BR, BN): up's rows are the columns of y
                ub + (cols[None, :] * s_uo + r0 + rs[:, None]), mask=cmask[None, :] & rm[:, None], other=0.0
            )
            acc += _dot(ha, ua, IEEE)
        return acc

    @triton.jit
    def _shrink_kernel(
        x_ptr,
        xs_ptr,
        d_ptr,
        idx_ptr,
        sc_ptr,
        h_ptr,
        T,
        K,
        R,
        S,
        s_xb,
        s_xt,
        s_dn,
        s_dr,
        s_ib,
        s_is,
        s_hb,
        s_ht,
        NRT,
        KC,
        s_pk,
        BM: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
        IEEE: tl.constexpr,
        CODES: tl.constexpr,
        PART: tl.constexpr,
    ):
        """h[b, t, s*R + r] = strength[b, s] * x[b, t] . down[idx[b, s], r] (fp32 accumulation, stored in
        h's dtype) for one (b, s), BM rows and BR of the rank; zeros for the zero slot (the expand skips
        those rows, h stays defined). With CODES, x holds e4m3 codes (widened to the factors' dtype:
        exact) and each row's product is multiplied by its scale xs[b * T + t] (fp32). With PART, the
        program sums K range [kt * KC, (kt + 1) * KC) only and stores its fp32 part at h_ptr + kt * s_pk
        (`_sum_parts_kernel` adds the parts in order: split-K for few rows, deterministic)."""
        # the rank tiles and K parts of one block of rows first: they read the same rows of x (from L2)
        pid, bs, mt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rt, kt = pid % NRT, pid // NRT
        b, s = bs // S, bs % S
        slot = tl.load(idx_ptr + b * s_ib + s * s_is)
        scale = tl.load(sc_ptr + b * s_ib + s * s_is)
        rows = mt * BM + tl.arange(0, BM)
        rank = rt * BR + tl.arange(0, BR)
        ks = tl.arange(0, BK)
        acc = tl.zeros([BM, BR], dtype=tl.float32)
        if slot != 0:
            xb = x_ptr + b.to(tl.int64) * s_xb + rows[:, None].to(tl.int64) * s_xt
            db = d_ptr + slot.to(tl.int64) * s_dn + rank[:, None] * s_dr
            for k0 in range(kt * KC, tl.minimum(K, (kt + 1) * KC), BK):
                km = k0 + ks < K
                xa = tl.load(xb + k0 + ks[None, :], mask=(rows[:, None] < T) & km[None, :], other=0.0)
                da = tl.load(db + k0 + ks[None, :], mask=(rank[:, None] < R) & km[None, :], other=0.0)
                if CODES:
                    xa = xa.to(d_ptr.dtype.element_ty)
                acc += _dot(xa, tl.trans(da), IEEE)
            if CODES:
                xs = tl.load(xs_ptr + b.to(tl.int64) * T + rows, mask=rows < T, other=0.0)
                acc = acc * xs[:, None]
            acc = acc * scale
        hp = h_ptr + b.to(tl.int64) * s_hb + rows[:, None].to(tl.int64) * s_ht + s * R + rank[None, :]
        if PART:
            hp += kt.to(tl.int64) * s_pk
        tl.store(hp, acc.to(h_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (rank[None, :] < R))

    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _shrink_tma_kernel(
        x_desc,
        d_desc,
        xs_ptr,
        idx_ptr,
        sc_ptr,
        h_ptr,
        T,
        K,
        R,
        S,
        s_dn,
        s_ib,
        s_is,
        s_hb,
        s_ht,
        NRT,
        BM: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
        """`_shrink_kernel` with CODES and one K part, its tiles through TMA descriptors: x's e4m3 codes as
        (B·T, K) (a tile past row b's T tokens reads row b + 1's, whose products are not stored; past the
        last row the TMA fills zeros) and the down stack as (n·R, K), so the loop holds no tile of
        pointers and the loads run ahead of the products (the pointer kernel moved the image stream's
        inputs at 0.6-1.3 TB/s on an H100)."""
        pid, bs, mt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rt = pid % NRT
        b, s = bs // S, bs % S
        slot = tl.load(idx_ptr + b * s_ib + s * s_is)
        scale = tl.load(sc_ptr + b * s_ib + s * s_is)
        rows = mt * BM + tl.arange(0, BM)
        rank = rt * BR + tl.arange(0, BR)
        acc = tl.zeros([BM, BR], dtype=tl.float32)
        if slot != 0:
            r0 = b * T + mt * BM
            d0 = (slot * s_dn + rt * BR).to(tl.int32)  # (n·R rows: far below 2**31)
            for k0 in range(0, K, BK):
                xa = x_desc.load([r0, k0]).to(d_desc.dtype)  # (BM, BK) codes, widened (exact)
                da = d_desc.load([d0, k0])  # (BR, BK)
                acc += _dot(xa, tl.trans(da), False)
            xs = tl.load(xs_ptr + b.to(tl.int64) * T + rows, mask=rows < T, other=0.0)
            acc = acc * xs[:, None] * scale
        hp = h_ptr + b.to(tl.int64) * s_hb + rows[:, None].to(tl.int64) * s_ht + s * R + rank[None, :]
        tl.store(hp, acc.to(h_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (rank[None, :] < R))

    @triton.jit
    def _sum_parts_kernel(p_ptr, h_ptr, E, KS, BLOCK: tl.constexpr):
        """h[i] = Σ_k p[k * E + i] in k order (the split shrink's parts, fp32), stored in h's dtype."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < E
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, KS):
            acc += tl.load(p_ptr + k * E + i, mask=m, other=0.0)
        tl.store(h_ptr + i, acc.to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _expand_kernel(
        h_ptr,
        u_ptr,
        idx_ptr,
        y_ptr,
        rr_ptr,
        T,
        N,
        R,
        G,
        NG,
        s_hb,
        s_ht,
        s_un,
        s_uo,
        s_ib,
        s_is,
        s_yb,
        s_yt,
        S: tl.constexpr,
        RANGES: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BR: tl.constexpr,
        IEEE: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        """y[b, t, n] += sum over the row's slots s of h[b, t, s*R:(s+1)*R] . up[idx[b, s], n], BM x BN
        of y, h in the factors' dtype (rounded as the torch pass rounds its h); a row whose slots are all
        zero is not touched (no load, no store), a zero slot's factors are not read. With RANGES, the
        tile's columns lie in one of G blocks of NG columns and a slot's rank is walked only over that
        block's [lo, hi) of rr (n, G, 2): Q, K and V of a stack of three rank-64 factors each take their
        own 64, not all 192.

        Register budget (ptxas -v for sm_90a, counted offline: `lora_rows` docstring): offsets inside one
        row's tensors are 32-bit (the launcher checks they fit) and y's tile is addressed only after the
        products, so no (BM, BN) tile of 64-bit pointers stays live across the loop; S is a compile-time
        count (unrolled). PREFETCH (`TILES["prefetch"]`, a candidate for GPU sweeps, off by default): y's
        tile is loaded before the products, so its read from memory overlaps them (the expand ran at about
        two fifths of an H100's memory bandwidth, its y read issued only after the products)."""
        nt, mt, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # N fastest: h's tile stays in L2
        rows = mt * BM + tl.arange(0, BM)
        cols = nt * BN + tl.arange(0, BN)
        live = tl.full([], 0, tl.int32)  # any slot of this row not the zero one
        for s in tl.static_range(S):
            live = tl.maximum(live, (tl.load(idx_ptr + b * s_ib + s * s_is) != 0).to(tl.int32))
        if live != 0:
            yb = y_ptr + b.to(tl.int64) * s_yb
            if PREFETCH:
                y = tl.load(
                    yb + (rows[:, None] * s_yt + cols[None, :]),
                    mask=(rows[:, None] < T) & (cols[None, :] < N),
                    other=0.0,
                )
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            hb = h_ptr + b.to(tl.int64) * s_hb
            for s in tl.static_range(S):
                slot, ub, lo, hi = _slot(
                    idx_ptr, b, s, s_ib, s_is, u_ptr, s_un, rr_ptr, G, NG, nt * BN, R, RANGES
                )
                acc = _slot_product(
                    acc,
                    hb,
                    ub,
                    rows,
                    rows < T,
                    cols,
                    cols < N,
                    s * R,
                    lo,
                    hi,
                    slot != 0,
                    s_ht,
                    s_uo,
                    BR,
                    IEEE,
                )
            off = rows[:, None] * s_yt + cols[None, :]
            m = (rows[:, None] < T) & (cols[None, :] < N)
            if not PREFETCH:
                y = tl.load(yb + off, mask=m, other=0.0)
            tl.store(yb + off, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=m)


def _check(x, y, down, up, idx, scale, x_scale=None, ranges=None) -> None:
    B, L, K = x.shape
    n, R, K2 = down.shape
    if K2 != K or up.shape[0] != n or up.shape[2] != R or y.shape != (B, L, up.shape[1]):
        raise ValueError(
            f"lora_rows: x {tuple(x.shape)}, y {tuple(y.shape)}, down {tuple(down.shape)}, up {tuple(up.shape)} "
            "do not agree: x (B, L, K), y (B, L, N), down (n, R, K), up (n, N, R)"
        )
    if idx.shape != scale.shape or idx.ndim != 2 or idx.shape[0] != B:
        raise ValueError(
            f"lora_rows: idx {tuple(idx.shape)} and scale {tuple(scale.shape)} must be (B={B}, S)"
        )
    if ranges is not None and (
        ranges.dim() != 3
        or ranges.shape[0] != n
        or ranges.shape[2] != 2
        or ranges.dtype != torch.int32
        or not ranges.is_contiguous()
        or up.shape[1] % ranges.shape[1]
    ):
        raise ValueError(
            f"lora_rows: ranges must be (n={n}, G, 2) int32 contiguous with G dividing N={up.shape[1]}, got "
            f"{ranges.dtype} {tuple(ranges.shape)}"
        )
    if (x_scale is not None) != (x.dtype == FP8) or (x_scale is not None and x_scale.shape != (B, L)):
        raise ValueError(
            "lora_rows: e4m3 x needs its rows' scales (x_scale (B, L) fp32) and only e4m3 x takes them; "
            f"got x {x.dtype}, x_scale {None if x_scale is None else tuple(x_scale.shape)}"
        )


def lora_rows(
    x: torch.Tensor,
    y: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    ranges: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (B, L, N) + each row's LoRA updates of x (B, L, K); see the module docstring. Computed in the
    factors' dtype and added into `y` in place when the dtypes match (y: the layer's fresh output).
    `x` may be the e4m3 codes an FP8 GEMM multiplies, with `x_scale` (B, L) their rows' fp32 scales:
    the update is then that of the dequantised input (x · x_scale), read at one byte an element.
    `ranges` (n, G, 2): where each slot's up factors are nonzero (`RowLora.ranges`); the expand then
    multiplies each of y's G column blocks by its own columns of the rank only (the same sum: the rest
    are zeros).

    One pass whatever S: a row's S selected factors are gathered side by side along the rank, so x is
    read once and y read and written once (a loop over S would do both S times)."""
    _check(x, y, down, up, idx, scale, x_scale, ranges)
    if _triton_ok(x, y, down, up, idx, scale, x_scale):
        return _expand(_shrink(x, down, idx, scale, x_scale=x_scale), up, idx, y, ranges)
    return _expand_torch(_shrink_torch(x, down, idx, scale, x_scale), up, idx, y)


def _shrink_torch(x, down, idx, scale, x_scale=None) -> torch.Tensor:
    """The shrink in torch: each row's selected factors gathered side by side along the rank, one batched
    GEMM; h (B, L, S*R) in the factors' dtype, strengths (and e4m3 rows' scales) applied."""
    B, S = idx.shape
    n, R, K = down.shape
    # (B, S*R, K): row b's factors, slot after slot
    d = down.index_select(0, idx.reshape(-1)).view(B, S * R, K)
    h = torch.bmm(x.to(down.dtype), d.transpose(1, 2))  # (B, L, S*R)
    if x_scale is not None:  # e4m3 codes: each row's product times its scale (exact codes, fp32 scale)
        h = (h.float() * x_scale[..., None]).to(h.dtype)
    return (h.view(B, -1, S, R) * scale.to(h.dtype)[:, None, :, None]).view(B, -1, S * R)


def _expand_torch(h, up, idx, y) -> torch.Tensor:
    """The expand in torch: y (B, L, N) + h · (each row's gathered up factors)ᵀ, one batched GEMM with
    y as its addend (cuBLAS reads and writes y once: in place when y is in the factors' dtype)."""
    B, S = idx.shape
    n, N, R = up.shape
    u = up.index_select(0, idx.reshape(-1)).view(B, S, N, R).permute(0, 2, 1, 3).reshape(B, N, S * R)
    if y.dtype == u.dtype:
        return y.baddbmm_(h, u.transpose(1, 2))
    return torch.baddbmm(y.to(u.dtype), h, u.transpose(1, 2)).to(y.dtype)


def _triton_ok(x, y, down, up, idx, scale, x_scale=None) -> bool:
    """The layouts the segmented kernels take: one float dtype for all (x: or e4m3 codes with contiguous
    fp32 row scales), unit-stride last dims, y written in place (its rows (B, L) strided), the stacks
    contiguous, indices int64 and strengths fp32."""
    codes = x_scale is not None and x_scale.dtype == torch.float32 and x_scale.is_contiguous()
    return (
        (x.dtype in FLOAT_DTYPES or codes)
        and y.dtype == down.dtype == up.dtype
        and (x.dtype == y.dtype or codes)
        and x.stride(-1) == 1
        and y.stride(-1) == 1
        and down.is_contiguous()
        and up.is_contiguous()
        and idx.dtype == torch.long
        and scale.dtype == torch.float32
        and x.shape[1] > 0
        and down.shape[1] > 0
        and _i32_offsets(y, up)
        and use_triton(x, y, down, up, idx, scale)
    )


def lora_rows_triton(
    x: torch.Tensor,
    y: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    h: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    ranges: torch.Tensor | None = None,
) -> torch.Tensor:
    """`lora_rows` as the two segmented kernels (see the module docstring); y updated in place and
    returned. `h`: the (B, L, S*R) buffer of the low-rank activations, in the factors' dtype (tests hand
    a poisoned one); `x_scale`, `ranges`: as `lora_rows` (x then e4m3 codes)."""
    _check(x, y, down, up, idx, scale, x_scale, ranges)
    return _expand(_shrink(x, down, idx, scale, h, x_scale), up, idx, y, ranges)


def _splits(programs: int, K: int, bk: int) -> int:
    """How many parts the shrink's K is cut into: doubled while the programs stay under half of
    TILES["programs"] and each part keeps >= 4 K tiles (the text stream's few rows: 4 programs for
    4 x 128 tokens would each walk all of K alone)."""
    ks = 1
    while programs * ks * 2 <= TILES["programs"] and K // (ks * 2) >= 4 * bk:
        ks *= 2
    return ks


def _shrink(x, down, idx, scale, h=None, x_scale=None) -> torch.Tensor:
    """The shrink: h (B, L, S*R) in the factors' dtype (see `_shrink_kernel`), split over K into fp32
    parts summed in order when the rows make few programs (`_splits`)."""
    B, L, K = x.shape
    n, R, _ = down.shape
    S = idx.shape[1]
    if scale.stride() != idx.stride():  # the kernel reads both at idx's strides
        idx, scale = idx.contiguous(), scale.contiguous()
    bm, bk, w, st, brmax = TILES["shrink"]
    br = min(brmax, max(16, triton.next_power_of_2(R)))
    if h is None:
        h = torch.empty(B, L, S * R, dtype=down.dtype, device=x.device)
    if h.shape != (B, L, S * R) or h.dtype != down.dtype:
        raise ValueError(
            f"lora_rows_triton: h must be {down.dtype} {(B, L, S * R)}, not {h.dtype} {tuple(h.shape)}"
        )
    nrt = triton.cdiv(R, br)
    programs = B * S * triton.cdiv(L, bm) * nrt
    ks = _splits(programs, K, bk) if h.is_contiguous() else 1
    kc = triton.cdiv(triton.cdiv(K, ks), bk) * bk
    ks = triton.cdiv(K, kc)  # (no empty last part)
    codes = x_scale is not None
    tma = TILES["shrink_tma"]
    if tma and codes and ks == 1 and x.is_contiguous() and K % 16 == 0 and down.dtype != torch.float32:
        return _shrink_tma(x, x_scale, down, idx, scale, h, tma)
    out = h if ks == 1 else torch.empty(ks, B, L, S * R, dtype=torch.float32, device=x.device)
    with _on_device(x):
        _shrink_kernel[(nrt * ks, B * S, triton.cdiv(L, bm))](
            x,
            x_scale if codes else scale,  # (an unread pointer without codes)
            down,
            idx,
            scale,
            out,
            L,
            K,
            R,
            S,
            x.stride(0),
            x.stride(1),
            down.stride(0),
            down.stride(1),
            idx.stride(0),
            idx.stride(1),
            out.stride(-3),
            out.stride(-2),
            nrt,
            kc,
            out.stride(0) if ks > 1 else 0,
            BM=bm,
            BR=br,
            BK=bk,
            IEEE=down.dtype == torch.float32,  # fp32 stays fp32 (tl.dot would round its inputs to TF32)
            CODES=codes,
            PART=ks > 1,
            num_warps=w,
            num_stages=st,
        )
        if ks > 1:
            E = h.numel()
            _sum_parts_kernel[(triton.cdiv(E, 1024),)](out, h, E, ks, BLOCK=1024, num_warps=4)
    return h


def _shrink_tma(x, x_scale, down, idx, scale, h, tile) -> torch.Tensor:
    """The shrink of e4m3 codes x (B, L, K) through `_shrink_tma_kernel` at `tile` (`TILES["shrink_tma"]`)."""
    B, L, K = x.shape
    n, R, _ = down.shape
    S = idx.shape[1]
    bm, bk, w, st, brmax = tile
    br = min(brmax, max(16, triton.next_power_of_2(R)))
    nrt = triton.cdiv(R, br)
    with _on_device(x):
        _shrink_tma_kernel[(nrt, B * S, triton.cdiv(L, bm))](
            TensorDescriptor.from_tensor(x.view(B * L, K), [bm, bk]),
            TensorDescriptor.from_tensor(down.view(n * R, K), [br, bk]),
            x_scale,
            idx,
            scale,
            h,
            L,
            K,
            R,
            S,
            R,
            idx.stride(0),
            idx.stride(1),
            h.stride(0),
            h.stride(1),
            nrt,
            BM=bm,
            BR=br,
            BK=bk,
            num_warps=w,
            num_stages=st,
        )
    return h


def _i32_offsets(y: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the expand's offsets inside one row of y and one slot of up fit in 32 bits."""
    B, L, N = y.shape
    return (L - 1) * y.stride(1) + N < 2**31 and (N - 1) * up.stride(1) + up.shape[2] < 2**31


def _expand(h, up, idx, y, ranges=None) -> torch.Tensor:
    """The expand: y (B, L, N) += each row's h · upᵀ in place (see `_expand_kernel`); with `ranges`, each
    column block of y by its own columns of the rank (when a tile of y never straddles two blocks)."""
    B, L, N = y.shape
    R, S = up.shape[2], idx.shape[1]
    if not _i32_offsets(y, up):
        raise ValueError(
            f"lora_rows_triton: y {tuple(y.shape)} / up {tuple(up.shape)} too large for 32-bit offsets"
        )
    bm, bn, bre, w, st, *cap = TILES["expand"]  # (a sixth entry: ptxas's register cap per thread)
    bre = min(bre, max(16, triton.next_power_of_2(R)))
    G = 1 if ranges is None else ranges.shape[1]
    by_block = ranges is not None and (N // G) % bn == 0
    with _on_device(y):
        _expand_kernel[(triton.cdiv(N, bn), triton.cdiv(L, bm), B)](
            h,
            up,
            idx,
            y,
            ranges if by_block else idx,  # (an unread pointer without ranges)
            L,
            N,
            R,
            G,
            N // G,
            h.stride(0),
            h.stride(1),
            up.stride(0),
            up.stride(1),
            idx.stride(0),
            idx.stride(1),
            y.stride(0),
            y.stride(1),
            S=S,
            RANGES=by_block,
            BM=bm,
            BN=bn,
            BR=bre,
            IEEE=up.dtype == torch.float32,
            PREFETCH=int(TILES["prefetch"]),
            num_warps=w,
            num_stages=st,
            **({"maxnreg": cap[0]} if cap and cap[0] else {}),
        )
    return y


def lora_rows_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain loop: row by row, slot by slot, in fp32 (e4m3 codes dequantised by their row scales)."""
    _check(x, y, down, up, idx, scale, x_scale)
    out = y.float().clone()
    xf = x.float() if x_scale is None else x.float() * x_scale[..., None]
    for b in range(x.shape[0]):
        for s in range(idx.shape[1]):
            j = int(idx[b, s])
            out[b] += float(scale[b, s]) * (xf[b] @ down[j].float().t()) @ up[j].float().t()
    return out.to(y.dtype)
