"""FP8 Linear (`qwenfast.kernels.fp8_linear`): quantisation vs its reference, error vs bf16, model swap.

The GPU tests check the Triton row quantiser bit for bit against the torch reference and the
`_scaled_mm` layer against the fp32 dequantised product; the CPU tests exercise the same layer
through the reference path and the whole-model swap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwenfast.kernels.fp8_linear import (
    FP8,
    FP8Linear,
    fp8_linear_ref,
    fp8_supported,
    quantize_model,
    quantize_rows,
    quantize_rows_ref,
)

from .conftest import assert_close_finite

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and fp8_supported(torch.device("cuda"))), reason="needs an FP8 GPU (sm_89+)"
)


def _rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / a.norm()).item()


def test_quantize_rows_ref_roundtrip_and_zero_rows():
    x = torch.randn(37, 300) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0
    q, s = quantize_rows_ref(x)
    assert q.dtype == FP8 and s.shape == (37, 1)
    back = q.float() * s
    assert torch.isfinite(back).all() and (back[5] == 0).all()
    assert (q.float().abs().amax(dim=1)[torch.arange(37) != 5] == 448).all()  # the amax maps to the top code
    assert _rel(x, back) < 0.04  # 3 mantissa bits


def _e4m3_rows_by_hand(t: torch.Tensor) -> torch.Tensor:
    """Per row: scale = amax / 448 (1 for an all-zero row), values / scale rounded to e4m3 by torch's own
    cast (float8_e4m3fn, round to nearest even), times the scale again; fp32. Written here from the
    scheme's definition, not from qwenfast's quantiser."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


def _fp8_linear_by_hand(lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An e4m3 Linear by its definition: weights per output channel and activations per token quantised
    and dequantised, the product and the bias in fp32, then the layer's dtype."""
    xq = _e4m3_rows_by_hand(x.reshape(-1, x.shape[-1]))
    y = xq @ _e4m3_rows_by_hand(lin.weight.detach()).t() + lin.bias.detach().float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_close_to_bf16_linear_on_cpu(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80).to(dtype)
    x = torch.randn(3, 17, 96, dtype=dtype) * torch.logspace(-2, 2, 17, dtype=dtype)[:, None]  # rows of any scale
    x[1, 3] = 0  # an all-zero token
    q = FP8Linear.from_linear(lin)
    y, yq = lin(x), q(x)
    assert yq.shape == y.shape and yq.dtype == dtype
    # the independent reference: the same up to the fp32 summation order (bf16: one rounding of the output)
    by_hand = _fp8_linear_by_hand(lin, x)
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}[dtype]
    assert_close_finite(yq, by_hand, **tol)
    # quantisation happened (3 mantissa bits: rel. error of a few %), and no more than that
    err = _rel(y.float(), yq.float())
    assert 5e-3 < err < 0.06, err
    assert _rel(y.float(), by_hand.float()) > 5e-3


def test_quantize_model_swaps_block_linears_and_runs():
    from qwenfast.config import TransformerConfig
    from qwenfast.models.transformer import QwenImageTransformer

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, num_attention_heads=2, attention_head_dim=32, joint_attention_dim=48,
                            axes_dims_rope=(8, 12, 12))  # fmt: skip
    model = QwenImageTransformer(cfg).eval()
    x, txt, t = torch.randn(1, 24, 64), torch.randn(1, 5, 48), torch.tensor([0.6])
    with torch.no_grad():
        ref = model(x, txt, None, t, [(1, 4, 6)])
        assert quantize_model(model) == 16
        assert isinstance(model.transformer_blocks[1].img_mlp.net[0].proj, FP8Linear)
        out = model(x, txt, None, t, [(1, 4, 6)])
    rel = _rel(ref, out)
    assert 0 < rel < 0.1, rel


@gpu
@pytest.mark.parametrize("shape", [(1, 64), (7, 3072), (333, 12288), (4097, 1000)])
def test_quantize_rows_triton_matches_ref(shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :] = 0
    q, s = quantize_rows(x)
    qr, sr = quantize_rows_ref(x)
    assert torch.equal(s, sr)
    mism = (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item()
    assert mism < 1e-4, mism  # division rounding may differ in rare ties


@gpu
@pytest.mark.parametrize("m,k,n", [(1, 3072, 9216), (6, 3072, 3072), (23, 3072, 12288), (16, 12288, 3072),
                                   (32, 3072, 9216), (130, 3072, 3072), (4096, 12288, 3072), (6889, 3072, 9216)])
def test_fp8_linear_gpu_matches_reference(m, k, n):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    q = FP8Linear.from_linear(lin)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    y = q(x)
    ref = fp8_linear_ref(x, q.weight_fp8, q.weight_scale, q.bias, torch.float32)
    assert _rel(ref, y.float()) < 1e-2
    assert _rel(lin(x).float(), y.float()) < 0.06


def test_pipeline_enable_fp8_on_cpu(qf_t2i, tiny_t2i):
    import copy

    pipe = copy.copy(qf_t2i)  # shallow: share the loaded parts, replace the transformer below
    pipe.transformer = copy.deepcopy(qf_t2i.transformer)
    pipe.__dict__.pop("_lora_manager", None)
    from qwenfast.runtime.cuda_graphs import CudaGraphRunner

    pipe._graphs = CudaGraphRunner(pipe.transformer)
    kw = dict(prompt="a red circle", num_inference_steps=2, height=32, width=32, output_type="np")
    ref = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    n = pipe.enable_fp8()
    assert n == 8 * len(pipe.transformer.transformer_blocks)
    out = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    # FP8 rounding, not another picture: measured mean 3.0e-3, max 0.025 (another prompt: mean 0.014);
    # bounds at ~4x; the lower bound proves the quantised path ran
    d = abs(out - ref)
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert 3e-4 < d.mean() < 0.01 and d.max() < 0.1, (d.mean(), d.max())
    pipe.set_loras([])  # LoRAs on FP8: tests/test_fp8_loading.py


def test_quantize_rows_pads_with_zero_rows():
    x = torch.randn(5, 48)
    q, s = quantize_rows(x, rows=16)
    qr, sr = quantize_rows_ref(x)
    assert q.shape == (16, 48) and s.shape == (16, 1)
    assert torch.equal(q[:5].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s[:5], sr)
    assert not q[5:].float().any() and torch.equal(s[5:], torch.ones(11, 1))
    with pytest.raises(ValueError, match="rows"):
        quantize_rows(x, rows=4)


@gpu
def test_quantize_rows_triton_padding():
    x = torch.randn(23, 3072, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_rows(x, rows=32)
    qr, sr = quantize_rows_ref(x)
    assert torch.equal(s[:23], sr) and torch.equal(s[23:], torch.ones(9, 1, device="cuda"))
    assert not q[23:].float().any()
    assert (q[:23].view(torch.uint8) != qr.view(torch.uint8)).float().mean().item() < 1e-4


@gpu
def test_fp8_linear_falls_back_when_cublaslt_refuses_a_shape(monkeypatch):
    import qwenfast.kernels.fp8_linear as F8

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, device="cuda", dtype=torch.bfloat16)
    q = FP8Linear.from_linear(lin)
    x = torch.randn(3, 7, 256, device="cuda", dtype=torch.bfloat16)

    def refuse(*a, **k):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic(...)`")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(F8, "_REFUSED", set())
    with pytest.warns(UserWarning, match="refused by cuBLASLt"):
        y = q(x)
    assert len(F8._REFUSED) == 1
    y2 = q(x)  # remembered: no second try, no warning
    ref = fp8_linear_ref(x, q.weight_fp8, q.weight_scale, q.bias, torch.float32)
    assert torch.equal(y, y2) and _rel(ref, y.float()) < 1e-2
