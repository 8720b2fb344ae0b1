"""qwenfast.kernels: every launcher against its `_ref`, and every `_ref` against the model.

Where the Triton kernels run:
- on CUDA (H100/H200) with triton installed: the `cuda` cases;
- on CPU under Triton's interpreter: the `interp` cases, which only run when the process was
  started with TRITON_INTERPRET=1; `test_interpreter_subprocess` starts such a process (when
  triton is installed), so a plain `pytest tests/test_kernels.py` on CPU checks the kernel logic.
Everywhere: the references against `models/transformer.py` (bit for bit) and the launchers'
fallback to the reference.

Outputs are poisoned with NaN before a kernel writes them, and NaN never passes a comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import qwenfast.kernels as K
from qwenfast.kernels.adaln import layernorm_modulate, layernorm_modulate_ref
from qwenfast.kernels.gated_residual import (
    gated_residual,
    gated_residual_layernorm_modulate,
    gated_residual_layernorm_modulate_ref,
    gated_residual_ref,
)
from qwenfast.kernels.gelu import linear_gelu_tanh, linear_gelu_tanh_ref
from qwenfast.kernels.qk_norm_rope import (
    QK_MARGIN,
    group_row,
    qk_descale,
    qk_norm_rope,
    qk_norm_rope_groups,
    qk_norm_rope_ref,
)
from qwenfast.models import transformer as T
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

from .conftest import interpreter_cases, rel_err

CUDA = torch.cuda.is_available()
TRITON = K.triton_available()
INTERP = TRITON and K.interpreting()
NAN = float("nan")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

KERNEL_DEVICES = kernel_devices()  # where the Triton kernels run: "cuda", or "interp" (CPU tensors)


@pytest.fixture(autouse=True)
def _restore_backend():
    saved = K._backend
    yield
    K._backend = saved


@pytest.fixture
def triton_backend():
    with K.use_backend("triton"):
        yield


def _dev(device: str) -> str:
    return "cpu" if device == "interp" else device


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, device, seed, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(device=device, dtype=dtype)


def _poison_cuda_allocator():
    """Fill free cached CUDA memory with NaN bytes so that torch.empty inside a launcher is NaN."""
    if CUDA:
        blocks = [
            torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xFF)
            for n in (1 << 20, 16 << 20, 64 << 20)
        ]
        del blocks


def assert_match(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    """Relative error below TOL[dtype], in L2 norm and element-wise, where the element-wise absolute
    slack is TOL times the tensor's largest magnitude: the kernels round intermediates to the
    dtype like torch, so a last-bit difference in fp32 statistics can flip one intermediate by an
    ulp of *its* magnitude, and `+ shift` can then cancel the result towards 0."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output (unwritten or bad)"
    tol = TOL[dtype]
    a, b = out.double(), ref.double()
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())  # NaN never passes
    assert rel_err(b, a) < tol


# ---------------------------------------------------------------------------------------------
# The backend switch


def test_backend_switch(monkeypatch):
    monkeypatch.setenv("QWENFAST_KERNELS", "torch")
    assert K.set_backend(None) == "torch" and K.backend() == "torch"
    with K.use_backend("triton") as name:
        assert name == K.backend() == "triton"
        with K.use_backend("torch"):
            assert K.backend() == "torch"
        assert K.backend() == "triton"
    assert K.backend() == "torch"
    auto = K.set_backend("auto")
    assert auto == ("triton" if TRITON and CUDA else "torch")
    with pytest.raises(ValueError):
        K.set_backend("cuda")
    monkeypatch.setenv("QWENFAST_KERNELS", "TORCH")  # read once, case-insensitive
    K._backend = None
    assert K.backend() == "torch"


def test_backend_torch_never_uses_triton():
    x = torch.zeros(2, 3, device="cuda" if CUDA else "cpu")
    with K.use_backend("torch"):
        assert not K.use_triton(x)


# ---------------------------------------------------------------------------------------------
# References == models/transformer.py, bit for bit (CPU)


def _mod_index(L, split):
    index = torch.zeros(1, L, 1, dtype=torch.bool)
    index[:, split:] = True
    return index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [None, 50])
def test_ref_layernorm_modulate_is_model(dtype, split):
    B, L, D = 2, 77, 200
    x = _randn(B, L, D, dtype=dtype, device="cpu", seed=0, scale=3.0)
    rows = B if split is None else 2 * B
    mod = _randn(rows, 3 * D, dtype=dtype, device="cpu", seed=1)
    norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
    want, gate_want = T._modulate(norm(x), mod, split)
    shift, scale, gate = mod.chunk(3, dim=-1)
    # independent spelling of the zero_cond_t row choice (the model and the refs share select_rows)
    if split is None:
        pick = [m[:, None] for m in (shift, scale, gate)]
    else:
        index = _mod_index(L, split)
        pick = [torch.where(index, m[B:, None], m[:B, None]) for m in (shift, scale, gate)]
    assert torch.equal(want, norm(x) * (1 + pick[1]) + pick[0]) and torch.equal(gate_want, pick[2])
    got = layernorm_modulate_ref(x, shift, scale, split=split)
    assert got.dtype == dtype and torch.equal(got, want)
    # the gate half of _modulate, used by the gated residual
    y = _randn(B, L, D, dtype=dtype, device="cpu", seed=2)
    assert torch.equal(gated_residual_ref(x, y, gate, split=split), x + gate_want * y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_layernorm_modulate_is_norm_out(dtype):
    B, L, D = 2, 33, 96
    torch.manual_seed(0)
    norm_out = T.AdaLayerNormOut(D).to(dtype)
    x = _randn(B, L, D, dtype=dtype, device="cpu", seed=3, scale=2.0)
    temb = _randn(B, D, dtype=dtype, device="cpu", seed=4)
    with torch.no_grad():
        want = norm_out(x, temb)
        scale, shift = norm_out.linear(torch.nn.functional.silu(temb).to(dtype)).chunk(2, dim=1)
    assert torch.equal(layernorm_modulate_ref(x, shift, scale), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_gated_residual_layernorm_modulate_is_block(dtype):
    """The block's `img = img + gate1 * attn; img_in = _modulate(norm2(img), mod2)`."""
    B, L, D = 2, 77, 200
    x = _randn(B, L, D, dtype=dtype, device="cpu", seed=5, scale=2.0)
    y = _randn(B, L, D, dtype=dtype, device="cpu", seed=6)
    mod1 = _randn(B, 3 * D, dtype=dtype, device="cpu", seed=7)
    mod2 = _randn(B, 3 * D, dtype=dtype, device="cpu", seed=8)
    norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
    _, gate1 = T._modulate(x, mod1, None)
    x_want = x + gate1 * y
    h_want, _ = T._modulate(norm2(x_want), mod2, None)
    shift2, scale2, _ = mod2.chunk(3, dim=-1)
    x_new, h = gated_residual_layernorm_modulate_ref(x, y, mod1.chunk(3, dim=-1)[2], shift2, scale2)
    assert torch.equal(x_new, x_want) and torch.equal(h, h_want)


def _rope(L, Dh, seed):
    ang = torch.randn(L, Dh // 2, generator=_gen(seed)) * 3
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_qk_norm_rope_is_joint_attention(dtype, monkeypatch):
    """Capture the q, k, v that `JointAttention.forward` (the unfused path) hands to attention."""
    B, H, Dh, dim, Li, Lt = 2, 3, 64, 48, 77, 13
    torch.manual_seed(0)
    attn = T.JointAttention(dim, H, Dh)
    with torch.no_grad():
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            getattr(attn, n).weight.uniform_(0.5, 1.5)
    attn = attn.to(dtype)
    img = _randn(B, Li, dim, dtype=dtype, device="cpu", seed=9)
    txt = _randn(B, Lt, dim, dtype=dtype, device="cpu", seed=10)
    icos, isin = _rope(Li, Dh, 11)
    tcos, tsin = _rope(Lt, Dh, 12)
    seen = {}

    def sdpa(q, k, v, attn_mask=None, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return torch.zeros_like(q)

    # the reference forward calls `attention` (qwenfast.runtime) where it exists, else torch's SDPA
    if hasattr(T, "attention"):
        monkeypatch.setattr(T, "attention", sdpa)
    else:
        monkeypatch.setattr(T.F, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        attn(img, txt, None, (icos, isin, tcos, tsin))
        outs = [torch.full((B, H, Lt + Li, Dh), NAN, dtype=dtype) for _ in range(3)]
        qk_norm_rope_ref(
            attn.add_qkv_proj(txt), attn.norm_added_q.weight, attn.norm_added_k.weight, tcos, tsin, *outs, 0
        )
        qk_norm_rope_ref(attn.to_qkv(img), attn.norm_q.weight, attn.norm_k.weight, icos, isin, *outs, Lt)
    for name, got in zip("qkv", outs):
        assert torch.equal(got, seen[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_linear_gelu_tanh_is_gelu_proj(dtype):
    torch.manual_seed(0)
    proj = T.GeluProj(48, 200).to(dtype)
    x = _randn(2, 77, 48, dtype=dtype, device="cpu", seed=13)
    with torch.no_grad():
        assert torch.equal(linear_gelu_tanh_ref(x, proj.proj.weight, proj.proj.bias), proj(x))


# ---------------------------------------------------------------------------------------------
# Launchers fall back to the reference (CPU tensors, backend "torch", unsupported layouts)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_launchers_fall_back_on_cpu(name):
    if name == "triton" and INTERP:
        pytest.skip("under the interpreter CPU tensors run the kernels")
    dtype, B, L, D, H, Dh = torch.bfloat16, 2, 77, 200, 3, 64
    x = _randn(B, L, D, dtype=dtype, device="cpu", seed=0)
    y = _randn(B, L, D, dtype=dtype, device="cpu", seed=1)
    g, sh, sc = (_randn(B, D, dtype=dtype, device="cpu", seed=s) for s in (2, 3, 4))
    qkv = _randn(B, L, 3 * H * Dh, dtype=dtype, device="cpu", seed=5)
    w = torch.rand(Dh, generator=_gen(6)).to(dtype) + 0.5
    cos, sin = _rope(L, Dh, 7)
    with K.use_backend(name):
        assert torch.equal(layernorm_modulate(x, sh, sc), layernorm_modulate_ref(x, sh, sc))
        assert torch.equal(gated_residual(x, y, g), gated_residual_ref(x, y, g))
        for a, b in zip(
            gated_residual_layernorm_modulate(x, y, g, sh, sc),
            gated_residual_layernorm_modulate_ref(x, y, g, sh, sc),
        ):
            assert torch.equal(a, b)
        outs = [torch.full((B, H, L, Dh), NAN, dtype=dtype) for _ in range(3)]
        refs = [o.clone() for o in outs]
        qk_norm_rope(qkv, w, w, cos, sin, *outs)
        qk_norm_rope_ref(qkv, w, w, cos, sin, *refs)
        assert all(torch.equal(a, b) for a, b in zip(outs, refs))
        wl, bl = (
            _randn(96, D, dtype=dtype, device="cpu", seed=8),
            _randn(96, dtype=dtype, device="cpu", seed=9),
        )
        # CPU's torch._addmm_activation is the erf GELU: the launcher must not use it there
        assert torch.equal(linear_gelu_tanh(x, wl, bl), linear_gelu_tanh_ref(x, wl, bl))


# ---------------------------------------------------------------------------------------------
# Kernels vs references (CUDA, or CPU under TRITON_INTERPRET=1)


def _mod_inputs(B, D, split, dtype, device, seed):
    """shift, scale, gate as strided chunks of one (B|2B, 3D) modulation vector, as in the model."""
    rows = B if split is None else 2 * B
    mod = _randn(rows, 3 * D, dtype=dtype, device=device, seed=seed)
    return mod.chunk(3, dim=-1)


def _act(B, L, D, dtype, device, seed, strided, scale=2.0):
    """(B, L, D) activation: contiguous, or a token slice of a longer sequence (strided batch dim)."""
    if not strided:
        return _randn(B, L, D, dtype=dtype, device=device, seed=seed, scale=scale)
    return _randn(B, L + 9, D, dtype=dtype, device=device, seed=seed, scale=scale)[:, 9:]


SHAPES = [(1, 77, 3072), (2, 77, 200)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,D", SHAPES)
@pytest.mark.parametrize("split", [None, 40])
def test_kernel_layernorm_modulate(device, dtype, B, L, D, split, triton_backend):
    dev = _dev(device)
    x = _act(B, L, D, dtype, dev, seed=1, strided=split is not None)
    shift, scale, _ = _mod_inputs(B, D, split, dtype, dev, seed=2)
    want = layernorm_modulate_ref(x, shift, scale, split=split)
    out = torch.full((B, L, D), NAN, dtype=dtype, device=dev)
    got = layernorm_modulate(x, shift, scale, split=split, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_match(got, want, dtype)
    if device == "cuda":  # launcher-allocated output (poisoned through the caching allocator)
        _poison_cuda_allocator()
        assert_match(layernorm_modulate(x, shift, scale, split=split), want, dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,D", SHAPES)
@pytest.mark.parametrize("split", [None, 40])
def test_kernel_gated_residual_layernorm_modulate(device, dtype, B, L, D, split, triton_backend):
    dev = _dev(device)
    x = _act(B, L, D, dtype, dev, seed=3, strided=split is not None)
    y = _act(B, L, D, dtype, dev, seed=4, strided=False, scale=1.0)
    _, _, gate = _mod_inputs(B, D, split, dtype, dev, seed=5)
    shift, scale, _ = _mod_inputs(B, D, split, dtype, dev, seed=6)
    x_want, h_want = gated_residual_layernorm_modulate_ref(x, y, gate, shift, scale, split=split)
    out_x = torch.full((B, L, D), NAN, dtype=dtype, device=dev)
    out_mod = torch.full((B, L, D), NAN, dtype=dtype, device=dev)
    x_new, h = gated_residual_layernorm_modulate(
        x, y, gate, shift, scale, split=split, out_x=out_x, out_mod=out_mod
    )
    assert x_new.data_ptr() == out_x.data_ptr() and h.data_ptr() == out_mod.data_ptr()
    assert_match(x_new, x_want, dtype)
    assert_match(h, h_want, dtype)
    if device == "cuda":
        _poison_cuda_allocator()
        x_new, h = gated_residual_layernorm_modulate(x, y, gate, shift, scale, split=split)
        assert_match(x_new, x_want, dtype)
        assert_match(h, h_want, dtype)
    # in place on the residual stream
    x_inplace = x.clone()
    x_new, h = gated_residual_layernorm_modulate(
        x_inplace, y, gate, shift, scale, split=split, out_x=x_inplace
    )
    assert x_new.data_ptr() == x_inplace.data_ptr()
    assert_match(x_inplace, x_want, dtype)
    assert_match(h, h_want, dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [None, 40])
def test_kernel_gated_residual(device, dtype, split, triton_backend):
    dev = _dev(device)
    B, L, D = 2, 77, 200
    x = _act(B, L, D, dtype, dev, seed=7, strided=True)
    y = _act(B, L, D, dtype, dev, seed=8, strided=False)
    _, _, gate = _mod_inputs(B, D, split, dtype, dev, seed=9)
    want = gated_residual_ref(x, y, gate, split=split)
    out = torch.full((B, L, D), NAN, dtype=dtype, device=dev)
    assert_match(gated_residual(x, y, gate, split=split, out=out), want, dtype)
    if device == "cuda":
        _poison_cuda_allocator()
        assert_match(gated_residual(x, y, gate, split=split), want, dtype)


def _joint_buffers(B, H, S, Dh, dtype, device, layout):
    if layout == "bshd":  # the model's cat(...).transpose(1, 2) layout
        return [torch.full((B, S, H, Dh), NAN, dtype=dtype, device=device).transpose(1, 2) for _ in range(3)]
    return [torch.full((B, H, S, Dh), NAN, dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Dh,layout", [(64, "bhsd"), (128, "bshd"), (80, "bhsd")])  # 80: not a power of 2
@pytest.mark.parametrize("w_dtype", ["same", "fp32"])
def test_kernel_qk_norm_rope(device, dtype, Dh, layout, w_dtype, triton_backend):
    dev = _dev(device)
    B, H, Lt, Li = 2, 3, 13, 77
    S = Lt + Li
    wdt = dtype if w_dtype == "same" else torch.float32
    txt_qkv = _randn(B, Lt, 3 * H * Dh, dtype=dtype, device=dev, seed=10, scale=2.0)
    img_qkv = _randn(B, Li + 5, 3 * H * Dh, dtype=dtype, device=dev, seed=11, scale=2.0)[:, 5:]  # strided
    w = [(torch.rand(Dh, generator=_gen(12 + i)) + 0.5).to(device=dev, dtype=wdt) for i in range(4)]
    tcos, tsin = (t.to(dev) for t in _rope(Lt, Dh, 16))
    icos, isin = (t.to(dev) for t in _rope(Li, Dh, 17))

    got = _joint_buffers(B, H, S, Dh, dtype, dev, layout)
    want = _joint_buffers(B, H, S, Dh, dtype, dev, layout)
    # one stream alone writes only its own positions
    qk_norm_rope(img_qkv, w[0], w[1], icos, isin, *got, offset=Lt)
    for o in got:
        assert torch.isnan(o[:, :, :Lt]).all() and torch.isfinite(o[:, :, Lt:]).all()
    qk_norm_rope(txt_qkv, w[2], w[3], tcos, tsin, *got, offset=0)
    qk_norm_rope_ref(img_qkv, w[0], w[1], icos, isin, *want, offset=Lt)
    qk_norm_rope_ref(txt_qkv, w[2], w[3], tcos, tsin, *want, offset=0)
    for name, a, b in zip("qkv", got, want):
        assert_match(a, b, dtype)
        if name == "v":
            assert torch.equal(a, b)  # a copy


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_qk_norm_rope_without_v(device, dtype, triton_backend):
    """A Q|K-only projection (out_v None: the V GEMM wrote its buffer itself): Q and K exactly those
    of the Q|K|V call on the same rows, nothing else of the buffers touched (V stays poisoned)."""
    dev = _dev(device)
    B, H, Dh, P, L = 2, 3, 64, 7, 41
    S = P + L
    qkv = _randn(B, L, 3 * H * Dh, dtype=dtype, device=dev, seed=50, scale=2.0)
    qk = qkv[..., : 2 * H * Dh].clone()
    w = [(torch.rand(Dh, generator=_gen(51 + i)) + 0.5).to(device=dev, dtype=dtype) for i in range(2)]
    cos, sin = (t.to(dev) for t in _rope(L, Dh, 53))
    full, got = _joint_buffers(B, H, S, Dh, dtype, dev, "bshd"), _joint_buffers(B, H, S, Dh, dtype, dev, "bshd")
    qk_norm_rope(qkv, *w, cos, sin, *full, offset=P)
    qk_norm_rope(qk, *w, cos, sin, got[0], got[1], None, offset=P)
    want = _joint_buffers(B, H, S, Dh, dtype, dev, "bshd")
    qk_norm_rope_ref(qk, *w, cos, sin, want[0], want[1], None, offset=P)
    for a, b, c in zip(got[:2], full[:2], want[:2]):
        assert torch.equal(a[:, :, P:], b[:, :, P:])  # the same program on the same Q/K values
        assert_match(a[:, :, P:], c[:, :, P:], dtype)
        assert torch.isnan(a[:, :, :P]).all()
    assert torch.isnan(got[2]).all() and torch.isnan(want[2]).all()
    assert torch.isfinite(full[2][:, :, P:]).all()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_qk_norm_rope_fp8_outputs(device, dtype, triton_backend):
    """e4m3 Q and K at the gains' bound descale (the 8-bit attention's inputs): the reference's codes
    (interpreter: every byte; CUDA, a separate compilation: all but <= 0.1% within one e4m3 step), never
    saturated even for rows of 1e4s and a sharp gain, all-zero rows exact zeros, V unchanged."""
    dev = _dev(device)
    B, H, Dh, Lt, Li = 2, 3, 64, 11, 45
    S = Lt + Li
    txt = _randn(B, Lt, 3 * H * Dh, dtype=dtype, device=dev, seed=30, scale=2.0)
    img = _randn(B, Li, 3 * H * Dh, dtype=dtype, device=dev, seed=31, scale=2.0)
    img[0, 3] = 1e4  # a huge row: the bound holds whatever the input's magnitude
    img[1, 4] = 0.0  # an all-zero row: zero codes, no NaN
    w = [(torch.rand(Dh, generator=_gen(32 + i)) * 3 + 0.2).to(device=dev, dtype=dtype) for i in range(4)]
    w[0][7] = 9.0  # one sharp gain sets the Q bound
    tcos, tsin = (t.to(dev) for t in _rope(Lt, Dh, 36))
    icos, isin = (t.to(dev) for t in _rope(Li, Dh, 37))
    dq, dk = qk_descale([w[2], w[0]], Dh), qk_descale([w[3], w[1]], Dh)
    assert dq.shape == (1,) and abs(dq.item() - 9.0 * Dh**0.5 * QK_MARGIN / 448) < 1e-6

    def buffers():
        q8, k8 = (torch.full((B, S, H, Dh), NAN, dtype=torch.float8_e4m3fn, device=dev).transpose(1, 2) for _ in "qk")
        return q8, k8, torch.full((B, S, H, Dh), NAN, dtype=dtype, device=dev).transpose(1, 2)

    got, want, plain = buffers(), buffers(), _joint_buffers(B, H, S, Dh, dtype, dev, "bshd")
    for out, fn in ((got, qk_norm_rope), (want, qk_norm_rope_ref)):
        fn(txt, w[2], w[3], tcos, tsin, *out, offset=0, descale_q=dq, descale_k=dk)
        fn(img, w[0], w[1], icos, isin, *out, offset=Lt, descale_q=dq, descale_k=dk)
    qk_norm_rope_ref(txt, w[2], w[3], tcos, tsin, *plain, offset=0)
    qk_norm_rope_ref(img, w[0], w[1], icos, isin, *plain, offset=Lt)
    assert torch.equal(got[2], want[2]) and torch.equal(got[2], plain[2])  # V: a copy
    for a, b, x, d in ((got[0], want[0], plain[0], dq), (got[1], want[1], plain[1], dk)):
        ab, bb = a.view(torch.uint8), b.view(torch.uint8)
        assert not ((ab & 0x7F) == 0x7F).any(), "NaN codes: an unwritten element or a bad value"
        if device == "interp":
            assert torch.equal(ab, bb)
        else:
            assert (ab != bb).float().mean() <= 1e-3
        codes = a.float()
        assert codes.abs().max() < 448  # the bound: never saturates
        assert codes.abs().max() > 448 / 4  # ... and not loose by more than the norm's spread
        assert (codes[1, :, Lt + 4] == 0).all()
        deq, ref = codes * d.item(), x.double()
        step = 2**-4 * ref.abs() + 2**-9 * d.item()  # half an e4m3 step (3 mantissa bits), or a subnormal's
        assert ((deq - ref).abs() <= 2 * step + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_qk_norm_rope_head_groups(device, dtype, triton_backend):
    """head0: each head group written on its own (a Ulysses rank's share, into its own buffer) gives
    exactly the slices of the all-heads result, and nothing outside its positions."""
    dev = _dev(device)
    B, H, G, Dh, L, off = 2, 6, 3, 64, 19, 4
    qkv = _randn(B, L, 3 * H * Dh, dtype=dtype, device=dev, seed=21, scale=2.0)
    wq, wk = ((torch.rand(Dh, generator=_gen(22 + i)) + 0.5).to(device=dev, dtype=dtype) for i in range(2))
    cos, sin = (t.to(dev) for t in _rope(L, Dh, 23))
    full = _joint_buffers(B, H, off + L, Dh, dtype, dev, "bshd")
    qk_norm_rope_ref(qkv, wq, wk, cos, sin, *full, offset=off)
    h = H // G
    for j in range(G):
        got = _joint_buffers(B, h, off + L + 2, Dh, dtype, dev, "bshd")
        qk_norm_rope(qkv, wq, wk, cos, sin, *got, offset=off, head0=j * h)
        want = _joint_buffers(B, h, off + L + 2, Dh, dtype, dev, "bshd")
        qk_norm_rope_ref(qkv, wq, wk, cos, sin, *want, offset=off, head0=j * h)
        for a, b, f in zip(got, want, full):
            assert torch.isnan(a[:, :, :off]).all() and torch.isnan(a[:, :, off + L :]).all()
            assert_match(a[:, :, off : off + L], b[:, :, off : off + L], dtype)
            assert torch.equal(b[:, :, off : off + L], f[:, j * h : (j + 1) * h, off:])  # the ref: a slice
    # every group in one launch (a table of their addresses), each into its own buffers
    outs = [_joint_buffers(B, h, off + L + 2, Dh, dtype, dev, "bshd") for _ in range(G)]
    groups = [(*o, j * h) for j, o in enumerate(outs)]
    table = torch.tensor([group_row(*grp) for grp in groups], dtype=torch.int64, device=dev)
    qk_norm_rope_groups(qkv, wq, wk, cos, sin, table, groups, offset=off)
    for j, o in enumerate(outs):
        for a, f in zip(o, full):
            assert torch.isnan(a[:, :, :off]).all() and torch.isnan(a[:, :, off + L :]).all()
            assert_match(a[:, :, off : off + L], f[:, j * h : (j + 1) * h, off:], dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_launchers_fall_back_on_unsupported_layouts(device, triton_backend):
    dev = _dev(device)
    B, L, D = 2, 7, 64
    x = _randn(B, D, L, dtype=torch.float32, device=dev, seed=0).transpose(1, 2)  # last dim strided
    shift, scale, gate = _mod_inputs(B, D, None, torch.float32, dev, seed=1)
    assert torch.equal(layernorm_modulate(x, shift, scale), layernorm_modulate_ref(x, shift, scale))
    x64 = _randn(B, L, D, dtype=torch.float64, device=dev, seed=2)
    s64, c64, g64 = (t.double() for t in (shift, scale, gate))
    assert torch.equal(layernorm_modulate(x64, s64, c64), layernorm_modulate_ref(x64, s64, c64))
    assert torch.equal(gated_residual(x64, x64, g64), gated_residual_ref(x64, x64, g64))
    xb = x.contiguous().bfloat16()  # dtype mismatch between x and shift/scale
    assert torch.equal(layernorm_modulate(xb, shift, scale), layernorm_modulate_ref(xb, shift, scale))
    # qk_norm_rope: fp64 rope tables are not the kernel's layout
    H, Dh = 2, 16
    qkv = _randn(B, L, 3 * H * Dh, dtype=torch.float32, device=dev, seed=3)
    w = torch.ones(Dh, device=dev)
    cos, sin = (t.double().to(dev) for t in _rope(L, Dh, 4))
    outs = [torch.zeros(B, H, L, Dh, device=dev) for _ in range(3)]
    refs = [o.clone() for o in outs]
    qk_norm_rope(qkv, w, w, cos, sin, *outs)
    qk_norm_rope_ref(qkv, w, w, cos, sin, *refs)
    assert all(torch.equal(a, b) for a, b in zip(outs, refs))


# ---------------------------------------------------------------------------------------------
# GELU: the cuBLASLt epilogue is the tanh GELU (CUDA only)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gelu_tanh_cuda(dtype, triton_backend):
    torch.backends.cuda.matmul.allow_tf32 = False
    x = _randn(2, 77, 200, dtype=dtype, device="cuda", seed=0)
    w = _randn(3 * 200, 200, dtype=dtype, device="cuda", seed=1, scale=0.2)
    b = _randn(3 * 200, dtype=dtype, device="cuda", seed=2)
    got = linear_gelu_tanh(x, w, b)
    assert got.shape == (2, 77, 600)
    assert_match(got, linear_gelu_tanh_ref(x, w, b), dtype)
    if dtype == torch.float32:  # tanh and erf GELU differ by up to ~5e-4: tell them apart
        lin = torch.nn.functional.linear(x, w, b)
        assert (got - torch.nn.functional.gelu(lin, approximate="tanh")).abs().max() < 5e-5
        assert (got - torch.nn.functional.gelu(lin)).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------
# The kernel cases once more, in Triton's CPU interpreter (a child process with TRITON_INTERPRET=1)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERP, reason="already running under the interpreter")
def test_interpreter_subprocess(request):
    run_interpreter_cases(__file__, at_least=len(interpreter_cases(request)), exactly=True)


def test_kernels_step_aside_while_autograd_records(monkeypatch):
    """Triton kernels have no backward: with gradients on, launchers must take the references."""
    import qwenfast.kernels as K

    monkeypatch.setattr(K, "triton_available", lambda: True)
    monkeypatch.setattr(K, "interpreting", lambda: True)  # CPU tensors count as kernel-capable
    with K.use_backend("triton"):
        x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
        assert K.use_triton(x, w.detach())
        assert not K.use_triton(x, w)
        with torch.no_grad():
            assert K.use_triton(x, w)
