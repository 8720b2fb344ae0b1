"""INT8 W8A8 (kernels/int8_linear.py): the row quantiser and the int8 GEMM against their torch
references on odd shapes, the layer against fp32 (its quantisation error bounded, never NaN).

Kernel cases run on CUDA, or on CPU in Triton's interpreter in a child process
(`test_interpreter_subprocess`). The tests hand the kernels poisoned output buffers (NaN, or the code -128
no quantiser writes); NaN never passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qwenfast.kernels.int8_linear import (
    Int8Linear,
    int8_gemm,
    int8_gemm_ref,
    int8_linear_ref,
    quantize_model_int8,
    quantize_rows_int8,
    quantize_rows_int8_ref,
)
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

from .conftest import interpreter_cases

DEVICES = kernel_devices()


def _dev(device: str) -> str:
    return "cpu" if device == "interp" else device


def _x(M, K, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * scale
    if M > 2:
        x[1] = 0.0  # an all-zero row: scale EPS, codes 0
        x[2, : K // 3] *= 1e4  # an outlier row
    return x.to(dtype).to(_dev(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K", [(1, 48), (7, 200), (33, 3072)])
def test_quantize_rows_matches_reference(device, dtype, M, K):
    x = _x(M, K, dtype, device, seed=M * K)
    poisoned = (torch.full((M, K), -128, dtype=torch.int8, device=x.device),  # -128 is never a code
                torch.full((M, 1), float("nan"), device=x.device))  # fmt: skip
    q, s = quantize_rows_int8(x, out=poisoned)
    qr, sr = quantize_rows_int8_ref(x)
    assert q.dtype == torch.int8 and s.shape == (M, 1) and torch.isfinite(s).all()
    assert (q != -128).all()  # every code written
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    d = (q.int() - qr.int()).abs()
    # under the interpreter one arithmetic: equal; on a GPU a division may round the last bit differently
    assert d.max() <= 1 and (d > 0).float().mean() <= (0.0 if device == "interp" else 1e-3)
    assert (q[1] == 0).all() if M > 2 else True


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,bias", [(1, 48, 64, True), (37, 200, 96, False), (130, 72, 256, True),
                                        (5, 33, 200, True)])  # fmt: skip
def test_int8_gemm_matches_reference(device, out_dtype, M, N, K, bias):
    dev = _dev(device)
    g = torch.Generator().manual_seed(M + N + K)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8).to(dev)
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8).to(dev)
    sa = (torch.rand(M, 1, generator=g) * 1e-2 + 1e-4).to(dev)
    sb = (torch.rand(N, 1, generator=g) * 1e-2 + 1e-4).to(dev)
    bb = (torch.randn(N, generator=g).to(out_dtype).to(dev)) if bias else None
    got = int8_gemm(a, sa, b, sb, bb, out_dtype, out=torch.full((M, N), float("nan"), dtype=out_dtype, device=dev))
    want = int8_gemm_ref(a, sa, b, sb, bb, out_dtype)
    assert got.shape == (M, N) and got.dtype == out_dtype and torch.isfinite(got).all()
    # int32 sums are exact (K <= 256: also in the fp32 reference); the epilogue's fp32 products in the same
    # order: equal up to the output dtype's last bit
    tol = dict(rtol=1e-6, atol=1e-6) if out_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_linear_against_fp32(device):
    dev = _dev(device)
    torch.manual_seed(0)
    lin = nn.Linear(200, 72).to(dev)
    x = _x(19, 200, torch.float32, device, seed=5)
    x[2] = torch.randn(200)  # no outlier row here: the error bound below is for ordinary rows
    q = Int8Linear.from_linear(lin)
    got = q(x.view(1, 19, 200))
    want = lin(x).view(1, 19, 72)
    ref = int8_linear_ref(x, q.weight_int8, q.weight_scale, q.bias, torch.float32).view(1, 19, 72)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 1.5e-2, rel  # lossy, but 7-bit codes on both operands: about 1% here


def test_int8_linear_side_lora_formula():
    torch.manual_seed(0)
    lin = nn.Linear(48, 96)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(3, 7, 48)
    base = q(x)
    down, up = torch.randn(16, 48), torch.randn(96, 16)
    q.lora = (down, up)
    want = int8_linear_ref(x, q.weight_int8, q.weight_scale, q.bias, torch.float32) + (x @ down.t()) @ up.t()
    torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-5)
    assert (q(x) - base).abs().max() > 1.0


def test_quantize_model_replaces_the_named_linears():
    m = nn.Module()
    m.a, m.b, m.c = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)
    m.fp8_linears = lambda: ["a", "b"]
    x = torch.randn(3, 8)
    before = m.c(m.b(m.a(x)))
    assert quantize_model_int8(m) == 2
    assert isinstance(m.a, Int8Linear) and isinstance(m.b, Int8Linear) and isinstance(m.c, nn.Linear)
    after = m.c(m.b(m.a(x)))
    assert 0 < (after - before).abs().max() < 0.05 * before.abs().max()


def test_interpreter_subprocess(request):
    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)


def test_pipeline_int8_option():
    """EngineOptions(int8=True): the model's 8-bit Linears become Int8Linear, images stay close to fp32
    ones (and differ: the codes are lossy); one-way, not with fp8; --int8 on the CLI. (LoRA on INT8:
    tests/test_fp8_loading.py.)"""
    import numpy as np

    from qwenfast import QwenImagePipeline
    from qwenfast.engine_args import add_engine_arguments, engine_options_from_args
    from qwenfast.errors import ConfigureError, OptionsError
    from qwenfast.options import EngineOptions

    def run(p):
        return p("a red circle", height=64, width=64, num_inference_steps=4, true_cfg_scale=2.0,
                 generator=torch.Generator("cpu").manual_seed(3), output_type="np").images[0]  # fmt: skip

    pipe = QwenImagePipeline.from_pretrained(None, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    want = run(pipe)
    n = len(pipe.transformer.fp8_linears())
    pipe.configure(int8=True)
    assert sum(isinstance(m, Int8Linear) for m in pipe.transformer.modules()) == n > 0
    got = run(pipe)
    assert np.isfinite(got).all() and 0 < np.abs(got - want).max() < 0.1
    with pytest.raises(ConfigureError, match="INT8 cannot be turned off"):
        pipe.configure(int8=False)
    with pytest.raises(OptionsError, match="choose one"):
        EngineOptions(fp8=True, int8=True)
    import argparse

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    assert engine_options_from_args(ap.parse_args(["--int8"])).int8
