"""QK-norm + RoPE of a fused QKV projection with each batch row's LoRA update added first, in one pass: the
per-row LoRA expand of the qkv layer (kernels/lora_rows.py `_expand_kernel`) and `qk_norm_rope` as one kernel.

Why: with per-row LoRAs the expand reads and writes the qkv projection's whole output only for the
QK-norm kernel to read it again. At 1024², batch 4, that output is 4 x 4096 tokens x 9216 bf16 values,
0.3 GB; the expand moves 0.6 GB of it per block, ~36 GB per forward, a third of all the bytes the
per-row side path moves (an H100 sweep timed the expand at ~2.2 TB/s: ~16 ms of the ~81 ms the side path
added to an FP8 forward, kernels/lora_rows.py). Here the update never goes to memory: each program takes
BT tokens of one batch row and one head, loads that head's Q, K and V tiles (BT, Dh) of the projection,
adds h · upᵀ over the row's adapter slots on the tensor cores (tl.dot, each of Q, K and V over its own
columns of the stacked rank, `ranges`, as the expand does), rounds the sum to the projection's dtype (what
the expand stores), then normalises and rotates Q and K as `qk_norm_rope` does (its `_norm_rope`, with each
token's own angles) and writes all three into the joint (B, H, S, Dh) buffers at [offset, offset + L).

Inputs: `h` (B, L, S*R), the shrink's low-rank activations (kernels/lora_rows.py `_shrink`: strengths and
e4m3 row scales applied, in the factors' dtype), `up` (n, 3*H*Dh, R) the stacked up factors, `idx` (B, S)
the slots each row uses (0: none, its rows add nothing), `ranges` (n, 3, 2) int32 or None. Q and K are
written in the buffers' float dtype (no e4m3 outputs: the 8-bit attention path keeps the unfused pair).

`qk_norm_rope_rows_ref` is the unfused pair in torch (the expand's torch form, then `qk_norm_rope_ref`).
The model reaches it through `row_lora.deferred_rows` and `runtime.attention.joint_attention` (on while
`row_lora.FUSE["qkv"]`); its GPU time against the pair it replaces is for the tile sweep (`STAGE=tiles
bash bench/serve.sh`) and the rows benchmark, which times the forward both ways, to measure.
"""

from __future__ import annotations

import torch

from . import FLOAT_DTYPES, _on_device, _tl_dtype, triton_available, use_triton
from .lora_rows import _expand_torch
from .qk_norm_rope import EPS, qk_norm_rope_ref

__all__ = ["qk_norm_rope_rows", "qk_norm_rope_rows_ref", "TILE"]

TILE = {"tokens": 32, "rank": 32, "warps": 8}  # BT tokens a program, BR of the rank a product, warps

if triton_available():
    import triton
    import triton.language as tl

    from .adaln import _cast
    from .lora_rows import _dot
    from .qk_norm_rope import _norm_rope

    @triton.jit
    def _qk_norm_rope_rows_kernel(
        qkv_ptr,
        h_ptr,
        u_ptr,
        idx_ptr,
        rr_ptr,
        wq_ptr,
        wk_ptr,
        cos_ptr,
        sin_ptr,
        oq_ptr,
        ok_ptr,
        ov_ptr,
        L,
        H,
        Dh,
        R,
        offset,
        s_b,
        s_l,
        s_hb,
        s_ht,
        s_un,
        s_uo,
        s_ib,
        s_is,
        s_cos,
        s_sin,
        sq_b,
        sq_h,
        sq_s,
        sk_b,
        sk_h,
        sk_s,
        sv_b,
        sv_h,
        sv_s,
        eps,
        S: tl.constexpr,
        BT: tl.constexpr,
        BR: tl.constexpr,
        BLOCK_D: tl.constexpr,
        RANGES: tl.constexpr,
        IEEE: tl.constexpr,
        YDT: tl.constexpr,
        W_HALF: tl.constexpr,
        QDT: tl.constexpr,
        KDT: tl.constexpr,
        VDT: tl.constexpr,
    ):
        tt, hd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        toks = tt * BT + tl.arange(0, BT)
        tm = toks < L
        ds = tl.arange(0, BLOCK_D)
        dm = ds < Dh
        m2 = tm[:, None] & dm[None, :]
        half = tl.arange(0, BLOCK_D // 2)
        hm = tm[:, None] & (half < Dh // 2)[None, :]
        rs = tl.arange(0, BR)
        live = tl.full([], 0, tl.int32)  # any slot of this row not the zero one
        for j in tl.static_range(S):
            live = tl.maximum(live, (tl.load(idx_ptr + b * s_ib + j * s_is) != 0).to(tl.int32))
        src = qkv_ptr + b.to(tl.int64) * s_b + toks[:, None].to(tl.int64) * s_l
        hb = h_ptr + b.to(tl.int64) * s_hb + toks[:, None].to(tl.int64) * s_ht
        for part in tl.static_range(3):  # Q, K, V of head hd
            col0 = part * H * Dh + hd * Dh
            y = tl.load(src + col0 + ds[None, :], mask=m2, other=0.0).to(tl.float32)  # (BT, Dh)
            if live != 0:
                acc = tl.zeros([BT, BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(S):
                    slot = tl.load(idx_ptr + b * s_ib + j * s_is)
                    ub = u_ptr + slot.to(tl.int64) * s_un
                    lo, hi = 0, R
                    if RANGES:
                        rp = rr_ptr + (slot * 3 + part) * 2
                        lo, hi = tl.load(rp), tl.load(rp + 1)
                    for r0 in range(lo, hi, BR):
                        rm = (r0 + rs < hi) & (slot != 0)
                        ha = tl.load(
                            hb + (j * R + r0) + rs[None, :], mask=tm[:, None] & rm[None, :], other=0.0
                        )
                        ua = tl.load(  # (BR, Dh): up's rows are the projection's columns
                            ub + (col0 + ds[None, :]) * s_uo + r0 + rs[:, None],
                            mask=dm[None, :] & rm[:, None],
                            other=0.0,
                        )
                        acc += _dot(ha, ua, IEEE)
                y = (y + acc).to(qkv_ptr.dtype.element_ty).to(tl.float32)  # what the expand stores
            seq = offset + toks
            if part < 2:  # each token's angles, loaded where used (registers: not live across the products)
                c = tl.load(cos_ptr + toks[:, None] * s_cos + half[None, :], mask=hm, other=0.0).to(
                    tl.float32
                )
                s = tl.load(sin_ptr + toks[:, None] * s_sin + half[None, :], mask=hm, other=0.0).to(
                    tl.float32
                )
            if part == 0:
                q = _norm_rope(y, wq_ptr, ds, dm, c, s, Dh, eps, BT, BLOCK_D, YDT, W_HALF)
                dq = (
                    oq_ptr
                    + b.to(tl.int64) * sq_b
                    + hd * sq_h
                    + seq[:, None].to(tl.int64) * sq_s
                    + ds[None, :]
                )
                tl.store(dq, _cast(q, QDT), mask=m2)
            elif part == 1:
                k = _norm_rope(y, wk_ptr, ds, dm, c, s, Dh, eps, BT, BLOCK_D, YDT, W_HALF)
                dk = (
                    ok_ptr
                    + b.to(tl.int64) * sk_b
                    + hd * sk_h
                    + seq[:, None].to(tl.int64) * sk_s
                    + ds[None, :]
                )
                tl.store(dk, _cast(k, KDT), mask=m2)
            else:
                dv = (
                    ov_ptr
                    + b.to(tl.int64) * sv_b
                    + hd * sv_h
                    + seq[:, None].to(tl.int64) * sv_s
                    + ds[None, :]
                )
                tl.store(dv, _cast(y, VDT), mask=m2)


def qk_norm_rope_rows_ref(
    qkv: torch.Tensor,
    h: torch.Tensor,
    up: torch.Tensor,
    idx: torch.Tensor,
    ranges: torch.Tensor | None,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_q: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    offset: int = 0,
    eps: float = EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused pair: qkv + each row's h · upᵀ (the expand's torch form, one rounding to the factors'
    dtype; `ranges` only says where up is zero, so the sum is the same without it), then `qk_norm_rope_ref`."""
    y = _expand_torch(h, up, idx, qkv.clone())
    return qk_norm_rope_ref(y.to(qkv.dtype), wq, wk, cos, sin, out_q, out_k, out_v, offset, eps)


def _supported(qkv, h, up, idx, ranges, wq, wk, cos, sin, out_q, out_k, out_v, offset) -> bool:
    if qkv.dim() != 3 or h.dim() != 3 or up.dim() != 3 or idx.dim() != 2:
        return False
    B, L, N = qkv.shape
    H, Dh = out_q.shape[1], out_q.shape[3]
    n, _, R = up.shape
    outs = (out_q, out_k, out_v)
    return (
        qkv.dtype in FLOAT_DTYPES
        and qkv.dtype == h.dtype == up.dtype
        and N == 3 * H * Dh
        and Dh % 2 == 0
        and Dh <= 256
        and up.shape[1] == N
        and up.is_contiguous()
        and h.shape[:2] == (B, L)
        and h.shape[2] == idx.shape[1] * R
        and qkv.stride(-1) == 1
        and h.stride(-1) == 1
        and idx.shape[0] == B
        and idx.dtype == torch.long
        and (
            ranges is None
            or (ranges.shape == (n, 3, 2) and ranges.dtype == torch.int32 and ranges.is_contiguous())
        )
        and all(
            o.dim() == 4
            and o.shape[0] == B
            and o.shape[1] == H
            and o.shape[3] == Dh
            and o.shape[2] >= offset + L
            and o.stride(-1) == 1
            and o.dtype in FLOAT_DTYPES
            for o in outs
        )
        and all(w.shape == (Dh,) and w.stride(0) == 1 for w in (wq, wk))
        and wq.dtype == wk.dtype
        and wq.dtype in FLOAT_DTYPES
        and all(
            t.dtype == torch.float32 and t.shape == (L, Dh // 2) and t.stride(-1) == 1 for t in (cos, sin)
        )
    )


def qk_norm_rope_rows(
    qkv: torch.Tensor,
    h: torch.Tensor,
    up: torch.Tensor,
    idx: torch.Tensor,
    ranges: torch.Tensor | None,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_q: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    offset: int = 0,
    eps: float = EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's LoRA update added to `qkv` (B, L, 3*H*Dh), then RMSNorm + RoPE of Q and K, and Q, K, V
    -> out_*[:, :, offset:offset+L] ((B, H, S, Dh) float buffers, last dim contiguous); see the module
    docstring. `qkv` itself is not written. Unsupported layouts and devices run `qk_norm_rope_rows_ref`
    (same result)."""
    args = (qkv, h, up, idx, ranges, wq, wk, cos, sin, out_q, out_k, out_v)
    tensors = [t for t in args if t is not None]
    if not (_supported(*args, offset) and use_triton(*tensors)):
        return qk_norm_rope_rows_ref(*args, offset, eps)
    B, L, _ = qkv.shape
    H, Dh, R, S = out_q.shape[1], out_q.shape[3], up.shape[2], idx.shape[1]
    bt, br, warps = TILE["tokens"], min(TILE["rank"], max(16, triton.next_power_of_2(R))), TILE["warps"]
    w_half = wq.dtype in (torch.float16, torch.bfloat16)
    with _on_device(qkv):
        _qk_norm_rope_rows_kernel[(triton.cdiv(L, bt), H, B)](
            qkv,
            h,
            up,
            idx,
            idx if ranges is None else ranges,  # (an unread pointer without ranges)
            wq,
            wk,
            cos,
            sin,
            out_q,
            out_k,
            out_v,
            L,
            H,
            Dh,
            R,
            offset,
            qkv.stride(0),
            qkv.stride(1),
            h.stride(0),
            h.stride(1),
            up.stride(0),
            up.stride(1),
            idx.stride(0),
            idx.stride(1),
            cos.stride(0),
            sin.stride(0),
            out_q.stride(0),
            out_q.stride(1),
            out_q.stride(2),
            out_k.stride(0),
            out_k.stride(1),
            out_k.stride(2),
            out_v.stride(0),
            out_v.stride(1),
            out_v.stride(2),
            eps,
            S=S,
            BT=bt,
            BR=br,
            BLOCK_D=triton.next_power_of_2(Dh),
            RANGES=ranges is not None,
            IEEE=up.dtype == torch.float32,
            YDT=_tl_dtype(wq.dtype) if w_half else tl.float32,
            W_HALF=w_half,
            QDT=_tl_dtype(out_q.dtype),
            KDT=_tl_dtype(out_k.dtype),
            VDT=_tl_dtype(out_v.dtype),
            num_warps=warps,
        )
    return out_q, out_k, out_v
