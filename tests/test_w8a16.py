"""The W8A16 GEMM (kernels/w8a16.py): e4m3 weights widened to bf16 inside the GEMM. Every e4m3 code widens
exactly (an identity activation reads the weights back), and odd shapes match the fp32 reference within
bf16 rounding. Kernel cases run on CUDA, or on CPU in Triton's interpreter in a child process; outputs are
poisoned (NaN) before the kernel writes them, NaN never passes."""

from __future__ import annotations

import pytest
import torch

from qwenfast.kernels.w8a16 import fp8_weight_gemm, fp8_weight_gemm_ref
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

from .conftest import interpreter_cases

DEVICES = kernel_devices()
FP8 = torch.float8_e4m3fn


def _dev(device: str) -> str:
    return "cpu" if device == "interp" else device


@pytest.mark.parametrize("device", DEVICES)
def test_every_e4m3_code_widens_exactly(device):
    dev = _dev(device)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    codes = codes[~codes.float().isnan()]  # 254 codes: the two NaNs never occur in quantised weights
    K = 64
    n = codes.numel() // K * K
    w8 = codes[:n].reshape(-1, K).to(dev)  # (N, K)
    eye = torch.eye(K, dtype=torch.bfloat16, device=dev)
    got = fp8_weight_gemm(eye, w8, torch.ones(w8.shape[0], 1, device=dev), None, torch.float32)  # (K, N) = w8ᵀ
    assert torch.equal(got, w8.float().t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N,K,bias", [(1, 48, 64, True), (37, 200, 96, False), (130, 72, 256, True),
                                        (5, 33, 200, True)])  # fmt: skip
def test_w8a16_matches_reference(device, M, N, K, bias):
    dev = _dev(device)
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(dev)
    w8 = (torch.randn(N, K, generator=g) * 100).to(FP8).to(dev)
    sw = (torch.rand(N, 1, generator=g) * 1e-2 + 1e-4).to(dev)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(dev) if bias else None
    got = fp8_weight_gemm(x, w8, sw, b, torch.bfloat16)
    want = fp8_weight_gemm_ref(x, w8, sw, b, torch.float32)
    assert got.shape == (M, N) and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-3)  # the bf16 output's rounding


def test_interpreter_subprocess(request):
    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)
