"""kernels/attn_int8: INT8 Q·Kᵀ (K smoothed, per-block scales) + FP8 P·V attention. The kernel equals its
torch reference (which emulates the same online softmax) on odd shapes, into an output poisoned with NaN;
the reference stays close to exact fp32 attention, is unmoved by a shift of every key (the smoothing is
exact), ignores masked keys, and stays finite on zero and huge rows; the "int8" engine of 8-bit attention
runs it (its reference on the CPU). The kernel runs on CUDA, or in Triton's CPU interpreter (a child process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qwenfast.kernels as K
from qwenfast.kernels.attn_int8 import (
    _config,
    attention_int8,
    attention_int8_quantized,
    attention_int8_ref,
    quantize_int8_attention,
)
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

TRITON = K.triton_available()
INTERP = TRITON and K.interpreting()
DEVICES = kernel_devices()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return float((a - b).norm() / b.norm())


def _qkv(B, H, S, D, seed, dtype=torch.float32, device="cpu", shift=2.0):
    """(B, H, S, D) views of (B, S, H, D) memory (the model's layout); keys with a common component."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).transpose(1, 2) for _ in range(3))
    k = k + shift * torch.randn(1, H, 1, D, generator=g)
    return (t.to(device, dtype) for t in (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 2, 77, 32), (2, 3, 130, 64), (1, 1, 5, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(device, shape, dtype):
    dev = "cpu" if device == "interp" else device
    B, H, S, D = shape
    q, k, v = _qkv(B, H, S, D, seed=S + D, dtype=dtype, device=dev)
    want = attention_int8_ref(q, k, v, block_n=_config(D)[1])
    out = torch.full((B, S, H, D), float("nan"), dtype=dtype, device=dev)  # every element must be written
    with K.use_backend("triton"):
        got = attention_int8_quantized(quantize_int8_attention(q, k, v, kernels=False), dtype, out=out)
        # (its own quantisation passes: on a GPU a rare element one rounding step apart)
        assert rel(attention_int8(q, k, v), want) <= (1e-5 if device == "interp" else 1e-3) + 1e-2 * (
            dtype != torch.float32
        )
    assert got.shape == (B, H, S, D) and got.data_ptr() == out.data_ptr()
    # fp32 on a GPU: Hopper's FP8 tensor cores add up a key block's P·V products in reduced precision
    # (~14 mantissa bits), so the kernel sits ~1e-4 from the reference's exact sums; the interpreter's is exact
    tol = 1e-2 if dtype != torch.float32 else 1e-5 if device == "interp" else 5e-4
    assert rel(got, want) <= tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 2, 77, 32), (2, 1, 130, 64)])
def test_quantisation_kernels_equal_torch(device, shape):
    """The three Triton passes give torch's int8 blocks, scales and e4m3 Vᵀ (padding zero); on a GPU an
    element may differ by one step where its division rounds differently, never more, and rarely."""
    dev = "cpu" if device == "interp" else device
    q, k, v = _qkv(*shape, seed=11, dtype=torch.bfloat16, device=dev)
    with K.use_backend("triton"):
        got = quantize_int8_attention(q, k, v, kernels=True)
    want = quantize_int8_attention(q, k, v, kernels=False)
    for a, b in ((got.q8, want.q8), (got.k8, want.k8)):
        d = (a.int() - b.int()).abs()
        assert a.shape == b.shape and int(d.max()) <= 1 and float((d > 0).float().mean()) <= 1e-3
    for a, b in ((got.qs, want.qs), (got.ks, want.ks), (got.vs, want.vs)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    va, vb = got.v8t.float(), want.v8t.float()
    assert va.shape == vb.shape and float((va != vb).float().mean()) <= 1e-3
    torch.testing.assert_close(va, vb, rtol=0.07, atol=2**-9)  # (one e4m3 step where they differ)
    if device == "interp":  # IEEE division there: the same bits
        assert torch.equal(got.q8, want.q8) and torch.equal(got.k8, want.k8) and torch.equal(va, vb)


def test_reference_is_close_to_exact_and_smoothing_is_exact():
    q, k, v = _qkv(2, 3, 150, 64, seed=1)
    exact = F.scaled_dot_product_attention(q, k, v)
    out = attention_int8_ref(q, k, v)
    assert 1e-4 < rel(out, exact) <= 5e-2  # lossy, by a few percent at most
    # every key shifted by one vector: the same logits up to a per-row constant, and K' = K - mean unchanged
    # (but for the rounding of k + c); e4m3 keys per head lose the keys' differences to the shift
    from qwenfast.runtime.attention_fp8 import fp8_attention_ref

    c = 50.0 * torch.randn(1, 3, 1, 64, generator=torch.Generator().manual_seed(2))
    assert rel(attention_int8_ref(q, k + c, v), out) <= 5e-3
    assert rel(attention_int8_ref(q, k + c, v), exact) <= 5e-2
    assert rel(fp8_attention_ref(q, k + c, v, per_head=True), exact) > 0.5
    # and the output follows its inputs: a changed V moves it far beyond the tolerance
    assert rel(attention_int8_ref(q, k, v.flip(2)), out) > 0.5


def test_masked_keys_get_no_weight():
    q, k, v = _qkv(2, 2, 90, 32, seed=3)
    mask = torch.ones(2, 1, 1, 90, dtype=torch.bool)
    mask[1, ..., 60:] = False
    v2 = v.clone()
    v2[1, :, 60:] = 1e4  # values behind the mask: must not reach the output
    a, b = attention_int8_ref(q, k, v, mask), attention_int8_ref(q, k, v2, mask)
    assert rel(b[1], a[1]) <= 5e-2 and torch.isfinite(b).all()  # (V's per-channel scale grew: coarser V)
    exact = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert rel(a, exact) <= 5e-2


@pytest.mark.parametrize("device", DEVICES)
def test_zero_and_huge_rows_stay_finite(device):
    dev = "cpu" if device == "interp" else device
    q, k, v = (t.clone() for t in _qkv(1, 2, 100, 32, seed=5, dtype=torch.bfloat16, device=dev))
    q[:, :, :10] = 0
    k[:, :, 20:30] = 0
    q[:, :, 40:44] = 1e4
    k[:, 1, 50:54] = -1e4
    v[:, 0, 60:64] = 1e4
    z = torch.zeros_like(q)
    with K.use_backend("triton"):
        for args in ((q, k, v), (z, z, z), (q * 0 + 1e4, k, v)):
            assert torch.isfinite(attention_int8(*args).float()).all()
            assert torch.isfinite(attention_int8_ref(*args).float()).all()


def test_the_int8_engine_runs_it(monkeypatch):
    """QWENFAST_FP8_ATTENTION=int8 with attention "fp8": on the CPU, the model's attention is this file's
    reference (also for the fused joint path), and a forward stays close to exact attention."""
    from qwenfast.runtime import attention_fp8 as A8
    from qwenfast.runtime.attention import attention, use_attention

    q, k, v = _qkv(1, 2, 70, 32, seed=9)
    monkeypatch.setenv(A8.ENV_VAR, "int8")
    A8.CALLS.clear()
    with use_attention("fp8"):
        out = attention(q, k, v, None)
    assert A8.CALLS["cpu reference (int8)"] == 1
    assert rel(out, attention_int8_ref(q, k, v)) == 0.0
    assert A8.joint_engine(q, 32, None) is None  # the joint path brings bf16 Q, K, V to it
    monkeypatch.setenv(A8.ENV_VAR, "auto")
    assert A8.joint_engine(q, 32, None) is A8.REFERENCE


def test_the_sage_engine_adapts_the_models_layout(monkeypatch):
    """QWENFAST_FP8_ATTENTION=sage (SageAttention 2's Hopper kernel, built from source): without the
    package it is unavailable with the reason; with it, the adapter hands the kernel the model's (B, S, H,
    D) buffers as they are ("NHD", no copy), asks for K smoothing and fp32 + fp32 P·V accumulation, and
    returns a (B, H, S, D) view. On the CPU the int8 engine's reference stands in, as for "int8"."""
    import sys
    import types

    from qwenfast.runtime import attention_fp8 as A8
    from qwenfast.runtime.attention import attention, use_attention

    monkeypatch.setattr(A8, "_engines", {})
    monkeypatch.setattr(A8, "_engine_errors", {})
    monkeypatch.setitem(sys.modules, "sageattention", None)  # not installed
    assert A8.load_engine("sage") is None and "sageattention" in A8.engine_error("sage")

    seen = {}

    def kernel(q, k, v, **kw):  # stands in for sageattn_qk_int8_pv_fp8_cuda_sm90
        seen.update(kw, shapes=[tuple(t.shape) for t in (q, k, v)], q_is_view=q._base is not None)
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ).transpose(1, 2)

    fake = types.ModuleType("sageattention")
    fake.sageattn_qk_int8_pv_fp8_cuda_sm90 = kernel
    fake.core = types.SimpleNamespace(SM90_ENABLED=True)
    monkeypatch.setitem(sys.modules, "sageattention", fake)
    monkeypatch.setattr(A8, "_engine_errors", {})
    eng = A8.load_engine("sage")
    q, k, v = _qkv(2, 3, 40, 32, seed=4)  # (B, H, S, D) views of (B, S, H, D) memory
    out = A8.run_engine(eng, q, k, v)
    assert seen["tensor_layout"] == "NHD" and seen["shapes"] == [(2, 40, 3, 32)] * 3 and seen["q_is_view"]
    assert seen["smooth_k"] is True and seen["pv_accum_dtype"] == "fp32+fp32" and not seen["is_causal"]
    assert out.shape == (2, 3, 40, 32) and rel(out, F.scaled_dot_product_attention(q, k, v)) < 1e-6
    fake.core.SM90_ENABLED = False  # a build without the sm_90 kernel is refused, not run
    monkeypatch.setattr(A8, "_engines", {})
    assert A8.load_engine("sage") is None and "sm_90" in A8.engine_error("sage")

    monkeypatch.setenv(A8.ENV_VAR, "sage")
    A8.CALLS.clear()
    with use_attention("fp8"):
        out = attention(q, k, v, None)
    assert A8.CALLS["cpu reference (int8)"] == 1 and rel(out, attention_int8_ref(q, k, v)) == 0.0
    assert A8.joint_engine(q, 32, None) is None


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERP, reason="already running under the interpreter")
def test_interpreter_subprocess(request):
    from .conftest import interpreter_cases

    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)


def test_the_gate_table_keeps_each_device_and_engine():
    """docs/speed.md's 8-bit attention gate table: the newest record per (device, engine), so a CPU run
    of the int8 engine's emulation sits beside the GPU's rows instead of replacing them."""
    from qwenfast.benchmarks.records import Rec
    from qwenfast.benchmarks.report_quality import attention_quality

    def rec(line, gpu, eng, score, date):
        rows = [{"path": "reference fp32", "attention": "auto (exact, fp32)", "score": 88.3, "gap": 0.0},
                {"path": "bf16 + kernels + graphs", "attention": "fp8", "score": score, "gap": score - 88.3}]  # fmt: skip
        env = {} if eng == "auto" else {"QWENFAST_FP8_ATTENTION": eng}
        return Rec("attention.jsonl", line, {"bench": "attention_quality", "model": "edit", "gpu": gpu, "env": env,
                                             "rows": rows, "date": date, "commit": "abc1234"})  # fmt: skip

    recs = [rec(1, "NVIDIA H200", "auto", 85.0, "2026-11-23"), rec(2, "cpu", "int8", 87.5, "2026-11-26"),
            rec(3, "cpu", "auto", 85.8, "2026-11-26"), rec(4, "cpu", "int8", 88.3, "2026-11-27")]  # fmt: skip
    t = attention_quality(recs)
    assert "| edits | H200 | bf16 + kernels + graphs | 8-bit, auto engine | 85.0% | -3.3 |" in t
    assert "| edits | CPU (emulated) | bf16 + kernels + graphs | 8-bit, int8 engine | 88.3% | +0.0 |" in t
    assert "8-bit, auto engine | 85.8%" in t and "87.5%" not in t  # the newer int8 CPU run replaced line 2
