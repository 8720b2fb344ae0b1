"""Per-row LoRAs (kernels/lora_rows.py, loading/lora_rows.py): each batch row adds its own adapters.

The op against its per-row loop on odd shapes (fp32 and bf16; rows of the zero slot unchanged bit for
bit); its kernels at their default tiles compile for sm_90a without register spills (no GPU needed). On a tiny FP8 transformer (emulated on the CPU, fp32 activations) and on the same model with float
weights: a batch whose rows use different LoRA sets (one, two at other strengths, none) equals each row
run alone with that set loaded for the whole batch (`LoraManager`: the unmerged FP8 path, or fused into
the float weights) within 1e-5, and the LoRAs move the output far more than that; the least recently
used adapter is evicted when the slots are full and read again from the folder; adapters that touch
other modules are refused with a message that says why. Through the pipeline with bf16-style float,
FP8 and INT8 weights.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qwenfast.errors import LoraError
from qwenfast.kernels import triton_available
from qwenfast.kernels.fp8_linear import FP8Linear
from qwenfast.kernels.lora_rows import lora_rows, lora_rows_ref, lora_rows_triton
from qwenfast.kernels.lowbit import LowBitLinear
from qwenfast.kernels.row_lora import RowLoraLinear, plain_linear
from qwenfast.loading.lora_manager import LoraManager
from qwenfast.loading.lora_rows import RowAdapters
from qwenfast.testing.interp import kernel_devices, pinned_triton, run_interpreter_cases

from .conftest import assert_close_finite, interpreter_cases
from .test_fp8_fused import KERNEL_DEVICES as FP8_DEVICES  # (an FP8 GPU: QWENFAST_ARCH=sm_86 has none)

DEVICES = kernel_devices()
TRITON = triton_available()
# The test extra pins Triton 3.7.1 (torch 2.13's): its interpreter runs these kernels and its ptxas is the one
# the spill counts were taken with. An older Triton (3.6 with torch 2.11 on the GPU machines) compiles and
# runs them on CUDA, but its interpreter fails on them and its ptxas spills 16 B per thread in the expand.
PINNED_TRITON = pinned_triton()

TOL = 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "B,L,K,N,n,R,S", [(3, 7, 19, 23, 4, 5, 2), (1, 1, 8, 8, 2, 16, 1), (5, 33, 40, 17, 6, 3, 3)]
)
def test_lora_rows_equals_the_row_loop(dtype, tol, B, L, K, N, n, R, S):
    g = torch.Generator().manual_seed(B * 100 + K)
    x = torch.randn(B, L, K, generator=g).to(dtype)
    y = torch.randn(B, L, N, generator=g).to(dtype)
    down = torch.randn(n, R, K, generator=g).to(dtype)
    up = torch.randn(n, N, R, generator=g).to(dtype)
    down[0], up[0] = 0, 0  # slot 0: no LoRA
    idx = torch.randint(0, n, (B, S), generator=g)
    idx[0] = 0  # the first row uses none
    scale = torch.rand(B, S, generator=g) * 2 - 0.5
    want = lora_rows_ref(x, y, down, up, idx, scale)
    got = lora_rows(x, y.clone(), down, up, idx, scale)
    ref = want.float().abs().max().clamp_min(1)
    assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    assert torch.equal(got[0], y[0])  # the zero slot adds exact zeros
    from qwenfast.kernels.row_lora import RowLora, RowSelection
    from qwenfast.loading.lora_fp8 import bucket

    sel = RowSelection(S)  # an eager forward: only the columns some row uses, nothing when none does
    lora = RowLora(down, up, sel)
    sel.set([[] for _ in range(B)], "cpu")
    y2 = y.reshape(B * L, N).clone()
    assert lora.add(x.reshape(B * L, K), y2) is y2 and sel.used == 0
    rows = [[(int(j), float(v))] for j, v in zip(idx[:, 0], scale[:, 0])]
    sel.set(rows, "cpu")
    want1 = lora_rows_ref(x, y, down, up, idx[:, :1], scale[:, :1])
    got1 = lora.add(x.reshape(B * L, K), y.reshape(B * L, N).clone()).view(B, L, N)
    assert sel.used == 1 and len(sel.groups) <= B
    assert_close_finite(got1.float() / ref, want1.float() / ref, rtol=0, atol=tol)
    assert [bucket(r) for r in (1, 16, 17, 64, 65, 192, 193)] == [16, 16, 32, 64, 128, 192, 256]
    with pytest.raises(ValueError, match="do not agree"):
        lora_rows(x, y, down[:, :, :-1], up, idx, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "B,L,K,N,n,R,S",
    [(3, 7, 19, 23, 4, 5, 2), (2, 33, 40, 17, 6, 3, 3), (1, 1, 8, 8, 2, 16, 1), (2, 70, 72, 130, 3, 80, 1),
     (2, 9, 520, 24, 3, 24, 2)],
)  # fmt: skip
def test_segmented_kernels_equal_the_row_loop(device, dtype, tol, B, L, K, N, n, R, S, monkeypatch):
    """The Triton shrink/expand pair (`lora_rows_triton`, what `lora_rows` runs on CUDA) against the
    per-row loop: odd shapes, a rank over one expand tile (80) and over several shrink programs (rank
    tiles of 16 here), a strided selection (the eager path's used columns), K over several tiles, K split
    into parts for few rows (520: eight parts of 16-wide tiles when the program target asks for them),
    the low-rank buffer poisoned with NaN (every element
    written), rows of the zero slot untouched bit for bit, and a changed strength moving the output far
    more than the tolerance."""
    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(B * 1000 + K + R)
    x = torch.randn(B, L, K, generator=g).to(dtype).to(dev)
    y = torch.randn(B, L, N, generator=g).to(dtype).to(dev)
    down = (torch.randn(n, R, K, generator=g) / K**0.5).to(dtype).to(dev)
    up = torch.randn(n, N, R, generator=g).to(dtype).to(dev)
    down[0], up[0] = 0, 0  # slot 0: no LoRA
    wide = torch.randint(1, n, (B, S + 1), generator=g)
    if B > 1:
        wide[0] = 0  # the first row uses none
    idx = wide.to(dev)[:, :S]  # strided: (B, S) of a (B, S + 1) buffer
    scale = (torch.rand(B, S + 1, generator=g) * 2 - 0.5).to(dev)[:, :S]
    want = lora_rows_ref(x, y, down, up, idx, scale)
    ref = want.float().abs().max().clamp_min(1)
    import qwenfast.kernels.lora_rows as lora_rows_mod

    monkeypatch.setitem(lora_rows_mod.TILES, "shrink", (64, 16, 4, 2, 16))  # K tiles of 16, rank tiles of 16
    monkeypatch.setitem(lora_rows_mod.TILES, "programs", 10**6)  # split K wherever it is long enough
    assert lora_rows_mod._splits(B * S, K, 16) == (8 if K == 520 else 1)
    h = torch.full((B, L, S * R), float("nan"), device=dev, dtype=dtype)
    got = lora_rows_triton(x, y.clone(), down, up, idx, scale, h=h)
    assert torch.isfinite(h).all()
    assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    if B > 1:
        assert torch.equal(got[0], y[0])  # the zero slot: not touched
    assert torch.equal(
        lora_rows(x, y.clone(), down, up, idx, scale), lora_rows_triton(x, y.clone(), down, up, idx, scale)
    )
    # strengths laid out unlike the selection (contiguous beside a strided idx): still each row's own
    moved = lora_rows_triton(x, y.clone(), down, up, idx, scale * 1.5)
    want2 = lora_rows_ref(x, y, down, up, idx, scale * 1.5)
    ref2 = want2.float().abs().max().clamp_min(1)
    assert_close_finite(moved.float() / ref2, want2.float() / ref2, rtol=0, atol=tol)
    assert (moved.float() - got.float()).abs().max() / ref > 10 * tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("S", [1, 2])
def test_expand_by_column_blocks(device, dtype, tol, S, monkeypatch):
    """A Q|K|V-like stack (`write_side` with 3 pieces): slots whose LoRAs have separate Q, K and V factors
    (each block's up in its own third of the rank) and one with a shared down (every block on all of
    it). With `ranges` (`piece_ranks`) the expand walks each block's own columns only: up poisoned with
    NaN outside them changes nothing, and the result is the row loop's on the clean stack; where a tile
    of y would straddle two blocks the ranges are not used (the clean stack gives the same)."""
    import qwenfast.kernels.lora_rows as lora_rows_mod
    from qwenfast.loading.lora_fp8 import piece_ranks, side_rank, write_side

    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(11 + S)
    B, L, K, N, r, n = 3, 21, 40, 96, 8, 4
    R = 3 * r
    down = torch.zeros(n, R, K, dtype=dtype)
    up = torch.zeros(n, N, R, dtype=dtype)
    ranges = torch.zeros(n, 3, 2, dtype=torch.int32)
    for slot in (1, 2, 3):
        if slot < 3:  # separate Q, K, V factors
            parts = [(p, torch.randn(N // 3, r, generator=g), torch.randn(r, K, generator=g) / K**0.5, 0.7)
                     for p in range(3)]  # fmt: skip
        else:  # one down shared by the three blocks (a LoRA on the fused projection, split in three)
            d = torch.randn(r, K, generator=g) / K**0.5
            parts = [(p, torch.randn(N // 3, r, generator=g), d, 1.0) for p in range(3)]
        write_side(down[slot, : side_rank(parts)], up[slot, :, : side_rank(parts)], parts, 3)
        ranges[slot] = torch.tensor(piece_ranks(parts, 3), dtype=torch.int32)
    assert ranges[1].tolist() == [[0, r], [r, 2 * r], [2 * r, 3 * r]] and ranges[3].tolist() == [[0, r]] * 3
    assert ranges[0].tolist() == [[0, 0]] * 3
    x = torch.randn(B, L, K, generator=g).to(dtype)
    y = torch.randn(B, L, N, generator=g).to(dtype)
    idx = torch.tensor([[1, 3], [0, 0], [2, 1]])[:, :S]
    scale = torch.tensor([[0.9, 0.5], [1.0, 1.0], [1.2, -0.4]])[:, :S]
    want = lora_rows_ref(x, y, down, up, idx, scale)
    ref = want.float().abs().max().clamp_min(1)
    poisoned = up.clone()
    for slot in range(n):
        for p in range(3):
            lo, hi = ranges[slot, p].tolist()
            block = poisoned[slot, p * (N // 3) : (p + 1) * (N // 3)]
            block[:, :lo], block[:, hi:] = float("nan"), float("nan")
    to = lambda *ts: [t.to(dev) for t in ts]  # noqa: E731
    x, y, down, up, poisoned, idx, scale, ranges = to(x, y, down, up, poisoned, idx, scale, ranges)
    monkeypatch.setitem(lora_rows_mod.TILES, "expand", (16, 32, 16, 4, 2))  # tiles of 32 columns: one block
    got = lora_rows_triton(x, y.clone(), down, poisoned, idx, scale, ranges=ranges)
    assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    assert torch.equal(got[1], y[1])  # the zero slot's row: not touched
    monkeypatch.setitem(lora_rows_mod.TILES, "expand", (16, 64, 16, 4, 2))  # 64 columns straddle blocks
    got = lora_rows_triton(x, y.clone(), down, up, idx, scale, ranges=ranges)
    assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    monkeypatch.setitem(lora_rows_mod.TILES, "prefetch", 1)  # y's tile read before the products: the same
    for tile in ((16, 32, 16, 4, 2), (16, 64, 16, 4, 2)):
        monkeypatch.setitem(lora_rows_mod.TILES, "expand", tile)
        got = lora_rows_triton(
            x, y.clone(), down, poisoned if tile[1] == 32 else up, idx, scale, ranges=ranges
        )
        assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
        assert torch.equal(got[1], y[1])
    with pytest.raises(ValueError, match="ranges must be"):
        lora_rows(x, y, down, up, idx, scale, ranges=ranges.long())  # int32 only


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("B,L,K,N,n,R,S", [(3, 7, 19, 23, 4, 5, 2), (2, 70, 80, 130, 3, 80, 1)])
def test_shrink_reads_e4m3_rows(device, dtype, tol, B, L, K, N, n, R, S, monkeypatch):
    """x as the e4m3 codes an FP8 GEMM multiplies plus their row scales (what a fused producer hands an
    FP8 layer): the kernels, the torch pass and `RowLora.add` (gathered and per-group) equal the loop on
    the dequantised input; the scales are applied (a row scale times 8 moves that row far more
    than the tolerance, and only it); rows of the zero slot untouched."""
    import qwenfast.kernels.lora_rows as lora_rows_mod
    from qwenfast.kernels.fp8_rows import quantize_rows_ref
    from qwenfast.kernels.row_lora import RowLora, RowSelection

    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(B * 7 + K)
    x = torch.randn(B * L, K, generator=g) * torch.rand(B * L, 1, generator=g) * 8  # rows of other scales
    x8, xs = quantize_rows_ref(x)  # (B*L, K) e4m3, (B*L, 1) fp32
    x8, xs = x8.view(B, L, K).to(dev), xs.view(B, L).to(dev)
    y = torch.randn(B, L, N, generator=g).to(dtype).to(dev)
    down = (torch.randn(n, R, K, generator=g) / K**0.5).to(dtype).to(dev)
    up = torch.randn(n, N, R, generator=g).to(dtype).to(dev)
    down[0], up[0] = 0, 0
    idx = torch.randint(1, n, (B, S), generator=g)
    idx[0] = 0
    idx = idx.to(dev)
    scale = (torch.rand(B, S, generator=g) + 0.5).to(dev)
    want = lora_rows_ref(x8, y, down, up, idx, scale, xs)
    ref = want.float().abs().max().clamp_min(1)
    monkeypatch.setitem(lora_rows_mod.TILES, "shrink", (64, 16, 4, 2, 16))
    h = torch.full((B, L, S * R), float("nan"), device=dev, dtype=dtype)
    got = lora_rows_triton(x8, y.clone(), down, up, idx, scale, h=h, x_scale=xs)
    assert torch.isfinite(h).all()
    assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    assert torch.equal(got[0], y[0])
    # the shrink through TMA descriptors (`TILES["shrink_tma"]`, bf16 factors, K a multiple of 16) at
    # another tile, and the pointer kernel (None): the same
    for tma in ((16, 32, 4, 2, 32), None) if dtype == torch.bfloat16 and K % 16 == 0 else ():
        monkeypatch.setitem(lora_rows_mod.TILES, "shrink_tma", tma)
        h2 = torch.full_like(h, float("nan"))
        got = lora_rows_triton(x8, y.clone(), down, up, idx, scale, h=h2, x_scale=xs)
        assert torch.isfinite(h2).all() and torch.equal(got[0], y[0])
        assert_close_finite(got.float() / ref, want.float() / ref, rtol=0, atol=tol)
    for fn in (lora_rows, lora_rows_ref):  # the dispatcher, and the loop itself, see the scale
        xs2 = xs.clone()
        xs2[1, 0] *= 8
        moved = (fn(x8, y.clone(), down, up, idx, scale, xs2).float() - want.float()).abs() / ref
        assert moved[1, 0].max() > 10 * tol and moved[1, 1:].max() <= tol and moved[0].max() == 0
    sel = RowSelection(S)  # the eager forward's two ways: one gathered pass, or a GEMM pair per group
    lora = RowLora(down, up, sel)
    for rows in ([[(int(j), float(v)) for j, v in zip(idx[b], scale[b])] for b in range(B)],
                 [[(int(idx[1, 0]), float(scale[1, 0]))]] * B):  # fmt: skip
        sel.set(rows, dev)
        ix = torch.tensor([[j for j, _ in r] + [0] * (S - len(r)) for r in rows], device=dev)
        sc = torch.tensor([[v for _, v in r] + [0.0] * (S - len(r)) for r in rows], device=dev)
        want2 = lora_rows_ref(x8, y, down, up, ix, sc, xs)
        got2 = lora.add(x8.reshape(B * L, K), y.reshape(B * L, N).clone(), xs.reshape(B * L, 1))
        assert_close_finite(got2.view(B, L, N).float() / ref, want2.float() / ref, rtol=0, atol=tol)
    with pytest.raises(ValueError, match="x_scale"):
        lora_rows(x8, y, down, up, idx, scale)


@pytest.mark.parametrize("device", FP8_DEVICES)
@torch.no_grad()
def test_fp8_producers_hand_their_rows_to_per_row_loras(device):
    """With the FP8 producer fusion on (the default), the kernels that quantise an FP8 layer's input keep
    no copy of it for per-row LoRAs: the side path reads the same e4m3 rows the GEMM multiplies. The
    model then equals the unfused one (each layer quantising its input itself, the LoRA reading the input
    as it is) within the e4m3 rounding of the LoRA's input, far below what the LoRAs move."""
    from qwenfast.kernels.fp8_rows import QuantizedRows, set_fp8_fusion

    from .conftest import rel_err
    from .test_fp8_fused import _tiny_fp8_model

    dev = "cpu" if device == "interp" else device
    model = _tiny_fp8_model(False, dev)
    x, txt, t, shapes = _inputs(4)
    x, txt, t = x.to(dev, model.dtype), txt.to(dev, model.dtype), t.to(dev)
    sets = [[("a", 1.0)], [("b", 0.7), ("c", -0.5)], [], [("c", 1.3)]]
    base = model(x, txt, None, t, shapes)
    rows = RowAdapters(model, slots=3, device=dev)
    for name, (seed, rank) in {"a": (1, 4), "b": (2, 8), "c": (3, 16)}.items():
        rows.put(name, _lora(seed, rank))
    fed: list[tuple[bool, bool]] = []  # per FP8 layer call: (input as QuantizedRows, with a kept copy)
    hooks = [m.register_forward_pre_hook(lambda mod, a: fed.append((isinstance(a[0], QuantizedRows),
                                                                    getattr(a[0], "x", None) is not None)))
             for m in model.modules() if isinstance(m, FP8Linear)]  # fmt: skip
    rows.install()
    outs = {}
    try:
        rows.select(sets, dev)
        for on in (False, True):
            set_fp8_fusion(on)
            fed.clear()
            outs[on] = model(x, txt, None, t, shapes)
            assert sum(q for q, _ in fed) == (12 if on else 0) and not any(k for _, k in fed)
    finally:
        set_fp8_fusion(True, gelu=True)
        for h in hooks:
            h.remove()
        rows.uninstall()
    moved, err = rel_err(base, outs[True]), rel_err(outs[False], outs[True])
    assert moved > 10 * err and err < 2e-2, (moved, err)


@pytest.mark.skipif(TRITON and not PINNED_TRITON, reason="Triton older than the test extra's 3.7.1")
def test_interpreter_subprocess(request):
    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)


BLOCK_LINEARS = {  # diffusers module names (per block) -> (in, out) of the tiny model below (inner 64)
    "attn.to_q": (64, 64), "attn.to_k": (64, 64), "attn.to_v": (64, 64),
    "attn.add_q_proj": (64, 64), "attn.add_v_proj": (64, 64),
    "attn.to_out.0": (64, 64), "attn.to_add_out": (64, 64),
    "img_mlp.net.0.proj": (64, 256), "img_mlp.net.2": (256, 64), "txt_mlp.net.2": (256, 64),
}  # fmt: skip


def _lora(seed: int, rank: int, layers=2, extra: str = "") -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA on the block Linears (rank `rank`, alpha/rank folded into up)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    names = list(BLOCK_LINEARS) + ([extra] if extra else [])
    for i in range(layers):
        for n in names:
            k, o = BLOCK_LINEARS.get(n, (64, 384))
            pre = f"transformer.transformer_blocks.{i}.{n}"
            sd[f"{pre}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k**0.5
            sd[f"{pre}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.3
    return sd


@pytest.fixture(scope="module", params=["fp8", "float"])
def model(request):
    from .test_fp8_fused import _tiny_fp8_model

    # two blocks, stronger modulation, fp32 on the CPU; FP8 block Linears or the float ones
    return _tiny_fp8_model(False, "cpu", quantize=request.param == "fp8")


def _inputs(B: int):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, 96, 64, generator=g)
    txt = torch.randn(B, 7, 48, generator=g)
    return x, txt, torch.full((B,), 0.6), [(1, 8, 12)]  # img_shapes: one image's, shared by the rows


@torch.no_grad()
def test_rows_with_different_loras_equal_each_row_alone(model, tmp_path):
    """Each row against the same batch run with that row's set loaded for all of it (the unmerged FP8
    path, or merged into float weights): same shapes, so the emulated per-token FP8 rounding sees the same
    base values (a batch of another size differs ~1e-6 in fp32 on the CPU, which can move an e4m3 code).
    On float weights a `RowLoraLinear` stands in for each touched Linear and `uninstall` puts the very
    same modules back."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    loras = {"a": _lora(1, 4), "b": _lora(2, 8), "c": _lora(3, 16)}
    sets = [[("a", 1.0)], [("b", 0.7), ("c", -0.5)], [], [("c", 1.3)]]
    x, txt, t, shapes = _inputs(len(sets))

    def alone(B: int, b: int) -> torch.Tensor:
        m = LoraManager(model)
        for name, s in sets[b]:
            m.load(loras[name], s, name=name)
        out = model(x[:B], txt[:B], None, t[:B], shapes)[b : b + 1]
        m.unload()
        return out

    want = [alone(len(sets), b) for b in range(len(sets))]
    want2 = [alone(2, b) for b in range(2)]
    base = model(x, txt, None, t, shapes)
    for name, sd in loras.items():
        save_file(sd, tmp_path / f"{name}.safetensors")
    rows = RowAdapters(model, slots=3, folder=tmp_path)
    rows.install()
    try:
        rows.select(sets, "cpu")  # read from the folder on first use
        got = model(x, txt, None, t, shapes)
        assert rows.loads == 3 and set(rows.resident) == {"a", "b", "c"}
        # where each Q|K|V block's up factors lie in the stacked rank ("a": rank 4 apiece; the text stream
        # has no add_k_proj LoRA): what the Triton expand walks per block of output columns
        qkv = next(st for mod, st in rows.stacks.items() if mod.endswith("attn.to_qkv"))
        tqkv = next(st for mod, st in rows.stacks.items() if mod.endswith("attn.add_qkv_proj"))
        slot_a = rows.resident["a"]
        assert sorted(qkv.ranges[slot_a].tolist()) == [[0, 4], [4, 8], [8, 12]]  # (in the parts' order)
        t_q, t_k, t_v = tqkv.ranges[slot_a].tolist()
        assert t_k == [0, 0] and sorted([t_q, t_v]) == [[0, 4], [4, 8]]
        for b in range(len(sets)):
            assert_close_finite(got[b : b + 1], want[b], rtol=0, atol=TOL)
            moved = (want[b] - base[b : b + 1]).abs().max()
            assert moved > 10 * TOL if sets[b] else moved == 0
        # a fourth adapter: the least recently used one ("a": "b" and "c" were selected after it) goes
        save_file(_lora(4, 4), tmp_path / "d.safetensors")
        rows.select([[("c", 1.0)], [("d", 1.0)]], "cpu")
        assert rows.evictions == 1 and set(rows.resident) == {"b", "c", "d"}
        if rows.resident["d"] != slot_a:  # (the slot "a" left is zeros, ranges too, until reused)
            assert qkv.ranges[slot_a].tolist() == [[0, 0]] * 3
        else:
            assert sorted(qkv.ranges[slot_a].tolist()) == [[0, 4], [4, 8], [8, 12]]  # "d": rank 4 too
        rows.select(sets[:2], "cpu")  # "a" read again: "d" goes ("b" and "c" are in this batch)
        assert rows.loads == 5 and rows.evictions == 2 and set(rows.resident) == {"a", "b", "c"}
        got2 = model(x[:2], txt[:2], None, t[:2], shapes)
        for b in range(2):
            assert_close_finite(got2[b : b + 1], want2[b], rtol=0, atol=TOL)
        with pytest.raises(LoraError, match="per-row LoRAs are installed"):
            LoraManager(model).load(loras["a"], name="a")  # one kind of LoRA per layer at a time
        # no row using an adapter: the side path is skipped (no kept bf16 inputs for it either), and the
        # model's CUDA graphs are keyed by that (`graph_tag`), so a captured graph skips it too
        assert model.graph_tag == ("row-loras", 2)  # rows combine up to two adapters
        lowbit = [m for m in model.modules() if isinstance(m, LowBitLinear) and m.lora is not None]
        floats = [m for m in model.modules() if isinstance(m, RowLoraLinear)]  # (float weights)
        assert all(m.lora_active() for m in lowbit) and not any(map(plain_linear, floats))
        # per-row LoRAs on FP8 layers read the producers' e4m3 rows: no kept bf16 input
        assert not any(m.lora_reads_input() for m in lowbit if isinstance(m, FP8Linear))
        rows.select([[] for _ in sets], "cpu")
        assert model.graph_tag == ("row-loras", 0) and not any(m.lora_active() for m in lowbit)
        assert all(map(plain_linear, floats))  # fused paths (the MLP's GELU epilogue) take them as Linears
        assert torch.equal(model(x, txt, None, t, shapes), base)
    finally:
        rows.uninstall()
    assert model.graph_tag is None
    assert torch.equal(model(x, txt, None, t, shapes), base)  # no LoRA left behind
    assert linears == {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_adapters_outside_the_block_linears_are_refused(model, tmp_path):
    rows = RowAdapters(model, slots=2)
    with pytest.raises(LoraError, match="blocks' Linears only"):
        rows.put("mod", _lora(5, 4, extra="img_mod.1"))
    assert not rows.resident and not rows.stacks
    with pytest.raises(LoraError, match="not loaded"):
        rows.select([[("nope", 1.0)]], "cpu")
    rows.put("a", _lora(1, 4))
    rows.put("b", _lora(2, 4))
    with pytest.raises(LoraError, match="more than the 2 resident"):
        rows.put("c", _lora(3, 4), keep=frozenset({"a", "b"}))
    with pytest.raises(ValueError, match="more than 2 LoRAs"):
        rows.select([[("a", 1.0), ("b", 1.0), ("a", 0.5)]], "cpu")


@pytest.mark.parametrize(
    "weights,batched_cfg", [("fp8", True), ("fp8", False), ("float", True), ("int8", True)]
)
def test_pipeline_loras_per_prompt(tmp_path, weights, batched_cfg):
    """`pipe(prompts, loras=[...])`: each prompt's image equals the same call with that prompt's set loaded
    for the whole batch, with true CFG as one batched forward (each image's rows twice) or two forwards;
    on float weights (merged when loaded for the whole batch), FP8 and INT8 (unmerged). Within 1e-5, or
    1e-4 with FP8 weights: the emulated per-token e4m3 rounding of an activation can flip one code on a
    1e-7 difference in how the strength is applied (here at run time, there folded into the factors)."""
    tol = 1e-4 if weights == "fp8" else TOL
    from pathlib import Path

    from qwenfast import EngineOptions, QwenImagePipeline

    tiny = Path(__file__).resolve().parent / "assets" / "tiny-random"
    p = QwenImagePipeline.from_pretrained(tiny, device="cpu", dtype=torch.float32,
                                          options=EngineOptions(fp8=weights == "fp8", int8=weights == "int8",
                                                                  batched_cfg=batched_cfg))  # fmt: skip
    p.progress_bar = False
    kw = dict(
        height=32, width=48, num_inference_steps=2, output_type="np", negative_prompt=" ", true_cfg_scale=2.0
    )
    prompts = ["a red circle", "a blue square on grass", "green"]
    loras = {"a": _lora(1, 4), "b": _lora(2, 8), "c": _lora(3, 4)}
    sets = [[("a", 1.0)], [("b", 0.8), ("c", -0.4)], []]

    def run(**extra):
        gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        return p(prompts, generator=gens, **kw, **extra).images

    base = run()
    want = []
    for row in sets:
        p.set_loras([(loras[n], s, n) for n, s in row])
        want.append(run())
    p.set_loras([])
    for name, sd in loras.items():
        save_file(sd, tmp_path / f"{name}.safetensors")
    with pytest.raises(LoraError, match="enable_row_loras"):
        run(loras=sets)
    p.enable_row_loras(tmp_path, slots=4)
    got = run(loras=sets)
    for b, row in enumerate(sets):
        assert_close_finite(got[b], want[b][b], rtol=0, atol=tol)
        moved = np.abs(want[b][b] - base[b]).max()
        assert moved > 10 * tol if row else moved <= tol
    assert p.row_loras.loads == 3
    # a call without loras= after one with: no row inherits the last call's adapters
    assert_close_finite(run(), base, rtol=0, atol=tol)
    assert p.transformer.graph_tag == ("row-loras", 0)
    with pytest.raises(LoraError, match="one list per prompt"):
        run(loras=sets[:2])
    with pytest.raises(LoraError, match="per-row LoRAs are enabled"):
        p.set_loras([(loras["a"], 1.0, "a")])
    if weights == "float":
        from qwenfast.errors import ConfigureError

        with pytest.raises(ConfigureError, match="before enable_row_loras"):
            p.configure(fp8=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weights", ["bf16", "fp8", "int8"])
@torch.no_grad()
def test_rows_on_the_gpu(weights):
    """On CUDA in bf16, with the real 8-bit GEMMs: each row of a mixed batch against the same batch with its
    set loaded for all of it, within the weights' tolerance (of the output's scale: bf16 and INT8 2e-2, where
    the batch-wide LoRA is merged into rounded bf16 weights or summed in another order; FP8 3e-2, where a
    bf16-level difference can move an activation's e4m3 code downstream), and the LoRAs (at twice
    the CPU test's strengths) move each row at least 10x that. FP8 also allows one e4m3 step of the LoRA's
    move: the per-row path reads the e4m3 rows of the input, the batch-wide one its bf16 values."""
    from qwenfast.kernels.fp8_linear import fp8_supported, quantize_model
    from qwenfast.kernels.int8_linear import quantize_model_int8

    from .test_fp8_fused import _tiny_fp8_model

    if weights == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("needs an FP8 GPU")
    model = _tiny_fp8_model(False, "cuda", quantize=False)
    if weights != "bf16":
        assert (quantize_model if weights == "fp8" else quantize_model_int8)(model) == 16
    loras = {"a": _lora(1, 4), "b": _lora(2, 8), "c": _lora(3, 16)}
    sets = [[("a", 2.0)], [("b", 1.4), ("c", -1.0)], [], [("c", 2.6)]]
    tol = {"bf16": 2e-2, "fp8": 3e-2, "int8": 2e-2}[weights]
    x, txt, t, shapes = (v.cuda() if torch.is_tensor(v) else v for v in _inputs(len(sets)))
    x, txt = x.bfloat16(), txt.bfloat16()
    base = model(x, txt, None, t, shapes).float()
    want = []
    for b in range(len(sets)):
        m = LoraManager(model)
        for name, s in sets[b]:
            m.load(loras[name], s, name=name)
        want.append(model(x, txt, None, t, shapes)[b].float())
        m.unload()
    rows = RowAdapters(model, slots=3, device="cuda")
    for name, sd in loras.items():
        rows.put(name, sd)
    rows.install()
    try:
        rows.select(sets, "cuda")
        got = model(x, txt, None, t, shapes).float()
    finally:
        rows.uninstall()
    scale = base.abs().max()
    for b in range(len(sets)):
        assert torch.isfinite(got[b]).all()
        err = (got[b] - want[b]).abs().max() / scale
        moved = (want[b] - base[b]).abs().max() / scale
        # FP8: the per-row side path reads the layers' e4m3 input rows (what the GEMM beside it reads), the
        # batch-wide one their bf16 input, so the LoRA's own update differs by up to one e4m3 step (2^-4)
        assert err < tol + (2**-4 * moved if weights == "fp8" else 0), (weights, b, float(err), float(moved))
        assert moved > 10 * tol if sets[b] else moved < tol, (weights, b, float(moved))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@torch.no_grad()
def test_captured_side_path_replays_any_selection(weights):
    """CUDA graphs of a model with per-row LoRAs: a graph captured for one selection replays any later one
    with as many adapters per row (the selection lives in device buffers the host rewrites), equal to
    the eager forward of that selection; a selection with another width (two adapters in a row, or none)
    is another key, so another graph. Tolerance as `test_rows_on_the_gpu` (eager takes a GEMM pair when
    the rows share their adapters; the graph, the gathered kernels)."""
    from qwenfast.kernels.fp8_linear import fp8_supported, quantize_model
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    from .test_fp8_fused import _tiny_fp8_model

    if weights == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("needs an FP8 GPU")
    model = _tiny_fp8_model(False, "cuda", quantize=False)
    if weights == "fp8":
        quantize_model(model)
    rows = RowAdapters(model, slots=3, device="cuda")
    for name, (seed, rank) in {"a": (1, 4), "b": (2, 8), "c": (3, 16)}.items():
        rows.put(name, _lora(seed, rank))
    x, txt, t, shapes = _inputs(4)
    x, txt, t = x.cuda().bfloat16(), txt.cuda().bfloat16(), t.cuda()
    base = model(x, txt, None, t, shapes).float()
    scale = base.abs().max()
    tol = 3e-2 if weights == "fp8" else 2e-2
    selections = [
        ([[("a", 2.0)], [("b", 1.4)], [], [("c", 2.6)]], 1),
        ([[("c", -1.0)], [("a", 2.0)], [("b", 1.4)], []], 1),  # same width: the first graph replays it
        ([[("a", 2.0), ("b", 1.4)], [("c", 2.6)], [], [("a", -1.0)]], 2),
        ([[], [], [], []], 0),
        ([[("b", 1.4)], [], [("c", 2.6)], [("a", 2.0)]], 1),
    ]
    rows.install()
    runner = CudaGraphRunner(model)
    try:
        for sel, width in selections:
            rows.select(sel, "cuda")
            assert model.graph_tag == ("row-loras", width)
            want = model(x, txt, None, t, shapes).float()
            for _ in range(4):  # warm-ups, the capture, a replay
                got = runner(x, txt, None, t, shapes).float()
            assert torch.isfinite(got).all()
            err = ((got - want).abs().max() / scale).item()
            assert err < tol, (sel, err)
            moved = ((want - base).abs().max() / scale).item()
            assert moved > 10 * tol if width else moved < tol, (sel, moved)
        assert runner.captures == 3  # widths 1, 2 and 0; the other selections of width 1 replayed
    finally:
        runner.clear()
        rows.uninstall()


@pytest.mark.skipif(not TRITON, reason="needs CUDA and triton")  # (CI has triton: its interpreter runs)
@pytest.mark.parametrize(
    "kernel",
    ["expand S=1", "expand S=2", "expand S=1 ranges", "shrink", "shrink codes", "shrink part", "shrink tma"],
)
@pytest.mark.skipif(TRITON and not PINNED_TRITON, reason="Triton older than the test extra's 3.7.1")
def test_default_tiles_do_not_spill(kernel):
    """The kernels at their default tiles (`TILES`), compiled for sm_90a on this machine (Triton's PTX and
    the ptxas of its wheel: no GPU needed), spill no registers: a spilled kernel moves its spilled values
    through local memory on every use (the expand did, at its chosen tiles and every other tile compiled
    to check)."""
    import qwenfast.kernels.lora_rows as L
    from qwenfast.testing.ptxas import spills

    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    if kernel.startswith("expand"):
        bm, bn, br, w, st, *cap = L.TILES["expand"]
        sig = {"h_ptr": "*bf16", "u_ptr": "*bf16", "idx_ptr": "*i64", "y_ptr": "*bf16", "rr_ptr": "*i32",
               **ints("T", "N", "R", "G", "NG", "s_hb", "s_ht", "s_un", "s_uo", "s_ib", "s_is", "s_yb", "s_yt"),
               **{c: "constexpr" for c in ("S", "RANGES", "BM", "BN", "BR", "IEEE", "PREFETCH")}}  # fmt: skip
        cx = {
            "S": int(kernel[9]),
            "RANGES": kernel.endswith("ranges"),
            "BM": bm,
            "BN": bn,
            "BR": br,
            "IEEE": False,
            "PREFETCH": L.TILES["prefetch"],
        }
        got = spills(L._expand_kernel, sig, cx, w, st, maxnreg=cap[0] if cap else None)
    elif kernel == "shrink tma":
        bm, bk, w, st, br = L.TILES["shrink_tma"]
        sig = {"x_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "d_desc": f"tensordesc<bf16[{br}, {bk}]>",
               "xs_ptr": "*fp32", "idx_ptr": "*i64", "sc_ptr": "*fp32", "h_ptr": "*bf16",
               **ints("T", "K", "R", "S", "s_dn", "s_ib", "s_is", "s_hb", "s_ht", "NRT"),
               **{c: "constexpr" for c in ("BM", "BR", "BK")}}  # fmt: skip
        got = spills(L._shrink_tma_kernel, sig, {"BM": bm, "BR": br, "BK": bk}, w, st)
    else:
        bm, bk, w, st, br = L.TILES["shrink"]
        codes, part = kernel.endswith("codes"), kernel.endswith("part")
        sig = {"x_ptr": "*fp8e4nv" if codes else "*bf16", "xs_ptr": "*fp32", "d_ptr": "*bf16", "idx_ptr": "*i64",
               "sc_ptr": "*fp32", "h_ptr": "*fp32" if part else "*bf16",
               **ints("T", "K", "R", "S", "s_xb", "s_xt", "s_dn", "s_dr", "s_ib", "s_is", "s_hb", "s_ht", "NRT",
                      "KC", "s_pk"),
               **{c: "constexpr" for c in ("BM", "BR", "BK", "IEEE", "CODES", "PART")}}  # fmt: skip
        cx = {"BM": bm, "BR": br, "BK": bk, "IEEE": False, "CODES": codes, "PART": part}
        got = spills(L._shrink_kernel, sig, cx, w, st)
    assert got["stores"] == 0 and got["loads"] == 0, got


def test_the_tile_sweep_times_the_default_tiles():
    """`STAGE=tiles bash bench/serve.sh` (benchmarks/lora_tiles.py) sweeps tiles around the defaults: they
    must be among its candidates, or a sweep could never confirm (or beat) them like for like."""
    import qwenfast.kernels.lora_rows as L
    from qwenfast.benchmarks import lora_tiles
    from qwenfast.kernels import fp8_lora_gemm

    assert tuple(L.TILES["expand"][:5]) in lora_tiles.EXPAND
    assert tuple(L.TILES["shrink"]) in lora_tiles.SHRINK
    assert tuple(L.TILES["shrink_tma"]) in lora_tiles.SHRINK_TMA
    assert tuple(fp8_lora_gemm.FUSED_GEMM["gemm"]) in lora_tiles.GEMM
    # the fused GEMM's tiles as earlier records' commands wrote them: seven numbers (one program a tile),
    # ten with the flattened loops off; on is refused
    assert lora_tiles._gemm_tiles("128 256 128 8 4 8 32, 1 2 3 4 5 6 7 1 1 0") == [
        (128, 256, 128, 8, 4, 8, 32, 0, 0),
        (1, 2, 3, 4, 5, 6, 7, 1, 1),
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        lora_tiles._gemm_tiles("1 2 3 4 5 6 7 1 1 1")


@pytest.mark.parametrize("device", DEVICES)
def test_the_tile_sweep_tools_run_on_small_layers(device, monkeypatch):
    """The tile sweep's shrink-programs sweep and per-layer table (`STAGE=tiles bash bench/serve.sh`, a GPU
    tool) on four small layers like the image stream's, one call of each kernel timed as 1 ms: a time for
    each tile and programs count, a rate for each layer; and what they ran is the kernels' result (the
    shrink at the last programs count against the torch form)."""
    import qwenfast.kernels.lora_rows as L
    from qwenfast.benchmarks import lora_tiles as T

    dev = "cpu" if device == "interp" else device
    monkeypatch.setattr(L, "TILES", dict(L.TILES))
    monkeypatch.setattr(T, "B", 2)
    monkeypatch.setattr(T, "L", 40)
    monkeypatch.setattr(T, "SHAPES", [(64, 384, 12, 3), (64, 128, 8, 1), (64, 256, 8, 1), (1024, 128, 8, 1)])
    data, idx = T.layers(dev), torch.arange(1, 3, device=dev).view(2, 1)
    scale = torch.ones(2, 1, device=dev)
    calls = []

    def bench(ms):
        def run(fn, warmup, rep):
            calls.append(fn())
            return ms

        return run

    sweep = T.programs_sweep(data, idx, scale, [L.TILES["shrink"], L.TILES["shrink"]], bench(1.0))
    assert [r[1:] for r in sweep] == [[200, 4.0], [528, 4.0], [1056, 4.0]]  # one tile (deduplicated)
    rows = T.per_layer(data, idx, scale, bench(1e-4))
    assert [r[0] for r in rows] == [list(shape[:3]) for shape in T.SHAPES]
    assert all(r[1] == r[3] == 1e-4 and r[2] > 0 and r[4] > 0 for r in rows), rows
    assert len(calls) == 12 + 8
    down, up, rr, x, xs, y, h = data[3]
    want = torch.einsum("blk,rk->blr", x.float() * xs[..., None], down[1].float())  # row b uses slot b + 1
    want[1] = torch.einsum("lk,rk->lr", x[1].float() * xs[1, :, None], down[2].float())
    got = L._shrink(x, down, idx, scale, None, xs).float()
    assert torch.isfinite(got).all() and (got - want).abs().max() <= 2e-2 * want.abs().max()
