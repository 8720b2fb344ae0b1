"""Copy token rows (a range of heads of each) from a [B, T, H, D] view into several destinations at
once, each named by a table entry (pointer, strides, offsets): the data movement of a Ulysses
exchange over peer memory, one launch per direction.

Why a kernel: a Ulysses exchange over NVLink-mapped peer buffers (runtime/ulysses_peer.py) writes,
per layer, each rank's Q/K/V rows for head group j straight into rank j's attention buffer, and
each attention output row back to the rank that owns the token. As `copy_` calls that is one launch
per (destination, tensor) - 9 for Q/K/V at 2 ranks, 13 at 3 - and `copy_` of a non-contiguous view
runs TensorIterator's element-wise path (2-byte loads and stores per thread, across NVLink). Here
every program moves one token's [heads, D] tile of 1-3 tensors with wide vector accesses, and one
launch serves every destination.

Table entry e (int64 row): [dst_ptr, dst_sc, dst_sb, dst_st, dst_h0, src_t0, src_h0, dst_t0, count]:
for b < B and t < count, for each source c < NC and head i < NH:
    dst[c*dst_sc + b*dst_sb + (dst_t0 + t)*dst_st + (dst_h0 + i)*D + d]
        = src_c[b, src_t0 + t, src_h0 + i, d]
`dst_ptr` is a raw address (a peer buffer mapped into this process; any tensor's data_ptr()), all
strides and offsets are in elements; the destination's D is contiguous.
"""

from __future__ import annotations

import torch

from . import _on_device, _tl_dtype, triton_available, use_triton

__all__ = ["head_scatter", "head_scatter_ref", "FIELDS", "entry"]

FIELDS = ("dst_ptr", "dst_sc", "dst_sb", "dst_st", "dst_h0", "src_t0", "src_h0", "dst_t0", "count")


def entry(
    dst: torch.Tensor, *, src_t0: int, src_h0: int, dst_t0: int, count: int, dst_h0: int = 0
) -> list[int]:
    """The table row for destination `dst`, a (NC, B, T, H, D) view (NC = 1 or 3) of any memory."""
    sc, sb, st, sh, sd = dst.stride()
    if sd != 1 or sh != dst.shape[4]:
        raise ValueError(
            f"destination heads must be contiguous (stride D, D contiguous), got strides {dst.stride()}"
        )
    return [dst.data_ptr(), sc, sb, st, dst_h0, src_t0, src_h0, dst_t0, count]


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _head_scatter_kernel(
        s0,
        s1,
        s2,
        table,
        ss_b,
        ss_t,
        ss_h,
        NH,
        D,
        E,
        NC: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = pid // E  # the E entries of one token are neighbouring programs: every SM mixes local and
        row = table + (pid % E).to(tl.int64) * 9  # remote (NVLink) writes, not one phase after the other
        count = tl.load(row + 8)
        if t < count:
            b = tl.program_id(2).to(tl.int64)
            dst = tl.load(row).to(tl.pointer_type(DT))
            dst = tl.multiple_of(dst, 16)
            d_sc, d_sb, d_st = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
            d_h0, s_t0, s_h0, d_t0 = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
            hs = tl.arange(0, BLOCK_H)
            ds = tl.arange(0, BLOCK_D)
            m = (hs < NH)[:, None] & (ds < D)[None, :]
            src_off = b * ss_b + (s_t0 + t) * ss_t + (s_h0 + hs)[:, None] * ss_h + ds[None, :]
            dst_off = b * d_sb + (d_t0 + t) * d_st + (d_h0 + hs)[:, None] * D + ds[None, :]
            tl.store(dst + dst_off, tl.load(s0 + src_off, mask=m), mask=m)
            if NC == 3:
                tl.store(dst + d_sc + dst_off, tl.load(s1 + src_off, mask=m), mask=m)
                tl.store(dst + 2 * d_sc + dst_off, tl.load(s2 + src_off, mask=m), mask=m)


def head_scatter_ref(
    srcs: list[torch.Tensor], table: list[list[int]], dsts: list[torch.Tensor], NH: int
) -> None:
    """Plain torch: `dsts[e]` is entry e's destination as a (NC, B, T, H, D) tensor (the same memory
    as its `dst_ptr`); srcs are (B, T, H, D) views."""
    for row, dst in zip(table, dsts):
        _, _, _, _, dh0, st0, sh0, dt0, n = row
        for c, src in enumerate(srcs):
            dst[c, :, dt0 : dt0 + n, dh0 : dh0 + NH].copy_(src[:, st0 : st0 + n, sh0 : sh0 + NH])


def head_scatter(
    srcs: list[torch.Tensor],
    table: torch.Tensor,
    rows: list[list[int]],
    dsts: list[torch.Tensor],
    NH: int,
    max_count: int,
) -> None:
    """srcs: 1 or 3 (B, T, H, D) views with equal strides and D contiguous (e.g. q, k, v);
    table: the int64 (E, 9) device tensor of `rows` (kept alive by the caller: a captured CUDA graph
    reads it); dsts: each row's destination as a tensor (for the torch path); max_count: max(count)."""
    if len(srcs) not in (1, 3) or any(
        s.stride() != srcs[0].stride() or s.shape != srcs[0].shape for s in srcs
    ):
        raise ValueError("head_scatter takes 1 or 3 sources of one shape and one layout")
    B, _, _, D = srcs[0].shape
    dt = _tl_dtype(srcs[0].dtype) if triton_available() else None
    if (
        dt is None
        or srcs[0].stride(3) != 1
        or not use_triton(*srcs, table)
        or any(d.dtype != srcs[0].dtype for d in dsts)
    ):
        return head_scatter_ref(srcs, rows, dsts, NH)
    s = srcs * 3 if len(srcs) == 1 else srcs
    bh, bd = triton.next_power_of_2(NH), triton.next_power_of_2(D)
    with _on_device(srcs[0]):
        _head_scatter_kernel[(max_count * len(rows), 1, B)](
            s[0],
            s[1],
            s[2],
            table,
            srcs[0].stride(0),
            srcs[0].stride(1),
            srcs[0].stride(2),
            NH,
            D,
            len(rows),
            NC=len(srcs),
            BLOCK_H=bh,
            BLOCK_D=bd,
            DT=dt,
            num_warps=4 if bh * bd >= 1024 else 1,
        )
