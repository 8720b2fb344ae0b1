"""Q/K RMSNorm + RoPE + scatter into the joint attention buffers, one pass over the QKV projection.

The attention of a block takes the fused projection of each stream, (B, L, 3*H*Dh) = Q|K|V with
heads contiguous, and in eager torch runs, per stream: RMSNorm of Q and of K (float upcast, pow,
mean, rsqrt-multiply, cast, gain: ~6 kernels with fp32 intermediates), `apply_rope` on Q and K
(upcast, six elementwise ops on fp32 halves, stack, cast: ~10 kernels), then `torch.cat([txt, img])`
of Q, K and V into the joint sequence.

Why fuse (memory traffic): at L = 4096 image tokens, H*Dh = 3072, bf16 (25 MB per Q, K or V; 50 MB
as fp32) Q and K each cross memory roughly 1.2 GB in that chain and the cats move another 150 MB:
~2.5 GB per stream. The fused kernel reads the QKV row once and writes Q, K, V once (150 MB),
straight into preallocated (B, H, S, Dh) buffers at sequence positions [offset, offset + L): the
text stream (offset 0) and the image stream (offset L_txt) fill one joint buffer, no `torch.cat`.
Measured on H200 (triton 3.6, bf16, image stream above): 44 us vs 1046 us eager (24x).

Numerics reproduce `transformer.RMSNorm` + `apply_rope` op for op: `x * rsqrt(mean(x^2) + eps)` in
fp32, rounded to the weight dtype (when it is fp16/bf16), times the weight rounded again, then
the rotation of interleaved pairs (x[2i], x[2i+1]) in fp32 with the fp32 cos/sin tables, rounded
to that dtype, and finally cast to the output buffer's dtype (H200, bf16: 99.998% of Q/K bit for
bit with the reference, the rest one ulp; V is a copy).

Layout: one program per token handles all H heads of Q, K and V ([H, Dh] tiles). The output
buffers may be any (B, H, S, Dh) strided views with a contiguous last dim: a contiguous
(B, H, S, Dh) tensor, or `torch.empty(B, S, H, Dh).transpose(1, 2)` (the layout the model's
`cat(...).transpose(1, 2)` produced, where each token's write is one contiguous H*Dh run).

FP8 outputs (the 8-bit attention backend): `out_q` / `out_k` may be e4m3 buffers, given their fp32
descale (a one-element device tensor): the kernel then writes e4m3(clamp(y / descale, ±448)) of the
value it would have stored, so Q and K never exist in bf16. The descale needs no pass over the data:
RMSNorm bounds every element of a normalised head vector by sqrt(Dh) (its squares sum to Dh), the
gain by max|w|, and RoPE rotates pairs (a pair's norm, so each element, keeps that bound), so
`qk_descale(gains, Dh)` = max|w| * sqrt(Dh) * 1.02 / 448 can never overflow (1.02: the three half
roundings). e4m3 is a float format, so the fixed scale costs nothing in relative precision for any
element within 2^15 of the bound (the amax scale would differ only in where that window sits).
"""

from __future__ import annotations

import torch

from . import FLOAT_DTYPES, _num_warps, _on_device, _tl_dtype, triton_available, use_triton
from .fp8_rows import FP8, codes_ref

__all__ = [
    "qk_norm_rope",
    "qk_norm_rope_groups",
    "group_row",
    "qk_norm_rope_ref",
    "rms_norm_ref",
    "apply_rope_ref",
    "qk_descale",
    "joint_qkv",
]

EPS = 1e-6
QK_MARGIN = 1.02  # the bound's slack for the half-precision roundings between the norm and the store


def qk_descale(gains: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """fp32 (1,) descale for e4m3 Q or K written by this kernel with RMSNorm gains `gains` (a joint
    buffer's streams): max|w| * sqrt(head_dim) * QK_MARGIN / 448, never below 1e-12. On the gains'
    device, no host sync (CUDA-graph safe)."""
    amax = torch.stack([w.detach().abs().amax().float() for w in gains]).amax()
    return (amax * (head_dim**0.5 * QK_MARGIN / 448.0)).clamp_min(1e-12).reshape(1)


if triton_available():
    import triton
    import triton.language as tl

    from .adaln import _cast, _round
    from .fp8_rows import _codes

    @triton.jit
    def _norm_rope(
        x,
        w_ptr,
        ds,
        dmask,
        c,
        s,
        Dh,
        eps,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        YDT: tl.constexpr,
        W_HALF: tl.constexpr,
    ):
        """RMSNorm over the last dim of an fp32 [BLOCK_H, BLOCK_D] tile, then RoPE by the angles' cos / sin
        (fp32, broadcastable to [BLOCK_H, BLOCK_D // 2]: one token's for a tile of heads); fp32 out."""
        ms = tl.sum(x * x, axis=1) / Dh
        y = x * tl.rsqrt(ms + eps)[:, None]
        w = tl.load(w_ptr + ds, mask=dmask, other=0.0).to(tl.float32)
        if W_HALF:  # RMSNorm casts to the (half) weight dtype before the gain; the product is half too
            y = _round(_round(y, YDT) * w[None, :], YDT)
        else:
            y = y * w[None, :]
        ye, yo = tl.split(tl.reshape(y, [BLOCK_H, BLOCK_D // 2, 2]))
        oe = ye * c - yo * s
        oo = ye * s + yo * c
        return _round(tl.reshape(tl.join(oe, oo), [BLOCK_H, BLOCK_D]), YDT)  # apply_rope's type_as

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,
        wq_ptr,
        wk_ptr,
        cos_ptr,
        sin_ptr,
        oq_ptr,
        ok_ptr,
        ov_ptr,
        table_ptr,
        dq_ptr,
        dk_ptr,
        L,
        H,
        Dh,
        offset,
        h0,
        HQ,
        NG,
        s_b,
        s_l,
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
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        YDT: tl.constexpr,
        W_HALF: tl.constexpr,
        QDT: tl.constexpr,
        KDT: tl.constexpr,
        VDT: tl.constexpr,
        TABLE: tl.constexpr,
        Q8: tl.constexpr,
        K8: tl.constexpr,
        HAS_V: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row = pid // NG  # token; the NG head groups of one token are neighbouring programs, so every
        if TABLE:  # SM mixes local and remote (NVLink) writes instead of one phase after the other
            rt = table_ptr + (pid % NG) * 4  # the group's q, k, v addresses and first head
            oq_ptr = tl.load(rt).to(tl.pointer_type(QDT))
            ok_ptr = tl.load(rt + 1).to(tl.pointer_type(QDT))
            ov_ptr = tl.load(rt + 2).to(tl.pointer_type(QDT))
            h0 = tl.load(rt + 3)
        b = row // L
        tok = row % L
        seq = tok + offset
        hs = tl.arange(0, BLOCK_H)
        ds = tl.arange(0, BLOCK_D)
        dmask = ds < Dh
        m2 = (hs < H)[:, None] & dmask[None, :]
        src = qkv_ptr + b * s_b + tok * s_l + (h0 + hs)[:, None] * Dh + ds[None, :]  # heads h0.. of HQ
        half = tl.arange(0, BLOCK_D // 2)
        hmask = half < Dh // 2
        c = tl.load(cos_ptr + tok * s_cos + half, mask=hmask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok * s_sin + half, mask=hmask, other=0.0).to(tl.float32)

        q = tl.load(src, mask=m2, other=0.0).to(tl.float32)
        c, s = c[None, :], s[None, :]  # one token: the same angles for every head
        q = _norm_rope(q, wq_ptr, ds, dmask, c, s, Dh, eps, BLOCK_H, BLOCK_D, YDT, W_HALF)
        dq = oq_ptr + b * sq_b + hs[:, None] * sq_h + seq * sq_s + ds[None, :]
        if Q8:  # e4m3 at the bound's descale (no amax pass: see the module docstring)
            tl.store(dq, _codes(q, tl.load(dq_ptr)), mask=m2)
        else:
            tl.store(dq, _cast(q, QDT), mask=m2)

        k = tl.load(src + HQ * Dh, mask=m2, other=0.0).to(tl.float32)
        k = _norm_rope(k, wk_ptr, ds, dmask, c, s, Dh, eps, BLOCK_H, BLOCK_D, YDT, W_HALF)
        dk = ok_ptr + b * sk_b + hs[:, None] * sk_h + seq * sk_s + ds[None, :]
        if K8:
            tl.store(dk, _codes(k, tl.load(dk_ptr)), mask=m2)
        else:
            tl.store(dk, _cast(k, KDT), mask=m2)

        if HAS_V:  # (else the projection wrote V into its buffer itself)
            v = tl.load(src + 2 * HQ * Dh, mask=m2, other=0.0).to(tl.float32)  # exact
            dv = ov_ptr + b * sv_b + hs[:, None] * sv_h + seq * sv_s + ds[None, :]
            tl.store(dv, _cast(v, VDT), mask=m2)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """`transformer.RMSNorm.forward`: fp32 statistics, cast to a half weight dtype before the gain."""
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`models.rope.apply_rope`: rotate pairs (x[2i], x[2i+1]) of x (B, S, H, D) by cos/sin (S, D/2)."""
    xf = x.float().unflatten(-1, (-1, 2))
    xe, xo = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([xe * c - xo * s, xe * s + xo * c], dim=-1)
    return out.flatten(-2).type_as(x)


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_q: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor | None,
    offset: int = 0,
    eps: float = EPS,
    head0: int = 0,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain torch: norm_q/norm_k + apply_rope of heads head0.. (as many as out_q has), then copy
    into out_*[:, :, offset:offset+L] (e4m3 out_q / out_k: the codes at descale_q / descale_k).
    out_v None: qkv is Q|K only (its V went elsewhere)."""
    B, L, _ = qkv.shape
    H, Dh = out_q.shape[1], out_q.shape[3]
    parts = 2 if out_v is None else 3
    HQ = qkv.shape[-1] // (parts * Dh)
    qkv = (x[:, :, head0 : head0 + H] for x in qkv.unflatten(-1, (parts, HQ, Dh)).unbind(2))  # (B, L, H, Dh)
    q, k, v = (*qkv, None)[:3]
    q = apply_rope_ref(rms_norm_ref(q, wq, eps), cos, sin)
    k = apply_rope_ref(rms_norm_ref(k, wk, eps), cos, sin)
    for dst, src, d in ((out_q, q, descale_q), (out_k, k, descale_k), (out_v, v, None)):
        if dst is None:
            continue
        if dst.dtype == FP8:
            if d is None:
                raise ValueError("an e4m3 output buffer needs its descale (qk_descale)")
            src = codes_ref(src, d.float().reshape(()))  # the codes the kernel stores
        dst[:, :, offset : offset + L].copy_(src.transpose(1, 2))
    return out_q, out_k, out_v


def _fp8_ok(o: torch.Tensor, d: torch.Tensor | None) -> bool:
    """An output buffer's dtype the kernel writes: a float type, or e4m3 with its fp32 descale."""
    if o.dtype != FP8:
        return o.dtype in FLOAT_DTYPES
    return d is not None and d.dtype == torch.float32 and d.numel() == 1 and d.device == o.device


def _supported(qkv, wq, wk, cos, sin, out_q, out_k, out_v, offset, head0=0, dq=None, dk=None) -> bool:
    if qkv.dim() != 3 or qkv.dtype not in FLOAT_DTYPES or qkv.stride(-1) != 1 or qkv.numel() == 0:
        return False
    B, L, _ = qkv.shape
    outs = [o for o in (out_q, out_k, out_v) if o is not None]
    if any(o.dim() != 4 for o in outs):
        return False
    H, Dh, parts = out_q.shape[1], out_q.shape[3], len(outs)
    return (
        Dh % 2 == 0
        and qkv.shape[-1] % (parts * Dh) == 0
        and 0 <= head0
        and head0 + H <= qkv.shape[-1] // (parts * Dh)
        and H * Dh <= 65536
        and 0 <= offset
        and all(
            o.shape[0] == B
            and o.shape[1] == H
            and o.shape[3] == Dh
            and o.shape[2] >= offset + L
            and o.stride(-1) == 1
            for o in outs
        )
        and _fp8_ok(out_q, dq)
        and _fp8_ok(out_k, dk)
        and (out_v is None or out_v.dtype in FLOAT_DTYPES)
        and all(w.shape == (Dh,) and w.stride(0) == 1 for w in (wq, wk))
        and wq.dtype == wk.dtype
        and wq.dtype in FLOAT_DTYPES
        and all(
            t.dtype == torch.float32 and t.shape == (L, Dh // 2) and t.stride(-1) == 1 for t in (cos, sin)
        )
    )


def qk_norm_rope(
    qkv: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_q: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor | None,
    offset: int = 0,
    eps: float = EPS,
    head0: int = 0,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm(q; wq), RMSNorm(k; wk), RoPE on both, and q, k, v -> out_*[:, :, offset:offset+L].

    qkv: (B, L, 3*HQ*Dh) fused projection (Q|K|V, heads contiguous), last dim contiguous; or
    (B, L, 2*HQ*Dh) = Q|K with out_v None, when the V projection wrote its buffer itself (a GEMM
    can write the token-major V rows in place; Q and K must pass through the norm anyway): the
    kernel then moves 2/3 of the bytes.
    head0: the first of the H = out_q.shape[1] heads to take (HQ >= head0 + H): a sequence-parallel
    exchange writes each rank's head group straight into that rank's buffer, one call per group.
    wq, wk: (Dh,) RMSNorm gains. cos, sin: (L, Dh/2) fp32 tables of this stream.
    out_q, out_k, out_v: (B, H, S, Dh) buffers (S >= offset + L), last dim contiguous; only
    positions [offset, offset + L) are written. Returns (out_q, out_k, out_v).
    descale_q / descale_k: fp32 (1,) descales, required where out_q / out_k is e4m3 (`qk_descale`).
    Unsupported layouts/devices run `qk_norm_rope_ref` (same result, no error).
    """
    args = (qkv, wq, wk, cos, sin, out_q, out_k, out_v)
    if not (
        _supported(*args, offset, head0, descale_q, descale_k)
        and use_triton(*(t for t in args if t is not None))
    ):
        return qk_norm_rope_ref(*args, offset, eps, head0, descale_q, descale_k)
    _launch(qkv, wq, wk, cos, sin, out_q, out_k, out_v, offset, eps, head0=head0, dq=descale_q, dk=descale_k)
    return out_q, out_k, out_v


def joint_qkv(
    streams: list[tuple],
    heads: int,
    head_dim: int,
    qk_dtype: torch.dtype | None = None,
    descale_qk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The joint Q, K, V (B, H, S, D), views of fresh (B, S, H, D) buffers, each stream written at its
    offset by `qk_norm_rope`; streams: (qkv, q gain, k gain, cos, sin) each, in sequence order, as
    `runtime.attention.joint_attention` takes them. qk_dtype: Q's and K's (default the projections'
    dtype; e4m3 with `descale_qk`, fp32 (2,) = their descales); V keeps the projections' dtype."""
    qkv0 = streams[0][0]
    B, S, dev = qkv0.shape[0], sum(st[0].shape[1] for st in streams), qkv0.device
    q, k = (
        torch.empty(B, S, heads, head_dim, dtype=qk_dtype or qkv0.dtype, device=dev).transpose(1, 2)
        for _ in range(2)
    )
    v = torch.empty(B, S, heads, head_dim, dtype=qkv0.dtype, device=dev).transpose(1, 2)
    dq, dk = (None, None) if descale_qk is None else (descale_qk[0:1], descale_qk[1:2])
    offset = 0
    for qkv, wq, wk, cos, sin in streams:
        qk_norm_rope(qkv, wq, wk, cos, sin, q, k, v, offset=offset, descale_q=dq, descale_k=dk)
        offset += qkv.shape[1]
    return q, k, v


def group_row(out_q: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor, head0: int) -> list[int]:
    """One row of `qk_norm_rope_groups`' table: the group's q, k, v addresses and first head."""
    return [out_q.data_ptr(), out_k.data_ptr(), out_v.data_ptr(), head0]


def qk_norm_rope_groups(
    qkv: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    table: torch.Tensor,
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    offset: int = 0,
    eps: float = EPS,
) -> None:
    """`qk_norm_rope(..., head0=h0)` into every group (out_q, out_k, out_v, h0) of `groups` in one
    launch: e.g. each Ulysses rank's head group straight into that rank's buffers, the remote writes
    of one group overlapping the others' work. `table`: the int64 (G, 4) device tensor of
    `group_row(*group)` per group (kept alive by the caller: a captured CUDA graph reads it). The
    groups' buffers share one shape, dtype and layout. Unsupported cases: one call per group."""
    q0, k0, v0, _ = groups[0]
    same = all(
        q.shape == q0.shape
        and q.stride() == q0.stride()
        and k.stride() == k0.stride()
        and v.stride() == v0.stride()
        and q.dtype == k.dtype == v.dtype == q0.dtype
        for q, k, v, _ in groups
    )
    args = (qkv, wq, wk, cos, sin, q0, k0, v0)
    if not (
        same
        and all(_supported(*args[:5], q, k, v, offset, h) for q, k, v, h in groups)
        and use_triton(*args, table)
    ):
        for q, k, v, h in groups:
            qk_norm_rope(qkv, wq, wk, cos, sin, q, k, v, offset=offset, eps=eps, head0=h)
        return
    _launch(qkv, wq, wk, cos, sin, q0, k0, v0, offset, eps, table=table, groups=len(groups))


def _launch(
    qkv,
    wq,
    wk,
    cos,
    sin,
    out_q,
    out_k,
    out_v,
    offset: int,
    eps: float,
    head0: int = 0,
    table: torch.Tensor | None = None,
    groups: int = 1,
    dq=None,
    dk=None,
) -> None:
    """The kernel over B*L tokens (x `groups` head groups from `table`, else into out_* from head0)."""
    B, L, _ = qkv.shape
    H, Dh = out_q.shape[1], out_q.shape[3]
    w_half = wq.dtype in (torch.float16, torch.bfloat16)
    # the tile of all HQ heads even when writing a group of H of them: the same thread layout, so the
    # same fp32 reduction order, as the all-heads call (a head group's rows are then bit for bit its)
    parts = 2 if out_v is None else 3
    hq = qkv.shape[-1] // (parts * Dh)
    block_h, block_d = triton.next_power_of_2(hq), triton.next_power_of_2(Dh)
    ov = out_k if out_v is None else out_v  # (an unused pointer and strides when there is no V)
    with _on_device(qkv):
        _qk_norm_rope_kernel[(B * L * groups,)](
            qkv,
            wq,
            wk,
            cos,
            sin,
            out_q,
            out_k,
            ov,
            qkv if table is None else table,
            qkv if dq is None else dq,
            qkv if dk is None else dk,
            L,
            H,
            Dh,
            offset,
            head0,
            hq,
            groups,
            qkv.stride(0),
            qkv.stride(1),
            cos.stride(0),
            sin.stride(0),
            out_q.stride(0),
            out_q.stride(1),
            out_q.stride(2),
            out_k.stride(0),
            out_k.stride(1),
            out_k.stride(2),
            ov.stride(0),
            ov.stride(1),
            ov.stride(2),
            eps,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            YDT=_tl_dtype(wq.dtype) if w_half else tl.float32,
            W_HALF=w_half,
            QDT=_tl_dtype(out_q.dtype) or tl.float8e4nv,
            KDT=_tl_dtype(out_k.dtype) or tl.float8e4nv,
            VDT=_tl_dtype(ov.dtype) or tl.float8e4nv,
            TABLE=table is not None,
            Q8=out_q.dtype == FP8,
            K8=out_k.dtype == FP8,
            HAS_V=out_v is not None,
            num_warps=_num_warps(block_h * block_d),
        )
