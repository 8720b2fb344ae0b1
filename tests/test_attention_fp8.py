"""The 8-bit attention backend ("fp8"): the e4m3 quantisation op (Triton kernel vs its torch reference,
in Triton's CPU interpreter and on CUDA), the CPU reference path behind `attention()`, its error
against exact attention, NaN-freedom on all-zero and huge-magnitude rows, and (GPU) the FP8
engines against cuDNN bf16. An engine that must run on the GPU at hand (tests/gpu_engines.py: a Hopper
with its package installed) fails when it does not load or refuses the joint shape, instead of skipping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qwenfast.kernels as K
from qwenfast.kernels.attn_quant import FP8, FP8_MAX, MIN_DESCALE, dequantize, quantize_qkv, quantize_qkv_ref
from qwenfast.options import EngineOptions
from qwenfast.runtime import attention_fp8 as A8
from qwenfast.runtime.attention import CHOICES, attention, joint_attention, use_attention
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

from .conftest import interpreter_cases, rel_err
from .gpu_engines import cuda_capability, must_run

CUDA = torch.cuda.is_available()
TRITON = K.triton_available()
INTERP = TRITON and K.interpreting()
FP8_GPU = CUDA and torch.cuda.get_device_capability() >= (9, 0)
# rel. error of 8-bit attention vs exact on N(0, 1) inputs: e4m3 keeps 3 mantissa bits, so Q/K rounding
# alone costs ~4 % (measured 0.046 at d=128, 0.026 from V; bf16 is ~0.004); the GPU kernels also round P
TOL_FP8, TOL_FP8_GPU = 0.06, 0.08


def _qkv(B=2, H=3, S=40, D=128, seed=0, dtype=torch.float32, device="cpu", bshd=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for scale in (1.0, 1.0, 1.0):
        x = torch.randn(B, S, H, D, generator=g) * scale
        x = x.transpose(1, 2) if bshd else x.transpose(1, 2).contiguous()  # (B, H, S, D)
        out.append(x.to(device=device, dtype=dtype))
    return out


def _nasty(q, k, v):
    """All-zero rows and 1e4-magnitude rows in Q, K and V (and a whole zero head in K)."""
    q, k, v = q.clone(), k.clone(), v.clone()
    q[:, :, :3] = 0
    k[:, :, 5:8] = 0
    v[:, :, 2:4] = 0
    q[0, 0, 10] = 1e4
    k[0, 1, 11] = -1e4
    v[1, 0, 12] = 1e4
    k[1, 2] = 0
    return q, k, v


# ---------------------------------------------------------------------------------------------
# the quantisation reference


@pytest.mark.parametrize("per_head", [False, True])
def test_quantize_ref_scales_layout_and_roundtrip(per_head):
    q, k, v = _qkv(dtype=torch.bfloat16)
    q8, k8, v8, d = quantize_qkv_ref(q, k, v, per_head=per_head)
    assert d.shape == (3, 2, 3) and d.dtype == torch.float32
    for x, x8, dd in zip((q, k, v), (q8, k8, v8), d):
        assert x8.dtype == FP8 and x8.shape == x.shape
        assert x8.transpose(1, 2).is_contiguous()  # BSHD storage: what both FP8 kernels read
        amax = x.float().abs().amax(dim=(2, 3))
        want = amax if per_head else amax.amax().expand_as(amax)
        torch.testing.assert_close(dd, want / FP8_MAX)
        assert x8.float().abs().max() <= FP8_MAX
        # e4m3 keeps 3 mantissa bits: every element within 2^-4 relative (or the subnormal step)
        back = dequantize(x8, dd)
        err = (back - x.float()).abs()
        assert bool((err <= x.float().abs() * 2**-4 + dd[:, :, None, None] * 2**-9).all())
    if not per_head:
        assert bool((d[0] == d[0, 0, 0]).all())


def test_quantize_ref_zero_and_huge_stay_finite():
    q, k, v = _nasty(*_qkv(dtype=torch.bfloat16))
    z = torch.zeros_like(q)
    for per_head in (False, True):
        q8, k8, v8, d = quantize_qkv_ref(z, k, v, per_head=per_head)
        assert bool((d[0] == MIN_DESCALE).all()) and bool((q8.float() == 0).all())  # all-zero tensor: no 0/0
        assert torch.isfinite(d).all() and all(torch.isfinite(t.float()).all() for t in (k8, v8))
        _, k8, _, d = quantize_qkv_ref(q, k, v, per_head=per_head)
        assert k8.float().abs().max() == FP8_MAX  # the 1e4 row sets the scale and saturates nothing else


# ---------------------------------------------------------------------------------------------
# the Triton kernel vs the reference: CUDA, or CPU under TRITON_INTERPRET=1

KERNEL_DEVICES = kernel_devices()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("case", ["bshd", "bhsd", "nasty", "fp16-d80"])
def test_quantize_kernel_matches_ref(device, per_head, case):
    dev = "cpu" if device == "interp" else device
    kw = {"bshd": {}, "bhsd": {"bshd": False}, "nasty": {}, "fp16-d80": {"D": 80, "S": 70}}[case]
    dtype = torch.float16 if case == "fp16-d80" else torch.bfloat16
    q, k, v = _qkv(dtype=dtype, device=dev, **kw)
    if case == "nasty":
        q, k, v = _nasty(q, k, v)
    with K.use_backend("triton"):
        assert K.use_triton(q, k, v)
        got = quantize_qkv(q, k, v, per_head=per_head)
    want = quantize_qkv_ref(q, k, v, per_head=per_head)
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=0)
    for g, w in zip(got[:3], want[:3]):
        assert g.dtype == FP8 and g.shape == w.shape and g.stride() == w.stride()
        assert bool((g.float() == w.float()).all())  # same e4m3 values (the interpreter may write -0 as +0)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERP, reason="already running under the interpreter")
def test_interpreter_subprocess(request):
    n = len(interpreter_cases(request))
    run_interpreter_cases(__file__, at_least=n, exactly=True, timeout=600, allow_skipped=True)


def test_kernel_falls_back_to_ref_without_triton():
    q, k, v = _qkv(dtype=torch.bfloat16)
    with K.use_backend("torch"):
        got = quantize_qkv(q, k, v)
    want = quantize_qkv_ref(q, k, v)
    assert all(bool((g.float() == w.float()).all()) for g, w in zip(got, want))


# ---------------------------------------------------------------------------------------------
# the backend behind attention() on CPU: the reference, lossy but close


def test_fp8_is_a_choice_everywhere():
    assert "fp8" in CHOICES
    assert EngineOptions(attention="fp8").attention == "fp8"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp8_backend_is_the_reference_and_close_to_exact(dtype):
    q, k, v = _qkv(S=96, dtype=dtype)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    with use_attention("fp8"):
        got = attention(q, k, v)
    assert got.dtype == dtype and got.shape == q.shape
    want = A8.fp8_attention_ref(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    err = rel_err(exact, got)
    assert 1e-3 < err < TOL_FP8, err  # lossy (not the exact path by accident), yet within the tolerance
    with use_attention("math"):
        assert rel_err(exact, attention(q, k, v)) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_cpu_fp8_backend_nan_free_on_zero_and_huge_rows():
    q, k, v = _nasty(*_qkv(S=64))
    with use_attention("fp8"):
        out = attention(q, k, v)
        zero = attention(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    assert torch.isfinite(out).all() and torch.isfinite(zero).all()
    assert bool((zero == 0).all())


def test_cpu_fp8_backend_takes_a_padding_mask():
    q, k, v = _qkv(B=2, S=48)
    mask = torch.ones(2, 1, 1, 48, dtype=torch.bool)
    mask[1, ..., 5:24] = False  # padded text tokens of the second row
    with use_attention("fp8"):
        got = attention(q, k, v, mask)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert rel_err(exact, got) < TOL_FP8
    unmasked = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert rel_err(unmasked[1], exact[1]) > 5 * rel_err(exact[1], got[1])  # the mask matters here


def test_fp8_engine_choice_from_env(monkeypatch):
    monkeypatch.setenv(A8.ENV_VAR, "fa3")
    assert A8.engine_choice() == "fa3"
    monkeypatch.setenv(A8.ENV_VAR, "tensorrt")
    with pytest.raises(ValueError, match="auto"):
        A8.engine_choice()


# ---------------------------------------------------------------------------------------------
# GPU: the FP8 engines against cuDNN bf16 (and exact fp32)


def _fail_or_skip(engine: str, what: str) -> None:
    """A missing engine, or one that refused the test's shape: a failure where it must run
    (gpu_engines.must_run: a Hopper with its package installed), else a skip."""
    why = must_run(engine, cuda_capability())
    if why:
        pytest.fail(f"{what} (it must run here: {why})")
    pytest.skip(what)


def _engine_or_skip(engine: str):
    eng = A8.load_engine(engine)
    if eng is None:
        _fail_or_skip(engine, f"{engine} FP8 engine unavailable on this GPU box: {A8.engine_error(engine)}")
    return eng


def test_a_missing_engine_fails_where_it_must_run(monkeypatch):
    """(CPU) The GPU tests' decision: an H100 with only the fa3-fwd wheel, neither engine loading."""
    import sys

    here = sys.modules[__name__]
    monkeypatch.setattr(here, "cuda_capability", lambda: (9, 0))
    real = must_run
    monkeypatch.setattr(here, "must_run", lambda e, cap: real(e, cap, {"fa3_fwd_interface"}.__contains__))
    monkeypatch.setattr(A8, "load_engine", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match=r"fa3 FP8 engine unavailable.*must run here: sm_90 with fa3_fwd"):
        _engine_or_skip("fa3")
    with pytest.raises(pytest.skip.Exception, match="cudnn FP8 engine unavailable"):
        _engine_or_skip("cudnn")  # its package is not installed: a skip, saying why


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with FP8 attention (sm_90+)")
@pytest.mark.parametrize("engine", ["cudnn", "fa3"])
def test_gpu_fp8_engine_vs_cudnn_bf16(engine):
    eng = _engine_or_skip(engine)
    q, k, v = _qkv(B=2, H=4, S=1000, D=128, dtype=torch.bfloat16, device="cuda")  # B=2: `_nasty` edits row 1
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    with torch.no_grad():
        got = A8.run_engine(eng, q, k, v)
        bf16 = F.scaled_dot_product_attention(q, k, v)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert rel_err(exact, got) < TOL_FP8_GPU and rel_err(bf16, got) < TOL_FP8_GPU
    qn, kn, vn = _nasty(q, k, v)
    assert torch.isfinite(A8.run_engine(eng, qn, kn, vn)).all()
    z = torch.zeros_like(q)
    assert torch.isfinite(A8.run_engine(eng, z, z, z)).all()


# ---------------------------------------------------------------------------------------------
# the fused joint path: Q and K written in e4m3 by the QK-norm + RoPE kernel, at the gains' bound


def _streams(B=2, H=3, D=64, Lt=9, Li=50, seed=0, dtype=torch.float32):
    """Two streams' fused QKV projections, norm gains in [0.5, 1.5) and rope tables, as a block hands
    them to `joint_attention` ([text; image] order)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in (Lt, Li):
        qkv = (torch.randn(B, L, 3 * H * D, generator=g) * 2).to(dtype)
        wq, wk = ((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2))
        ang = torch.randn(L, D // 2, generator=g) * 3
        out.append((qkv, wq, wk, ang.cos(), ang.sin()))
    return out


def _exact_joint(streams, H, D, mask=None):
    with use_attention("math"):
        return joint_attention([tuple(t.double() if t.is_floating_point() else t for t in st) for st in streams],
                               H, D, None if mask is None else mask)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_joint_fp8_path_is_the_fused_quantisation(dtype):
    """On CPU the fused joint path runs the reference engine on exactly what the GPU path would feed
    an FP8 kernel: e4m3 Q, K from the norm kernel at the bound descale, V by its amax."""
    from qwenfast.kernels.attn_quant import quantize_heads_ref
    from qwenfast.kernels.qk_norm_rope import qk_descale, qk_norm_rope_ref

    H, D = 3, 64
    streams = _streams(H=H, D=D, dtype=dtype)
    before = A8.CALLS["cpu reference (joint)"]
    with use_attention("fp8"):
        got = joint_attention(streams, H, D, None)
    assert A8.CALLS["cpu reference (joint)"] == before + 1
    B, S = 2, sum(st[0].shape[1] for st in streams)
    q8, k8 = (torch.empty(B, S, H, D, dtype=FP8).transpose(1, 2) for _ in "qk")
    v = torch.empty(B, S, H, D, dtype=dtype).transpose(1, 2)
    dq, dk = qk_descale([st[1] for st in streams], D), qk_descale([st[2] for st in streams], D)
    off = 0
    for qkv, wq, wk, cos, sin in streams:
        qk_norm_rope_ref(qkv, wq, wk, cos, sin, q8, k8, v, offset=off, descale_q=dq, descale_k=dk)
        off += qkv.shape[1]
    v8, dv = quantize_heads_ref(v)
    want = F.scaled_dot_product_attention(q8.float() * dq, k8.float() * dk, dequantize(v8, dv)).to(dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = _exact_joint(streams, H, D)
    err = rel_err(exact, got)
    assert 1e-3 < err < TOL_FP8, err
    # the fixed Q/K descale costs nothing against amax scaling of the same Q, K, V (measured 1.01x)
    plain = [torch.empty(B, S, H, D, dtype=dtype).transpose(1, 2) for _ in "qkv"]
    off = 0
    for qkv, wq, wk, cos, sin in streams:
        qk_norm_rope_ref(qkv, wq, wk, cos, sin, *plain, offset=off)
        off += qkv.shape[1]
    assert err < 1.1 * rel_err(exact, A8.fp8_attention_ref(*plain)) + 1e-3
    # the inputs matter here: a different image stream moves the output far beyond the error
    other = [streams[0], (streams[1][0].flip(1), *streams[1][1:])]
    with use_attention("fp8"):
        assert rel_err(got, joint_attention(other, H, D, None)) > 10 * err


def test_cpu_joint_fp8_path_takes_a_padding_mask():
    H, D = 3, 64
    streams = _streams(H=H, D=D)
    S = sum(st[0].shape[1] for st in streams)
    mask = torch.ones(2, 1, 1, S, dtype=torch.bool)
    mask[1, ..., 3:9] = False  # padded text of the second row
    with use_attention("fp8"):
        got = joint_attention(streams, H, D, mask)
    exact = _exact_joint(streams, H, D, mask)
    assert rel_err(exact, got) < TOL_FP8
    assert rel_err(_exact_joint(streams, H, D)[1], exact[1]) > 5 * rel_err(exact[1], got[1])


def test_joint_engine_failure_falls_back_to_bf16_once(monkeypatch):
    """An engine that raises: this call runs the fallback on the dequantised Q, K (and V), says so once."""

    class Broken:
        name, per_head = "broken", True

        def __call__(self, *a, **k):
            raise RuntimeError("no kernel for this shape")

    H, D = 3, 64
    streams = _streams(H=H, D=D)
    monkeypatch.setattr(A8, "joint_engine", lambda *a: Broken())
    monkeypatch.setattr(A8, "_warned", set())
    before = A8.CALLS["bf16 fallback: engine failed"]
    with use_attention("fp8"), pytest.warns(RuntimeWarning, match="broken FP8 engine failed"):
        got = joint_attention(streams, H, D, None)
    assert A8.CALLS["bf16 fallback: engine failed"] == before + 1
    assert ("broken", "joint") in A8._engine_errors
    A8._engine_errors.pop(("broken", "joint"))
    assert torch.isfinite(got).all() and rel_err(_exact_joint(streams, H, D), got) < TOL_FP8


def test_qk_descale_cache_follows_the_gains():
    """The bound descale is computed once per set of gains, and again after an in-place change."""
    wq, wk = torch.full((64,), 0.5), torch.full((64,), 2.0)
    a = A8._qk_descale_pair([wq], [wk], 64)
    assert A8._qk_descale_pair([wq], [wk], 64) is a
    assert torch.allclose(a, torch.tensor([0.5, 2.0]) * 8 * 1.02 / 448)
    with torch.no_grad():
        wq.mul_(4)  # e.g. a LoRA merged into the norm
    b = A8._qk_descale_pair([wq], [wk], 64)
    assert b is not a and torch.allclose(b[0], 4 * a[0]) and b[1] == a[1]
    assert A8._qk_descale_pair([wq], [wk], 64) is b and len(A8._qk_descales[wq]) == 1  # the stale one dropped
    if CUDA:  # the same parameters on another device: a descale there, the CPU one kept
        wq.data, wk.data = wq.data.cuda(), wk.data.cuda()
        c = A8._qk_descale_pair([wq], [wk], 64)
        assert c.is_cuda and torch.equal(c.cpu(), b) and len(A8._qk_descales[wq]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with FP8 attention (sm_90+)")
@pytest.mark.parametrize("engine", ["cudnn", "fa3"])
def test_gpu_joint_fp8_path_vs_unfused_and_in_a_cuda_graph(engine, monkeypatch):
    """The fused joint path on an FP8 engine: as accurate as quantising the bf16 Q, K, V after the
    fact (the `attention()` path), NaN-free, and the same output replayed from a CUDA graph."""
    eng = _engine_or_skip(engine)
    monkeypatch.setenv(A8.ENV_VAR, engine)
    H, D = 4, 128
    streams = [tuple(t.cuda() for t in st) for st in _streams(B=1, H=H, D=D, Lt=37, Li=1000, dtype=torch.bfloat16)]
    exact = _exact_joint(streams, H, D).float()
    before = A8.CALLS[f"{engine} (joint)"]
    with torch.no_grad(), use_attention("fp8"):
        try:
            got = joint_attention(streams, H, D, None)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{engine}: {e}")
        if A8.CALLS[f"{engine} (joint)"] == before:  # bf16, d=128, no mask: what the engines exist for
            _fail_or_skip(engine, f"{engine} did not take the joint shape: {A8._engine_errors.get((engine, 'joint'))}")
        with use_attention("cudnn"):
            plain = joint_attention(streams, H, D, None)  # bf16 Q, K, V
        unfused = A8.run_engine(eng, *_split_plain(streams, H, D))
        assert torch.isfinite(got).all() and got.dtype == torch.bfloat16
        err = rel_err(exact, got)
        assert err < TOL_FP8_GPU and err < 1.2 * rel_err(exact, unfused) + 1e-3, (err, rel_err(exact, unfused))
        assert rel_err(plain.float(), got.float()) < TOL_FP8_GPU
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            joint_attention(streams, H, D, None)  # warm (descales cached outside the capture)
            with torch.cuda.graph(g, stream=s):
                out = joint_attention(streams, H, D, None)
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


def _split_plain(streams, H, D):
    """The bf16 Q, K, V (B, H, S, D) the plain path hands to `attention()`."""
    from qwenfast.kernels.qk_norm_rope import joint_qkv

    return joint_qkv(streams, H, D)
