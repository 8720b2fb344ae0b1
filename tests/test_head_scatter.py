"""kernels/head_scatter: the table-driven row copy of the peer Ulysses exchange, vs its torch
reference, on odd shapes, into destinations poisoned with NaN (what it must not touch stays NaN).
The kernel runs on CUDA, or in Triton's CPU interpreter (a child process)."""

from __future__ import annotations

import pytest
import torch

import qwenfast.kernels as K
from qwenfast.kernels.head_scatter import entry, head_scatter, head_scatter_ref
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

CUDA = torch.cuda.is_available()
TRITON = K.triton_available()
INTERP = TRITON and K.interpreting()
DEVICES = kernel_devices()


def _case(device: str, dtype: torch.dtype, nc: int, seed: int):
    """Sources (B, T, H, D) as transposed (B, H, T, D) buffers (the attention layout), 3 destinations
    of different token counts, entries moving text-like and image-like row ranges between them."""
    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(seed)
    B, T, H, D, NH = 2, 23, 6, 24, 3
    srcs = [torch.randn(B, H, T, D, generator=g).to(dev, dtype).transpose(1, 2) for _ in range(nc)]
    dsts = [torch.full((nc, B, n, 4, D), float("nan"), device=dev, dtype=dtype) for n in (11, 17, 9)]
    rows = [entry(dsts[0], src_t0=0, src_h0=3, dst_t0=0, count=5),
            entry(dsts[1], src_t0=5, src_h0=0, dst_t0=9, count=8, dst_h0=1),
            entry(dsts[2], src_t0=13, src_h0=3, dst_t0=0, count=9),
            entry(dsts[0], src_t0=20, src_h0=1, dst_t0=7, count=3, dst_h0=1)]  # fmt: skip
    return srcs, rows, dsts, NH


def _per_row(dsts):
    return [dsts[0], dsts[1], dsts[2], dsts[0]]  # each table row's destination tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nc", [1, 3])
def test_kernel_equals_reference(device, dtype, nc):
    srcs, rows, dsts, NH = _case(device, dtype, nc, seed=nc)
    want = [d.clone() for d in dsts]
    head_scatter_ref(srcs, rows, _per_row(want), NH)
    table = torch.tensor(rows, dtype=torch.int64, device=srcs[0].device)
    with K.use_backend("triton"):
        head_scatter(srcs, table, rows, _per_row(dsts), NH, max(r[-1] for r in rows))
    for got, w in zip(dsts, want):
        assert torch.equal(got.isnan(), w.isnan())  # exactly the reference's elements were written
        assert torch.equal(got.nan_to_num(), w.nan_to_num())  # a copy: bit for bit
    assert int((~want[0].isnan()).sum()) == nc * 2 * (5 + 3) * NH * 24  # the reference wrote entries 0 and 3


def test_reference_path_without_triton():
    srcs, rows, dsts, NH = _case("cpu", torch.float32, 3, seed=7)
    want = [d.clone() for d in dsts]
    head_scatter_ref(srcs, rows, _per_row(want), NH)
    with K.use_backend("torch"):
        head_scatter(srcs, torch.tensor(rows), rows, _per_row(dsts), NH, 9)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(dsts, want))
    assert float(want[2][0, 1, 4, 2, 5]) == float(srcs[0][1, 17, 5, 5])  # entry 2: token 13+4, head 3+2


def test_bad_destination_layout_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        entry(torch.zeros(1, 1, 4, 3, 8).transpose(3, 4), src_t0=0, src_h0=0, dst_t0=0, count=1)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERP, reason="already running under the interpreter")
def test_interpreter_subprocess(request):
    from .conftest import interpreter_cases

    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)
