"""qwenfast's 2D single-image VAE against diffusers' `AutoencoderKLQwenImage` (CPU, tiny random models).

Every gamma and bias is randomised (diffusers initialises gammas to 1 and some biases to 0, which would
hide a missing norm scale or bias), inputs are non-square and batched.
"""

from __future__ import annotations

import pytest
import torch

from qwenfast.config import VAEConfig
from qwenfast.models.vae import QwenImageVAE, convert_vae_state_dict, convert_vae_tensor

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLQwenImage  # noqa: E402

TOL = 1e-5


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert not torch.isnan(ours).any() and not torch.isnan(ref).any()
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _make_pair(num_res_blocks: int = 1, attn_scales=(), seed: int = 0):
    torch.manual_seed(seed)
    ref = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=num_res_blocks,
        attn_scales=list(attn_scales),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))  # (0.5, 1.5)
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    ours = QwenImageVAE(VAEConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(convert_vae_state_dict(ref.state_dict()), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def pair():
    return _make_pair(num_res_blocks=2)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, 48, 80, generator=g) * 2 - 1  # (B, 3, H, W) in [-1, 1]
    z = torch.randn(2, 16, 6, 10, generator=g)  # (B, z, h, w)
    return x, z


@torch.no_grad()
def test_encode_matches_diffusers(pair):
    ref, ours = pair
    x, _ = _inputs()
    dist = ref.encode(x[:, :, None]).latent_dist
    mean, logvar = ours.encode(x)
    assert mean.shape == logvar.shape == (2, 16, 6, 10)
    assert _rel_err(mean, dist.mean[:, :, 0]) < TOL
    assert _rel_err(logvar, dist.logvar[:, :, 0]) < TOL


@torch.no_grad()
def test_decode_matches_diffusers(pair):
    ref, ours = pair
    _, z = _inputs()
    want = ref.decode(z[:, :, None]).sample[:, :, 0]
    got = ours.decode(z)
    assert got.shape == (2, 3, 48, 80)
    assert got.abs().max() <= 1.0
    assert _rel_err(got, want) < TOL
    # Not trivially saturated by the clamp: a good fraction of pixels lies strictly inside (-1, 1).
    assert (want.abs() < 0.99).float().mean() > 0.2


@torch.no_grad()
def test_logvar_clamp():
    ref, ours = _make_pair(num_res_blocks=1, seed=3)
    with torch.no_grad():  # push the logvar half of quant_conv's output far below -30
        for m in (ref, ours):
            m.quant_conv.bias[16:] -= 1e3
    x, _ = _inputs(1)
    dist = ref.encode(x[:, :, None]).latent_dist
    _, logvar = ours.encode(x)
    assert torch.equal(logvar, torch.full_like(logvar, -30.0))
    assert _rel_err(logvar, dist.logvar[:, :, 0]) < TOL


@torch.no_grad()
def test_encoder_attention_blocks():
    """attn_scales non-empty adds attention blocks to the encoder's down path. diffusers' `encode` cannot
    run such a model (its encoder passes the feature cache to the attention block, a TypeError), so we
    compare with its encoder's cache-free path, which equals `encode` for a single frame (checked first on
    the attention-free model)."""
    ref0, _ = _make_pair(num_res_blocks=1, seed=5)
    x, z = _inputs(2)
    via_encode = ref0.encode(x[:, :, None]).latent_dist.mean
    cache_free = ref0.quant_conv(ref0.encoder(x[:, :, None])).chunk(2, dim=1)[0]
    assert torch.equal(via_encode, cache_free)

    ref, ours = _make_pair(num_res_blocks=1, attn_scales=(1.0, 0.5), seed=6)
    assert sum(type(b).__name__ == "AttentionBlock" for b in ours.encoder.down_blocks) == 2
    with pytest.raises(TypeError):
        ref.encode(x[:, :, None])
    h = ref.quant_conv(ref.encoder(x[:, :, None]))[:, :, 0]
    mean, logvar = ours.encode(x)
    assert _rel_err(mean, h[:, :16]) < TOL
    assert _rel_err(logvar, h[:, 16:].clamp(-30, 20)) < TOL
    assert _rel_err(ours.decode(z), ref.decode(z[:, :, None]).sample[:, :, 0]) < TOL


@torch.no_grad()
def test_bf16_matches_diffusers(pair):
    """bf16 cannot be bit-equal (Conv3d on zero-padded frames sums in another order than Conv2d), so we
    check that our bf16 output is within a few bf16 ulps of diffusers' bf16 output (2 ulps measured) and
    as close to the fp32 result as diffusers' own bf16 output (same rounding points, e.g. fp32 RMS norm)."""
    ref, ours = pair
    x, z = _inputs()
    want_dec = ref.decode(z[:, :, None]).sample[:, :, 0]  # fp32 truth
    want_enc = ref.encode(x[:, :, None]).latent_dist.mean[:, :, 0]
    ref_bf, ours_bf = ref.to(torch.bfloat16), QwenImageVAE(ours.cfg).to(torch.bfloat16)
    try:
        ours_bf.load_state_dict(convert_vae_state_dict(ref_bf.state_dict()), strict=True)
        cases = [
            (ours_bf.decode(z.bfloat16()), ref_bf.decode(z[:, :, None].bfloat16()).sample[:, :, 0], want_dec),
            (
                ours_bf.encode(x.bfloat16())[0],
                ref_bf.encode(x[:, :, None].bfloat16()).latent_dist.mean[:, :, 0],
                want_enc,
            ),
        ]
    finally:
        ref.float()
    for got, ref_bf_out, truth in cases:
        assert got.dtype == torch.bfloat16
        # outputs live on a [-1, 1] scale: absolute tolerance there (decode peaks at ~0.5 here)
        assert (got.float() - ref_bf_out.float()).abs().max() < 2e-2 * max(1.0, ref_bf_out.abs().max().item())
        ours_err = (got.float() - truth).abs().mean()
        ref_err = (ref_bf_out.float() - truth).abs().mean()
        assert ours_err <= 1.25 * ref_err + 1e-5, (ours_err, ref_err)


def test_convert_tensor_shapes():
    assert (
        convert_vae_tensor("decoder.up_blocks.0.upsamplers.0.time_conv.weight", torch.zeros(8, 4, 3, 1, 1))
        is None
    )
    assert convert_vae_tensor("encoder.down_blocks.4.time_conv.bias", torch.zeros(8)) is None
    w = torch.randn(8, 4, 3, 3, 3)
    k, t = convert_vae_tensor("encoder.conv_in.weight", w)
    assert k == "encoder.conv_in.weight" and t.shape == (8, 4, 3, 3) and torch.equal(t, w[:, :, 2])
    _, t = convert_vae_tensor("quant_conv.weight", torch.randn(8, 8, 1, 1, 1))
    assert t.shape == (8, 8, 1, 1)
    _, t = convert_vae_tensor("decoder.norm_out.gamma", torch.randn(8, 1, 1, 1))
    assert t.shape == (8, 1, 1)
    _, t = convert_vae_tensor("decoder.mid_block.attentions.0.norm.gamma", torch.randn(8, 1, 1))
    assert t.shape == (8, 1, 1)


@torch.no_grad()
def test_wrong_conversion_is_caught(pair):
    """Sensitivity check: temporal slice 0 instead of -1 (the slice that only ever sees the causal zero
    padding) must produce a large difference, so the tolerances above are meaningful."""
    ref, ours = pair
    x, z = _inputs()
    sd = {k: (v[:, :, 0] if v.ndim == 5 else v) for k, v in ref.state_dict().items()}
    wrong = QwenImageVAE(ours.cfg).eval()
    wrong.load_state_dict(convert_vae_state_dict(sd), strict=True)
    assert _rel_err(wrong.decode(z), ref.decode(z[:, :, None]).sample[:, :, 0]) > 1e-2
    assert _rel_err(wrong.encode(x)[0], ref.encode(x[:, :, None]).latent_dist.mean[:, :, 0]) > 1e-2
