"""The FP8 GEMM with each batch row's LoRA update in its epilogue (kernels/fp8_lora_gemm.py).

Against its dequantised fp32 reference on odd shapes: rows past M (the padded e4m3 buffer) never written,
tiles that straddle two batch rows, two slots per row, the zero slot, column blocks with their own rank
ranges, fp32 and bf16 outputs written into a poisoned buffer; through `RowLora.fused` it equals the GEMM
followed by `RowLora.add` (the unfused side path) on the e4m3 codes. Its default tile compiles for sm_90a
without register spills (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from qwenfast.kernels import fp8_lora_gemm as F
from qwenfast.kernels import triton_available
from qwenfast.kernels.row_lora import RowLora, RowSelection
from qwenfast.testing.interp import kernel_devices, pinned_triton, run_interpreter_cases

from .conftest import assert_close_finite, interpreter_cases

DEVICES = kernel_devices()
TRITON = triton_available()
PINNED_TRITON = pinned_triton()
# (BM, BN, BK, warps, stages, GROUP_M, BR, P, SUB): many tiles on small shapes, one program a tile; and
# the persistent launch (P programs per SM, 4 "SMs" in the interpreter, each walking many tiles), stores
# halved
SMALL = (16, 32, 32, 4, 2, 2, 16, 0, 0)
PERSISTENT = (16, 32, 32, 4, 2, 2, 16, 1, 1)
TILES = pytest.mark.parametrize("tile", [SMALL, PERSISTENT], ids=["per-tile", "persistent"])


def _case(g, device, B, T, K, N, n, R, S, pad=5):
    dev = "cuda" if device == "cuda" else "cpu"  # ("interp": CPU tensors)
    M = B * T
    x8 = (torch.randn(M + pad, K, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    sx = torch.rand(M + pad, 1, generator=g) * 0.02 + 1e-3
    w8 = (torch.randn(N, K, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = torch.rand(N, 1, generator=g) * 0.02 + 1e-3
    bias = torch.randn(N, generator=g)
    h = torch.randn(B, T, S * R, generator=g)
    up = torch.randn(n, N, R, generator=g) * 0.5
    up[0] = 0
    idx = torch.randint(1, n, (B, S), generator=g)
    idx[1, :] = 0  # row 1: no LoRA
    if S > 1:
        idx[0, S - 1] = 0  # row 0: one slot of S
    return [t.to(dev) for t in (x8, sx, w8, sw, bias, h, up, idx)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "B,T,K,N,n,R,S", [(3, 37, 64, 80, 4, 16, 2), (2, 16, 96, 48, 3, 24, 1), (5, 7, 64, 48, 3, 16, 1)]
)
@TILES
def test_fp8_lora_gemm_equals_its_reference(device, dtype, tol, B, T, K, N, n, R, S, tile, monkeypatch):
    monkeypatch.setitem(F.FUSED_GEMM, "gemm", tile)
    g = torch.Generator().manual_seed(B * 7 + K)
    x8, sx, w8, sw, bias, h, up, idx = _case(g, device, B, T, K, N, n, R, S)
    M = B * T
    h, up = h.to(dtype), up.to(dtype)
    for lora, b in (
        (None, bias),
        ((h, up, idx, None), None),
        ((h, up, idx, None), bias),
    ):  # (the last: below)
        want = F.fp8_lora_gemm_ref(x8, sx, w8, sw, None if b is None else b.to(dtype), M, lora, dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype, device=x8.device)  # poisoned: every value written
        got = F.fp8_lora_gemm(x8, sx, w8, sw, None if b is None else b.to(dtype), M, lora, dtype, out=out)
        ref = want.float().abs().max()
        assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    base = F.fp8_lora_gemm_ref(x8, sx, w8, sw, bias.to(dtype), M, None, dtype).float()
    moved = (want.float() - base).abs().max() / ref
    assert moved > 10 * tol  # the update is far above the tolerance
    assert_close_finite(got[T : 2 * T].float() / ref, base[T : 2 * T] / ref, rtol=0, atol=tol)  # row 1: none


@pytest.mark.parametrize("device", DEVICES)
@TILES
def test_column_blocks_walk_their_own_ranks(device, tile, monkeypatch):
    """With `ranges` (n, G, 2) each column block adds only its [lo, hi) of the rank; factors outside the
    ranges are poisoned with huge values, so a tile reading them would show it."""
    monkeypatch.setitem(F.FUSED_GEMM, "gemm", tile)
    g = torch.Generator().manual_seed(3)
    B, T, K, N, n, R, S, G = 3, 21, 64, 96, 4, 48, 2, 3  # three blocks of 32 columns, a third of R each
    x8, sx, w8, sw, bias, h, up, idx = _case(g, device, B, T, K, N, n, R, S)
    rr = torch.tensor([[(i * 16, (i + 1) * 16) for i in range(G)]] * n, dtype=torch.int32, device=x8.device)
    clean = up.clone()
    for i in range(G):  # zero outside each block's range for the reference; poison for the kernel
        mask = torch.ones(R, dtype=torch.bool, device=x8.device)
        mask[i * 16 : (i + 1) * 16] = False
        clean[:, i * 32 : (i + 1) * 32, mask] = 0
        up[:, i * 32 : (i + 1) * 32, mask] = 1e6
    up[0], clean[0] = 1e6, 0  # the zero slot is never read either
    M = B * T
    want = F.fp8_lora_gemm_ref(x8, sx, w8, sw, bias, M, (h, clean, idx, None), torch.float32)
    got = F.fp8_lora_gemm(x8, sx, w8, sw, bias, M, (h, up, idx, rr), torch.float32)
    ref = want.abs().max()
    assert_close_finite(got / ref, want / ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_row_lora_fused_equals_gemm_then_add(device, monkeypatch):
    """`RowLora.fused` (the shrink on the e4m3 codes, then the epilogue) against the FP8 GEMM's reference
    followed by `RowLora.add` on the same codes (the unfused gathered side path), three rows with
    different adapters and strengths, eagerly (`FUSED_GEMM["on"]` 2, the default); with 1 (captured forwards
    only) or one adapter set for all rows, eagerly: None."""
    monkeypatch.setitem(F.FUSED_GEMM, "gemm", SMALL)
    g = torch.Generator().manual_seed(5)
    B, T, K, N, n, R = 3, 19, 64, 48, 4, 16
    x8, sx, w8, sw, bias, *_ = _case(g, device, B, T, K, N, n, R, 1, pad=0)
    down = (torch.randn(n, R, K, generator=g) * 0.2).bfloat16().to(x8.device)
    up = (torch.randn(n, N, R, generator=g) * 0.5).bfloat16().to(x8.device)
    down[0], up[0] = 0, 0
    sel = RowSelection(width=2)
    lora = RowLora(down, up, sel, ranks=[R] * n)
    M = B * T
    sel.set([[(1, 0.8)], [], [(2, 1.0), (3, -0.5)]], x8.device)
    assert F.FUSED_GEMM["on"] == 2  # the default: eagerly too
    monkeypatch.setitem(F.FUSED_GEMM, "on", 1)
    assert lora.fused(x8, sx) is None  # 1: only in a forward being captured
    monkeypatch.setitem(F.FUSED_GEMM, "on", 2)
    got = F.fp8_lora_gemm(x8, sx, w8, sw, bias.bfloat16(), M, lora.fused(x8, sx), torch.bfloat16)
    base = F.fp8_lora_gemm_ref(x8, sx, w8, sw, bias.bfloat16(), M, None, torch.bfloat16)
    want = lora.add(x8, base.clone(), sx)
    ref = want.float().abs().max()
    assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=1e-2)
    assert (want.float() - base.float()).abs().max() / ref > 10 * 1e-2  # the LoRAs move it far beyond that
    sel.set([[(1, 0.8)]] * B, x8.device)  # one set for every row: eager keeps its GEMM pair
    assert lora.fused(x8, sx) is None


@pytest.mark.skipif(not TRITON, reason="needs CUDA and triton")  # (CI has triton: its interpreter runs)
@pytest.mark.skipif(TRITON and not PINNED_TRITON, reason="Triton older than the test extra's 3.7.1")
@pytest.mark.parametrize("S,ranges", [(1, False), (2, True)])
def test_default_tile_does_not_spill(S, ranges):
    from qwenfast.testing.ptxas import spills

    bm, bn, bk, w, st, gm, br, per_sm, sub = F.FUSED_GEMM["gemm"]
    sig = {
        "x_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>",
        "w_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
        "y_desc": f"tensordesc<bf16[{bm}, {bn // 2 if sub else bn}]>",
        **{p: "*fp32" for p in ("sx_ptr", "sw_ptr")},
        **{p: "*bf16" for p in ("b_ptr", "h_ptr", "u_ptr")},
        "idx_ptr": "*i64",
        "rr_ptr": "*i32",
        **{p: "i32" for p in ("M", "N", "K", "T", "R", "G", "NG", "s_hb", "s_ht", "s_un", "s_uo", "s_ib", "s_is")},
        **{c: "constexpr" for c in ("S", "LORA", "RANGES", "BIAS", "BM", "BN", "BK", "BR", "GROUP_M", "FP8_DOT", "IEEE",
                                    "SUB")},
    }  # fmt: skip
    cx = dict(S=S, LORA=True, RANGES=ranges, BIAS=True, BM=bm, BN=bn, BK=bk, BR=br, GROUP_M=gm, FP8_DOT=True,
              IEEE=False, SUB=sub > 0)  # fmt: skip
    got = spills(F._kernel, sig, cx, w, st)
    assert got["stores"] == got["loads"] == 0, got


@pytest.mark.skipif(TRITON and not PINNED_TRITON, reason="Triton older than the test extra's 3.7.1")
def test_interpreter_subprocess(request):
    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)
