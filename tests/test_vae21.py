"""Qwen-Image-2.1's VAE against diffusers' `AutoencoderKLQwenImage21` (CPU, tiny random model): the
reference modules and the fast path (fused RMSNorm+SiLU, sub-pixel upsampling convs, pixel
(un)shuffle shortcuts), in plain and channels-last memory, on odd sizes, RGBA in and out."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qwenfast.models.vae21 import avg_down, avg_down_fast, dup_up, dup_up_phases

from .test_vae_fast import _err  # max |a - b| / max |b|, both finite

diffusers = pytest.importorskip("diffusers")

TOL = 1e-5  # fp32, relative to the output's largest magnitude


@pytest.mark.parametrize("C,cout,ft,fs", [(8, 8, 1, 2), (8, 16, 2, 2), (12, 24, 1, 2), (6, 12, 2, 2), (8, 16, 2, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_avg_down_fast_equals_reference(C, cout, ft, fs, channels_last):
    x = torch.randn(2, C, 10, 6, generator=torch.Generator().manual_seed(C + cout + ft))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert torch.equal(avg_down_fast(x.contiguous(memory_format=fmt), cout, ft, fs), avg_down(x, cout, ft, fs))


@pytest.mark.parametrize("C,cout,ft", [(16, 8, 1), (16, 16, 2), (24, 12, 2), (12, 12, 1), (12, 9, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dup_up_phases_equal_reference(C, cout, ft, channels_last):
    """The phase planes (strided views where the duplication is regular; (12, 9) gathers)."""
    x = torch.randn(2, C, 5, 7, generator=torch.Generator().manual_seed(C + cout + ft))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    owner = nn.Module()
    for _ in range(2):  # the second call reuses the cached plan
        planes = dup_up_phases(owner, x.contiguous(memory_format=fmt), cout, ft)  # phases 00, 01, 10, 11
        assert torch.equal(F.pixel_shuffle(torch.stack(planes, dim=2).flatten(1, 2), 2), dup_up(x, cout, ft, 2))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from qwenfast.loading.folder21 import load_vae21
    from qwenfast.testing.tiny21 import build_vae

    ref = build_vae(seed=4)
    folder = tmp_path_factory.mktemp("vae21")
    ref.save_pretrained(folder)
    return ref, load_vae21(folder, "cpu", torch.float32)


@torch.no_grad()
def test_fast_and_reference_equal_diffusers(pair):
    ref, ours = pair
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 16, 5, 3, generator=g)  # odd latent grid -> 80 x 48 pixels
    x = torch.rand(2, 4, 80, 48, generator=g) * 2 - 1  # RGBA
    want = ref.decode(z[:, :, None]).sample[:, :, 0]
    dist = ref.encode(x[:, :, None]).latent_dist
    want_m, want_lv = dist.mean[:, :, 0], dist.logvar[:, :, 0]
    # sensitivity: a small change of the latents moves diffusers' own pixels far beyond the tolerance
    moved = ref.decode((z + 0.05 * torch.randn(z.shape, generator=g))[:, :, None]).sample[:, :, 0]
    assert _err(moved, want) > 10 * TOL
    for fast in (False, True):
        ours.fast = fast
        assert _err(ours.decode(z), want) < TOL
        m, lv = ours.encode(x)
        assert _err(m, want_m) < TOL and _err(lv, want_lv) < TOL
    ours.fast = True


@torch.no_grad()
def test_fast_path_in_channels_last_memory(pair):
    """What CUDA runs (channels-last weights and activations), here on CPU: the same values."""
    _, ours = pair
    g = torch.Generator().manual_seed(6)
    z = torch.randn(1, 16, 3, 4, generator=g)
    x = torch.rand(1, 4, 48, 64, generator=g) * 2 - 1
    ours.fast = False
    want, (want_m, _) = ours.decode(z), ours.encode(x)
    ours.fast = True
    cl = torch.channels_last
    try:
        ours.to(memory_format=cl)
        got = ours.decoder.forward_fast(ours.post_quant_conv(z).contiguous(memory_format=cl)).clamp(-1, 1)
        h = ours.encoder.forward_fast(x.contiguous(memory_format=cl))
        got_m = ours.quant_conv(h).chunk(2, dim=1)[0]
    finally:
        ours.to(memory_format=torch.contiguous_format)
    assert _err(got, want) < TOL and _err(got_m, want_m) < TOL


@torch.no_grad()
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_on_cuda_equals_diffusers(pair):
    """The CUDA fast path (Triton RMSNorm+SiLU, channels-last cuDNN convs) in fp32 without TF32."""
    import copy

    ref, ours = pair
    ref, ours = copy.deepcopy(ref).cuda(), copy.deepcopy(ours).cuda()
    g = torch.Generator().manual_seed(8)
    z = torch.randn(2, 16, 5, 3, generator=g).cuda()
    x = (torch.rand(1, 4, 80, 48, generator=g) * 2 - 1).cuda()
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        want = ref.decode(z[:, :, None]).sample[:, :, 0]
        want_m = ref.encode(x[:, :, None]).latent_dist.mean[:, :, 0]
        got = ours.decode(z)
        got_m = ours.encode(x)[0]
    finally:
        torch.backends.cudnn.allow_tf32 = old
    assert ours._channels_last
    assert _err(got, want) < 1e-4 and _err(got_m, want_m) < 1e-4
