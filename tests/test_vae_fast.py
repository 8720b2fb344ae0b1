"""The fast VAE path (fused RMSNorm+SiLU, sub-pixel upsampling convs, channels-last) and tiled VAE.

- `rmsnorm_silu_ref` == the model's RMSNorm (+SiLU), bit for bit; the Triton kernel vs the reference
  on odd shapes, both layouts, fp32/bf16/fp16, into NaN-poisoned outputs (on CUDA, and on CPU in
  Triton's interpreter: `test_interpreter_subprocess` starts pytest with TRITON_INTERPRET=1).
- `upsample_conv` vs `F.interpolate(nearest) + conv2d` on odd sizes (fp32 ~1e-6).
- fast encode/decode == reference modules == diffusers; tiled encode/decode == diffusers' tiled
  VAE with the same tiles; the tile/blend/crop arithmetic equals untiled output exactly for a
  per-pixel model (where tiling cannot change anything).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qwenfast.kernels as K
from qwenfast.kernels.bias_residual import bias_residual, bias_residual_ref
from qwenfast.kernels.rmsnorm_silu import rmsnorm_silu, rmsnorm_silu_ref
from qwenfast.kernels.upsample_conv import subpixel_weights, upsample_conv, upsample_conv_ref
from qwenfast.models.vae import RMSNorm
from qwenfast.testing.interp import kernel_devices, run_interpreter_cases

from .conftest import interpreter_cases

CUDA = torch.cuda.is_available()
TRITON = K.triton_available()
INTERP = TRITON and K.interpreting()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = kernel_devices()
SHAPES = [(2, 96, 7, 9), (1, 5, 3, 1), (3, 384, 2, 5), (1, 130, 11, 3)]  # odd C, H, W; C = VAE widths


@pytest.fixture(autouse=True)
def _restore_backend():
    saved = K._backend
    yield
    K._backend = saved


def _close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "NaN/inf in the output (unwritten or bad)"
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * ref.abs().max().item())


# ---------------------------------------------------------------------------------------------- RMSNorm + SiLU


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_silu_ref_is_the_model(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96).to(dtype)
    with torch.no_grad():
        norm.gamma.copy_(0.5 + torch.rand(96, 1, 1, generator=g))
    x = (torch.randn(2, 96, 5, 7, generator=g) * 3).to(dtype)
    assert torch.equal(rmsnorm_silu_ref(x, norm.gamma, norm.scale), F.silu(norm(x)))
    assert torch.equal(rmsnorm_silu_ref(x, norm.gamma, norm.scale, silu=False), norm(x))
    assert torch.equal(norm.forward_fast(x, silu=True), F.silu(norm(x)))  # CPU: launcher -> reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("silu", [True, False])
def test_rmsnorm_silu_kernel(device, dtype, shape, channels_last, silu):
    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 2).to(dev, dtype)
    x[0, :, 0, 0] = 0  # an all-zero pixel: the 1e-12 clamp, no NaN
    gamma = (0.5 + torch.rand(shape[1], 1, 1, generator=g)).to(dev, dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)
    out = torch.full_like(x, float("nan"))
    with K.use_backend("triton"):
        got = rmsnorm_silu(x, gamma, shape[1] ** 0.5, silu=silu, out=out)
    assert got is out
    _close(got, rmsnorm_silu_ref(x, gamma, shape[1] ** 0.5, silu=silu), dtype)
    with K.use_backend("triton"):  # own allocation keeps the layout
        y = rmsnorm_silu(x, gamma, shape[1] ** 0.5, silu=silu)
    assert y.is_contiguous(memory_format=fmt)
    _close(y, rmsnorm_silu_ref(x, gamma, shape[1] ** 0.5, silu=silu), dtype)


def test_rmsnorm_silu_nan_propagates():
    """A NaN input pixel gives NaN out (never silently cleaned) in the reference, which the kernel follows."""
    x = torch.randn(1, 4, 2, 2)
    x[0, 1, 1, 1] = float("nan")
    y = rmsnorm_silu(x, torch.ones(4, 1, 1), 2.0)
    assert torch.isnan(y[0, :, 1, 1]).all() and torch.isfinite(y[0, :, 0, 0]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_rmsnorm_silu_bias_kernel(device, dtype, channels_last):
    """The previous conv's bias added (and the sum rounded) before the norm."""
    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 130, 5, 7, generator=g) * 2).to(dev, dtype)
    gamma = (0.5 + torch.rand(130, 1, 1, generator=g)).to(dev, dtype)
    bias = torch.randn(130, generator=g).to(dev, dtype)
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.full_like(x, float("nan"))
    with K.use_backend("triton"):
        got = rmsnorm_silu(x, gamma, 130**0.5, out=out, bias=bias)
    want = rmsnorm_silu_ref(x, gamma, 130**0.5, bias=bias)
    assert torch.equal(want, rmsnorm_silu_ref(x + bias.view(1, -1, 1, 1), gamma, 130**0.5))
    _close(got, want, dtype)
    assert (want - rmsnorm_silu_ref(x, gamma, 130**0.5)).abs().max() > 10 * TOL[dtype]  # the bias matters


BIAS_CASES = ["bias", "bias+res", "bias+res+res_bias", "res(other layout)+res_bias"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BIAS_CASES)
def test_bias_residual_kernel(device, dtype, case):
    """(y + bias) + (r + r_bias) with torch's roundings: bit for bit the reference, in place."""
    dev = "cpu" if device == "interp" else device
    g = torch.Generator().manual_seed(len(case))
    shape = (2, 37, 4, 3) if "other" in case else (1, 144, 3, 5)
    cl = torch.channels_last
    y = (torch.randn(*shape, generator=g) * 3).to(dev, dtype).contiguous(memory_format=cl)
    r = (torch.randn(*shape, generator=g) * 3).to(dev, dtype)
    r = r.contiguous() if "other" in case else r.contiguous(memory_format=cl)
    b = torch.randn(shape[1], generator=g).to(dev, dtype)
    rb = torch.randn(shape[1], generator=g).to(dev, dtype)
    args = {"bias": (b, None, None), "bias+res": (b, r, None), "bias+res+res_bias": (b, r, rb),
            "res(other layout)+res_bias": (None, r, rb)}[case]  # fmt: skip
    want = bias_residual_ref(y, *args)
    out = torch.full_like(y, float("nan"))
    with K.use_backend("triton"):
        got = bias_residual(y, *args, out=out)
        assert got is out and torch.isfinite(got).all()
        assert torch.equal(got, want)
        inplace = y.clone()
        assert bias_residual(inplace, *args, out=inplace) is inplace and torch.equal(inplace, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_resblock_fast_path_folds_the_conv_biases(dtype):
    """The resnet's fast path (convs without bias, biases in the norm / residual passes) equals the
    module (CPU: the launchers' references; CUDA runs the kernels in the VAE tests)."""
    from qwenfast.models.vae import ResidualBlock

    torch.manual_seed(0)
    for cin, cout in ((12, 12), (12, 20)):
        blk = ResidualBlock(cin, cout).to(dtype)
        with torch.no_grad():
            for m in blk.modules():
                if isinstance(m, torch.nn.Conv2d):
                    m.bias.normal_()
        x = torch.randn(2, cin, 5, 7).to(dtype)
        with torch.no_grad():
            _close(blk.forward_fast(x), blk(x), dtype)


@pytest.mark.skipif(not TRITON or INTERP, reason="needs triton; this is the outer process")
def test_interpreter_subprocess(request):
    n = len(interpreter_cases(request))
    assert n == len(DTYPES) * (len(SHAPES) * 4 + 2 + len(BIAS_CASES))  # the kernel cases' parametrisation
    run_interpreter_cases(__file__, at_least=n, exactly=True, timeout=600, select="interp and kernel",
                          allow_skipped=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------- sub-pixel conv


@pytest.mark.parametrize("hw", [(1, 1), (5, 7), (8, 3), (13, 11)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_upsample_conv_equals_interpolate_conv(hw, channels_last):
    g = torch.Generator().manual_seed(hw[0] * 31 + hw[1])
    x = torch.randn(2, 6, *hw, generator=g)
    w, b = torch.randn(5, 6, 3, 3, generator=g), torch.randn(5, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    want = upsample_conv_ref(x, w, b)
    got = upsample_conv(x, subpixel_weights(w), b)
    assert got.shape == (2, 5, 2 * hw[0], 2 * hw[1])
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (
        got.is_contiguous(memory_format=torch.channels_last) == (channels_last and min(hw) > 1)
        or min(hw) == 1
    )
    nob = upsample_conv(x, subpixel_weights(w), None)
    assert (nob - upsample_conv_ref(x, w, None)).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("hw", [(5, 7), (8, 3)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_upsample_conv_adds_phase_planes(hw, channels_last):
    """`add`: four (B, Cout, H, W) planes (here strided channel views, as 2.1's VAE passes them)
    added to output pixels (2i+a, 2j+b) while the phases interleave."""
    g = torch.Generator().manual_seed(hw[0] + 17 * hw[1])
    x = torch.randn(2, 6, *hw, generator=g)
    r = torch.randn(2, 10, *hw, generator=g)
    w, b = torch.randn(5, 6, 3, 3, generator=g), torch.randn(5, generator=g)
    if channels_last:
        x, r = x.contiguous(memory_format=torch.channels_last), r.contiguous(memory_format=torch.channels_last)
    add = [r[:, 0::2], r[:, 1::2], r[:, 0::2], r[:, :5]]
    want = upsample_conv_ref(x, w, b, add)
    got = upsample_conv(x, subpixel_weights(w), b, add)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    moved = (want - upsample_conv_ref(x, w, b)).abs().max()
    assert moved > 100 * 1e-5 * want.abs().max()  # the planes really were added (far beyond the tolerance)
    # phase (0, 1) of the output is conv's phase plus plane 1
    assert torch.allclose(got[:, :, 0::2, 1::2] - upsample_conv_ref(x, w, b)[:, :, 0::2, 1::2], add[1], atol=1e-5)


def test_subpixel_weights_rejects_other_kernels():
    with pytest.raises(ValueError, match="3, 3"):
        subpixel_weights(torch.zeros(4, 4, 5, 5))


# ---------------------------------------------------------------------------------------------- whole VAE

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pair():
    from .test_vae import _make_pair

    return _make_pair(num_res_blocks=1, seed=3)


def _err(a, b):
    assert a.shape == b.shape and torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def test_fast_vae_equals_reference_and_diffusers(pair):
    ref, ours = pair
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 16, 7, 5, generator=g)
    x = torch.rand(2, 3, 56, 40, generator=g) * 2 - 1
    ours.tiling = False
    ours.fast = False
    slow_dec, (slow_m, slow_lv) = ours.decode(z), ours.encode(x)
    ours.fast = True
    dec, (m, lv) = ours.decode(z), ours.encode(x)
    assert _err(dec, slow_dec) < 1e-5 and _err(m, slow_m) < 1e-5 and _err(lv, slow_lv) < 1e-5
    assert _err(dec, ref.decode(z[:, :, None]).sample[:, :, 0]) < 1e-5
    assert _err(m, ref.encode(x[:, :, None]).latent_dist.mean[:, :, 0]) < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("fast", [True, False])
def test_tiled_vae_equals_diffusers_tiled(pair, fast):
    """Same tiles, blend and crop as diffusers' enable_tiling(), on odd latent sizes with partial edge tiles."""
    ref, ours = pair
    ref.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                      tile_sample_stride_height=24, tile_sample_stride_width=24)  # fmt: skip
    try:
        ours.fast, ours.tiling, ours.tile_sample_min, ours.tile_sample_stride = fast, True, 32, 24
        g = torch.Generator().manual_seed(7)
        z = torch.randn(2, 16, 7, 5, generator=g)  # 3 x 2 tiles, partial at the edges
        x = torch.rand(1, 3, 56, 40, generator=g) * 2 - 1
        want = ref.decode(z[:, :, None]).sample[:, :, 0].clamp(-1, 1)
        assert _err(ours.decode(z), want) < 1e-5
        dist = ref.encode(x[:, :, None]).latent_dist
        m, lv = ours.encode(x)
        assert _err(m, dist.mean[:, :, 0]) < 1e-5 and _err(lv, dist.logvar[:, :, 0]) < 1e-5
    finally:
        ref.disable_tiling()
        ours.tiling, ours.tile_sample_min, ours.tile_sample_stride = "auto", 256, 192


@torch.no_grad()
def test_tiling_is_exact_for_a_per_pixel_model(pair, monkeypatch):
    """With a decoder whose output pixel depends on one latent only, tiled == untiled exactly: the
    tile offsets, blend ramps (weights summing to 1 over equal values) and crops are right."""
    _, ours = pair
    w = torch.randn(3, 16)

    def local(z):  # (B, 16, h, w) -> (B, 3, 8h, 8w), per latent
        return torch.einsum("oc,bchw->bohw", w, z).repeat_interleave(8, 2).repeat_interleave(8, 3)

    monkeypatch.setattr(ours, "_decode_tile", local)
    z = torch.randn(1, 16, 17, 9)
    ours.tiling = False
    full = ours.decode(z)
    ours.tiling, ours.tile_sample_min, ours.tile_sample_stride = True, 48, 32
    try:
        torch.testing.assert_close(ours.decode(z), full, rtol=0, atol=1e-6)
    finally:
        ours.tiling, ours.tile_sample_min, ours.tile_sample_stride = "auto", 256, 192


@torch.no_grad()
def test_auto_tiling_threshold(pair, monkeypatch):
    _, ours = pair
    calls = []
    monkeypatch.setattr(
        ours,
        "tiled_decode",
        lambda z: calls.append(z.shape) or torch.zeros(z.shape[0], 3, 8 * z.shape[2], 8 * z.shape[3]),
    )
    ours.tile_above_pixels = 64 * 64
    try:
        ours.decode(torch.randn(1, 16, 8, 8))  # 64x64: not above
        assert not calls
        ours.decode(torch.randn(1, 16, 40, 40))  # 320x320 > 256 and > 64*64
        assert calls == [(1, 16, 40, 40)]
        ours.tile_above_pixels = None  # CPU: auto never tiles without a threshold
        ours.decode(torch.randn(1, 16, 40, 40))
        assert len(calls) == 1
        ours.tiling = "sometimes"
        with pytest.raises(ValueError, match="tiling"):
            ours.decode(torch.randn(1, 16, 40, 40))
    finally:
        ours.tiling, ours.tile_above_pixels = "auto", None
