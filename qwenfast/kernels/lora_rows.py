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
one read and one write of y, and leaves rows of the zero slot untouched (no load, no store). Why: the
profile of the torch pass (H100, FP8, 1024², batch 4, four rank-64 LoRAs, one forward; the qkv stack is
rank 192: three factors side by side) spent 18.4 ms of its 88 ms in `index_select` copying the factors
of each row, layer after layer, and 53.5 ms in the batched expand GEMM. (Since, with the kernels as
they are, cuBLAS's batched GEMMs over gathered factors in place of either half or both measured within
1.5% of a forward of them: H100, FP8, batch 4, 1024², commit 9a30567; the Triton expand also leaves rows
without a LoRA untouched, where cuBLAS reads and writes them.) The shrink splits K into fp32
parts when its rows make few programs (the text stream's 128-odd tokens per image: 4 programs at batch 4,
each walking all of K alone), summed in order by a second kernel before the expand (summed inside the
expand they were re-read once per tile of y's columns: +40% per forward instead of +27%, H100, commit
d6f97ce); the image stream's rows stay one part (`TILES["programs"]`).

Registers: compiled for sm_90a (ptxas -v; `qwenfast.testing.ptxas`, which needs no GPU), the expand at
the tiles its GPU sweeps chose spilled ~2.7 KB stored and ~3.4 KB loaded per thread, at every tile tried:
its y tile was addressed through a (BM, BN) tile of 64-bit pointers computed before the products and live
across them. It now addresses y after them, with 32-bit offsets inside one row of y and one slot of up
(the launcher checks they fit; else the torch pass), and S is a compile-time count. The shrink took a
stack's whole padded rank in one program (256 for the qkv stack's 192: 1.2 KB of spills, a quarter of
its products on padding); it now covers 64 at a time, the rank tiles of one block of rows launched side
by side so they read those rows of x from L2. The chosen tiles of both compile without spills
(`test_default_tiles_do_not_spill`). What that is worth on the GPU is for `STAGE=rows bash bench/serve.sh`.

On an FP8 layer whose input a fused producer quantised (`QuantizedRows`), the shrink reads those e4m3
rows and their scales (`x_scale`) instead of a bf16 copy the producer would keep for it: counted at
1024², batch 4, the copies of the qkv, fc1 and fc2 inputs are ~0.6 GB written and read again per block
(~12 ms of the FP8 forward at 3 TB/s), and the codes halve what the shrink reads. The update is then the
dequantised input's: its e4m3 rounding (what the GEMM beside it multiplies) is also in the LoRA term.

`RowLoraLinear` is a float Linear (bf16 / fp32 weights) with the same side path: the per-row adapters
cannot be fused into one weight, so such a layer runs its GEMM as is and adds each row's updates after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import FLOAT_DTYPES, _on_device, triton_available, use_triton
from .fp8_rows import FP8

__all__ = [
    "RowLora",
    "RowLoraLinear",
    "RowSelection",
    "lora_rows",
    "lora_rows_ref",
    "lora_rows_triton",
    "plain_linear",
]

# tiles (module state: benchmark sweeps): shrink (BM rows, BK of K, warps, software-pipeline stages, the rank
# a program covers at most: a wider stack takes several programs); expand (BM x BN of y, BR of the rank at a
# time, warps, stages); both chosen without spills in ptxas -v for sm_90a (module docstring); programs: the
# shrink splits K while it would launch fewer than half of these (0: never; 200: the text stream's few
# rows split, the image stream's 128 programs at batch 4 do not)
TILES = {"shrink": (128, 64, 8, 3, 64), "expand": (128, 128, 32, 8, 3), "programs": 200}

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
        T,
        N,
        R,
        s_hb,
        s_ht,
        s_un,
        s_uo,
        s_ib,
        s_is,
        s_yb,
        s_yt,
        S: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BR: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """y[b, t, n] += sum over the row's slots s of h[b, t, s*R:(s+1)*R] . up[idx[b, s], n], BM x BN
        of y, h in the factors' dtype (rounded as the torch pass rounds its h); a row whose slots are all
        zero is not touched (no load, no store), a zero slot's factors are not read.

        Register budget (ptxas -v for sm_90a, counted offline: `lora_rows` docstring): offsets inside one
        row's tensors are 32-bit (the launcher checks they fit) and y's tile is addressed only after the
        products, so no (BM, BN) tile of 64-bit pointers stays live across the loop; S is a compile-time
        count (unrolled)."""
        nt, mt, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # N fastest: h's tile stays in L2
        rows = mt * BM + tl.arange(0, BM)
        cols = nt * BN + tl.arange(0, BN)
        rs = tl.arange(0, BR)
        live = tl.full([], 0, tl.int32)  # any slot of this row not the zero one
        for s in tl.static_range(S):
            live = tl.maximum(live, (tl.load(idx_ptr + b * s_ib + s * s_is) != 0).to(tl.int32))
        if live != 0:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            hb = h_ptr + b.to(tl.int64) * s_hb
            for s in tl.static_range(S):
                slot = tl.load(idx_ptr + b * s_ib + s * s_is)
                ub = u_ptr + slot.to(tl.int64) * s_un
                for r0 in range(0, R, BR):
                    rm = (r0 + rs < R) & (slot != 0)
                    ha = tl.load(
                        hb + (rows[:, None] * s_ht + (s * R + r0) + rs[None, :]),
                        mask=(rows[:, None] < T) & rm[None, :],
                        other=0.0,
                    )
                    ua = tl.load(  # (BR, BN): up's rows are the columns of y
                        ub + (cols[None, :] * s_uo + r0 + rs[:, None]),
                        mask=(cols[None, :] < N) & rm[:, None],
                        other=0.0,
                    )
                    acc += _dot(ha, ua, IEEE)
            yb = y_ptr + b.to(tl.int64) * s_yb
            off = rows[:, None] * s_yt + cols[None, :]
            m = (rows[:, None] < T) & (cols[None, :] < N)
            y = tl.load(yb + off, mask=m, other=0.0)
            tl.store(yb + off, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=m)


def _check(x, y, down, up, idx, scale, x_scale=None) -> None:
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
) -> torch.Tensor:
    """y (B, L, N) + each row's LoRA updates of x (B, L, K); see the module docstring. Computed in the
    factors' dtype and added into `y` in place when the dtypes match (y: the layer's fresh output).
    `x` may be the e4m3 codes an FP8 GEMM multiplies, with `x_scale` (B, L) their rows' fp32 scales:
    the update is then that of the dequantised input (x · x_scale), read at one byte an element.

    One pass whatever S: a row's S selected factors are gathered side by side along the rank, so x is
    read once and y read and written once (a loop over S would do both S times)."""
    _check(x, y, down, up, idx, scale, x_scale)
    if _triton_ok(x, y, down, up, idx, scale, x_scale):
        return _expand(_shrink(x, down, idx, scale, x_scale=x_scale), up, idx, y)
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
) -> torch.Tensor:
    """`lora_rows` as the two segmented kernels (see the module docstring); y updated in place and
    returned. `h`: the (B, L, S*R) buffer of the low-rank activations, in the factors' dtype (tests hand
    a poisoned one); `x_scale`: as `lora_rows` (x then e4m3 codes)."""
    _check(x, y, down, up, idx, scale, x_scale)
    return _expand(_shrink(x, down, idx, scale, h, x_scale), up, idx, y)


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
    out = h if ks == 1 else torch.empty(ks, B, L, S * R, dtype=torch.float32, device=x.device)
    codes = x_scale is not None
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


def _i32_offsets(y: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the expand's offsets inside one row of y and one slot of up fit in 32 bits."""
    B, L, N = y.shape
    return (L - 1) * y.stride(1) + N < 2**31 and (N - 1) * up.stride(1) + up.shape[2] < 2**31


def _expand(h, up, idx, y) -> torch.Tensor:
    """The expand: y (B, L, N) += each row's h · upᵀ in place (see `_expand_kernel`)."""
    B, L, N = y.shape
    R, S = up.shape[2], idx.shape[1]
    if not _i32_offsets(y, up):
        raise ValueError(
            f"lora_rows_triton: y {tuple(y.shape)} / up {tuple(up.shape)} too large for 32-bit offsets"
        )
    bm, bn, bre, w, st = TILES["expand"]
    bre = min(bre, max(16, triton.next_power_of_2(R)))
    with _on_device(y):
        _expand_kernel[(triton.cdiv(N, bn), triton.cdiv(L, bm), B)](
            h,
            up,
            idx,
            y,
            L,
            N,
            R,
            h.stride(0),
            h.stride(1),
            up.stride(0),
            up.stride(1),
            idx.stride(0),
            idx.stride(1),
            y.stride(0),
            y.stride(1),
            S=S,
            BM=bm,
            BN=bn,
            BR=bre,
            IEEE=up.dtype == torch.float32,
            num_warps=w,
            num_stages=st,
        )
    return y


def plain_linear(layer: nn.Module) -> bool:
    """Whether `layer(x)` is `F.linear(x, layer.weight, layer.bias)` this forward: an nn.Linear, or a
    `RowLoraLinear` that adds nothing now (so a fused path may read its weight directly)."""
    return type(layer) is nn.Linear or (isinstance(layer, RowLoraLinear) and not layer.adds())


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


class RowSelection:
    """Which adapter slots each row of the coming forward uses, shared by every layer of a model: the host
    writes it before a forward (`set`), each `RowLora` reads it. One pair of device buffers per batch size,
    rewritten in place: a CUDA graph captured for a batch size reads the same buffers at every replay."""

    def __init__(self, width: int = 2):
        self.width = width  # S: adapters a row may combine
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.current: tuple[torch.Tensor, torch.Tensor] | None = None
        self.used = width  # the most adapters any row of the current selection combines (host-side)
        # host-side runs of consecutive rows with the same adapters: [(first row, end row, [(slot, s)])]
        self.groups: list[tuple[int, int, list[tuple[int, float]]]] = []

    def clear(self) -> None:
        """No selection: every forward until the next `set` runs without the side path (a call that
        gives no per-row LoRAs must not inherit the last call's)."""
        self.current, self.used, self.groups = None, 0, []

    def set(self, rows: list[list[tuple[int, float]]], device: torch.device | str) -> None:
        """`rows`: per batch row, its [(slot, strength), ...] (slot 0 / an empty list: no LoRA)."""
        if any(len(r) > self.width for r in rows):
            raise ValueError(f"a row combines more than {self.width} LoRAs (RowSelection.width)")
        idx = torch.zeros(len(rows), self.width, dtype=torch.long)
        scale = torch.zeros(len(rows), self.width, dtype=torch.float32)
        for b, row in enumerate(rows):
            for s, (slot, strength) in enumerate(row):
                idx[b, s], scale[b, s] = slot, strength
        key = (len(rows), str(torch.device(device)))
        if key not in self.buffers:
            self.buffers[key] = (idx.to(device), scale.to(device))
        else:
            self.buffers[key][0].copy_(idx, non_blocking=True)
            self.buffers[key][1].copy_(scale, non_blocking=True)
        self.current = self.buffers[key]
        self.used = max((len(r) for r in rows), default=0)
        self.groups = []
        for b, row in enumerate(rows):
            row = [(int(j), float(v)) for j, v in row if j != 0 and v != 0]
            if self.groups and self.groups[-1][2] == row and self.groups[-1][1] == b:
                self.groups[-1] = (self.groups[-1][0], b + 1, row)
            else:
                self.groups.append((b, b + 1, row))
        self.groups = [g for g in self.groups if g[2]]

    @property
    def active(self) -> bool:
        """Whether any row of the current selection uses an adapter (host-side). When none does, the
        side path is skipped altogether, in a captured graph too: graphs are keyed by how many adapters
        a row combines, 0 for none (`RowAdapters.select` tags the model), so rows without LoRAs pay
        nothing."""
        return bool(self.groups)


@dataclass
class RowLora:
    """One layer's stacked adapters (`down` (n, R, K), `up` (n, N, R); slot 0 zeros), each slot's own
    rank (`ranks`, host-side: R is the largest, padded), and the model's selection: what
    `LowBitLinear.lora` holds when each row picks its own LoRAs."""

    down: torch.Tensor
    up: torch.Tensor
    selection: RowSelection
    ranks: list[int] = field(default_factory=list)

    def add(self, x2: torch.Tensor, y2: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """y2 (M, N) + the per-row updates of x2 (M, K); the M tokens are B rows of M / B, in order.
        `x2` may be the e4m3 codes of an FP8 layer's input with `x_scale` (M, 1) their row scales (the
        rows its producer quantised: no bf16 copy of the input is kept for this side path).

        Captured into a CUDA graph: `lora_rows` over the selection's device buffers, cut to the slot
        columns the rows use (any later selection using as many replays correctly). Eager, where the
        host knows the selection: nothing when no row has a LoRA; when the rows with one share the same
        adapters (batch 1 always), two plain GEMMs per adapter at its own rank on those rows (the
        strength as the second one's alpha), as cheap as a LoRA loaded for the whole batch; otherwise
        `lora_rows` cut likewise. (On an H100, FP8, 1024², batch 4 with four rank-64 LoRAs, commit
        7dfd1a1: a GEMM pair per row cost 39% over no LoRA, the gathered pass 26%.)"""
        sel = self.selection
        if not sel.active:  # no selection, or no row of it has a LoRA (a graph captured so is keyed so)
            return y2
        B, (M, K), N = sel.current[0].shape[0], x2.shape, y2.shape[1]
        if M % B:
            raise RuntimeError(f"per-row LoRAs: {M} tokens do not split into the selection's {B} rows")
        T = M // B
        xs = None if x_scale is None else x_scale.reshape(B, T)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing or len(sel.groups) > 1:  # rows differ: one gathered pass beats a GEMM pair per run
            # (measured); the used slot columns only (graphs are keyed by that count: `RowAdapters._tag`)
            idx, scale = sel.current
            idx, scale = idx[:, : sel.used], scale[:, : sel.used]
            x3, y3 = x2.reshape(B, T, K), y2.view(B, T, N)
            return lora_rows(x3, y3, self.down, self.up, idx, scale, xs).reshape(M, N)
        dt = self.down.dtype
        for b0, b1, adapters in sel.groups:
            xr, yr = x2[b0 * T : b1 * T], y2[b0 * T : b1 * T]  # (rows*T, K), (rows*T, N): row blocks
            for slot, strength in adapters:
                r = self.ranks[slot] if slot < len(self.ranks) else self.down.shape[1]
                if r == 0:  # this adapter leaves this layer alone
                    continue
                h = xr.to(dt) @ self.down[slot, :r].t()  # (rows*T, r)
                if x_scale is not None:  # e4m3 codes: each token's product times its row scale
                    h = (h.float() * x_scale[b0 * T : b1 * T]).to(dt)
                if yr.dtype == dt:
                    yr.addmm_(h, self.up[slot, :, :r].t(), alpha=strength)
                else:
                    yr.copy_(torch.addmm(yr.to(dt), h, self.up[slot, :, :r].t(), alpha=strength))
        return y2


class RowLoraLinear(nn.Linear):
    """A float Linear whose rows add their own LoRAs (`lora`: a `RowLora`, or None: a plain Linear).
    It shares the Linear it stands in for's parameters (`wrap`): same names, same storage, so batch-wide
    LoRA merges, offload streaming and checkpoints see the layer they knew. Fused paths that read a
    Linear's weight directly (the MLP's GELU epilogue) take it when `plain_linear(layer)`."""

    lora: RowLora | None = None

    @classmethod
    def wrap(cls, lin: nn.Linear) -> RowLoraLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias  # the same Parameters, not copies
        return new

    def adds(self) -> bool:
        """Whether this forward adds anything to the GEMM: a stack is set and some row of the current
        selection uses an adapter. When not, fused paths may take the layer as a plain Linear (rows
        without a LoRA pay nothing: the MLP's GELU epilogue cost 4% of a bf16 forward when skipped)."""
        return self.lora is not None and self.lora.selection.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adds():
            return y
        K, N = x.shape[-1], y.shape[-1]
        return self.lora.add(x.reshape(-1, K), y.reshape(-1, N)).view(y.shape)
