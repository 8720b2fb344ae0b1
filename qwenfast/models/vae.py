"""Qwen-Image VAE (a fine-tuned Wan-2.1 video VAE) for single images, in plain 2D torch.

Why 2D: diffusers' `AutoencoderKLQwenImage` is a causal *video* VAE. Every conv is a
`QwenImageCausalConv3d` that pads time with 2*p zeros in FRONT (none behind), and images go through
it as 1-frame videos. With one frame, a (3,3,3) kernel slides over [0, 0, x] exactly once, so only its
LAST temporal slice `w[:, :, -1]` touches real data: the 3D conv is the 2D conv with that slice (1x1x1
convs: their only slice). The temporal resamplers do nothing on frame 0 either: with a feature cache
(diffusers always passes one in `encode`/`decode`), `downsample3d` only stores frame 0 in the cache and
`upsample3d` only marks the cache "Rep" before skipping `time_conv`; so `time_conv` weights are dropped
and `downsample3d`/`upsample3d` behave as `downsample2d`/`upsample2d`. Running real 2D convs on
(B, C, H, W) instead of Conv3d on (B, C, 3, H, W) padded tensors skips 2/3 of the multiply-adds on zeros,
the padded copies, and the per-frame feature cache, and it can use channels-last cuDNN kernels.

Module and parameter names equal diffusers' state-dict keys; only shapes differ (see
`convert_vae_tensor`): 5D conv weights -> 4D, RMS-norm gamma (dim, 1, 1, 1) -> (dim, 1, 1).
Numerics follow diffusers, including for bf16/fp16: RMS norm normalises in fp32, then casts back and
scales in the working dtype in the same order ((x_hat * sqrt(dim)) * gamma).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qwenfast.config import VAEConfig
from qwenfast.kernels.bias_residual import bias_residual
from qwenfast.kernels.rmsnorm_silu import rmsnorm_silu
from qwenfast.kernels.upsample_conv import subpixel_weights, upsample_conv

__all__ = ["QwenImageVAE", "convert_vae_tensor", "convert_vae_state_dict"]

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0  # DiagonalGaussianDistribution's clamp


class RMSNorm(nn.Module):
    """`QwenImageRMS_norm` (channel-first, no bias): x / ||x||_C * sqrt(C) * gamma."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1))  # (C, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        # diffusers normalises half / 8-bit / 4-bit floats in fp32 and casts back before scaling.
        if x.element_size() < 4:
            return F.normalize(x.float(), dim=1).to(x.dtype) * self.scale * self.gamma
        return F.normalize(x, dim=1) * self.scale * self.gamma

    def forward_fast(self, x: torch.Tensor, silu: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`silu(self(x + bias))` (or without SiLU) in one fused pass (`qwenfast.kernels.rmsnorm_silu`);
        `bias`: the bias of the conv that made x, run without it."""
        return rmsnorm_silu(x, self.gamma, self.scale, silu=silu, bias=bias)


class ResidualBlock(nn.Module):
    """`QwenImageResidualBlock`: (RMSNorm, SiLU, conv3x3) x 2 + (1x1 conv) shortcut. Dropout is omitted:
    it is the identity at inference."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = nn.Conv2d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = nn.Conv2d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, Cin, H, W) -> (B, Cout, H, W)
        h = self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(F.silu(self.norm2(x)))
        return x + h

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        """The convs run without their biases; each bias joins the pass that reads the conv's output
        (the next norm, or the residual sum: `kernels/bias_residual.py`), with the same roundings."""
        sc = self.conv_shortcut
        h, hb = (x, None) if isinstance(sc, nn.Identity) else (conv_nobias(sc, x), sc.bias)
        y = conv_nobias(self.conv1, self.norm1.forward_fast(x, silu=True))
        y = conv_nobias(self.conv2, self.norm2.forward_fast(y, silu=True, bias=self.conv1.bias))
        return bias_residual(y, self.conv2.bias, h, hb, out=y)  # y is a fresh tensor: sum in place


def conv_nobias(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """`conv(x)` without its bias (cuDNN adds a bias in a separate pass anyway)."""
    return F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)


class AttentionBlock(nn.Module):
    """`QwenImageAttentionBlock`: single-head self-attention over the H*W positions of each image."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, fast: bool = False) -> torch.Tensor:  # (B, C, H, W)
        identity = x
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm.forward_fast(x, silu=False) if fast else self.norm(x))  # (B, 3C, H, W)
        # flatten+transpose is a view for channels-last input (no copy); equals diffusers' reshape+permute.
        q, k, v = qkv.flatten(2).transpose(1, 2).unsqueeze(1).chunk(3, dim=-1)  # each (B, 1, HW, C)
        x = F.scaled_dot_product_attention(q, k, v)  # (B, 1, HW, C), scale 1/sqrt(C)
        x = x.squeeze(1).transpose(1, 2).reshape(b, c, h, w)  # (B, C, H, W)
        return self.proj(x) + identity


class Upsample2x(nn.Module):
    """`QwenImageUpsample(scale_factor=2, mode="nearest-exact")`.

    For an integer factor 2, nearest-exact picks source index floor((i + 0.5) / 2) = floor(i / 2), the
    same as plain nearest. diffusers upsamples in fp32 and casts back; nearest only copies values, so
    doing it in the working dtype gives bit-identical results without a 4x-size fp32 temporary.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, 2H, 2W)
        return F.interpolate(x, scale_factor=2.0, mode="nearest")


class Resample(nn.Module):
    """`QwenImageResample` for one frame; `resample` is an nn.Sequential so the conv keeps the key
    `resample.1`. Up: nearest 2x then conv3x3 dim -> dim // 2. Down: pad right/bottom by 1 then conv3x3
    stride 2. The "3d" modes' `time_conv` is never applied to frame 0 and is not built."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, dim // 2, 3, padding=1))
        elif mode.startswith("downsample"):
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        else:
            raise ValueError(f"unknown resample mode {mode!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C/2, 2H, 2W) | (B, C, H/2, W/2)
        return self.resample(x)

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        """Upsamplers: four 2x2 convs on the low-res input (`qwenfast.kernels.upsample_conv`), no 4x tensor."""
        if not self.mode.startswith("upsample"):
            return self.resample(x)
        return subpixel_upsample(self, self.resample[1], x)


def subpixel_upsample(
    owner: nn.Module, conv: nn.Conv2d, x: torch.Tensor, add: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """`conv(nearest2x(x))` for a 3x3 `conv` with padding 1, as `upsample_conv` on x (plus its `add`
    phase planes), with the sub-pixel weights cached on `owner` (built once after loading; rebuilt
    if the weight changes)."""
    w = conv.weight
    key = weight_key(w)
    cached = owner.__dict__.get("_subpixel")
    if cached is None or cached[0] != key:
        w4 = subpixel_weights(w.detach())
        if x.is_contiguous(memory_format=torch.channels_last) and x.is_cuda:
            w4 = w4.to(memory_format=torch.channels_last)
        cached = owner.__dict__["_subpixel"] = (key, w4)
    return upsample_conv(x, cached[1], conv.bias, add)


def weight_key(w: torch.Tensor) -> tuple:
    """What identifies a weight's current values for a cache derived from it (rebuilt when it moves
    or changes in place). Inference tensors (weights loaded under torch.inference_mode, as ComfyUI
    runs nodes) have no version counter; they cannot be changed in place outside inference mode."""
    return (w.data_ptr(), 0 if w.is_inference() else w._version, w.dtype, w.device)


def channels_last_input(model: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """The fast VAE paths on CUDA: channels-last weights (converted once) and input."""
    if not (model.fast and t.is_cuda):
        return t
    if not getattr(model, "_channels_last", False):
        model.to(memory_format=torch.channels_last)
        model._channels_last = True
    return t.contiguous(memory_format=torch.channels_last)


class MidBlock(nn.Module):
    """`QwenImageMidBlock(num_layers=1)`: resnet, attention, resnet."""

    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        x = self.resnets[0](x)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attn(x))
        return x

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0].forward_fast(x)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet.forward_fast(attn(x, fast=True))
        return x


class Encoder(nn.Module):
    """`QwenImageEncoder3d`. `down_blocks` is one flat list of resnets, optional attention blocks
    (where the current scale is in `attn_scales`) and downsamplers, indexed exactly like diffusers."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        scale = 1.0
        self.conv_in = nn.Conv2d(cfg.input_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                self.down_blocks.append(ResidualBlock(in_dim, out_dim))
                if scale in cfg.attn_scales:
                    self.down_blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != len(cfg.dim_mult) - 1:
                mode = "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"
                self.down_blocks.append(Resample(out_dim, mode))
                scale /= 2.0
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], cfg.z_dim * 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 2z, H/8, W/8)
        x = self.conv_in(x)
        for layer in self.down_blocks:
            x = layer(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for layer in self.down_blocks:
            x = layer(x, fast=True) if isinstance(layer, AttentionBlock) else layer.forward_fast(x)
        x = self.mid_block.forward_fast(x)
        return self.conv_out(self.norm_out.forward_fast(x, silu=True))


class UpBlock(nn.Module):
    """`QwenImageUpBlock`: num_res_blocks + 1 resnets, then an optional 2x upsampler."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample_mode: str | None):
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList([ResidualBlock(d, out_dim) for d in dims])
        self.upsamplers = None
        if upsample_mode is not None:
            self.upsamplers = nn.ModuleList([Resample(out_dim, upsample_mode)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, Cin, H, W) -> (B, Cout[/2], H[*2], W[*2])
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet.forward_fast(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0].forward_fast(x)
        return x


class Decoder(nn.Module):
    """`QwenImageDecoder3d`. Like diffusers, the decoder has no attention outside its mid block
    (diffusers' decoder ignores `attn_scales`)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.base_dim * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temperal_upsample = cfg.temperal_downsample[::-1]
        self.conv_in = nn.Conv2d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                in_dim = in_dim // 2  # the previous upsampler halved the channels
            mode = None
            if i != len(cfg.dim_mult) - 1:
                mode = "upsample3d" if temperal_upsample[i] else "upsample2d"
            self.up_blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, mode))
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], cfg.input_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, z, h, w) -> (B, 3, 8h, 8w)
        x = self.mid_block(self.conv_in(x))
        for up_block in self.up_blocks:
            x = up_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid_block.forward_fast(self.conv_in(x))
        for up_block in self.up_blocks:
            x = up_block.forward_fast(x)
        return self.conv_out(self.norm_out.forward_fast(x, silu=True))


class QwenImageVAE(nn.Module):
    """Single-image `AutoencoderKLQwenImage`: images (B, 3, H, W) in [-1, 1] <-> latents (B, z, H/8, W/8).

    Latents are the raw VAE latents (what `vae.encode(...).latent_dist` gives and `vae.decode` takes);
    the pipeline's normalisation with `latents_mean` / `latents_std` is not applied here.

    Speed switches (plain attributes, no reload needed):
    - `fast` (default True): fused RMSNorm+SiLU kernels, sub-pixel upsampling convs, and on CUDA
      channels-last activations and weights (cuDNN's NHWC kernels). False = the reference modules.
    - `tiling`: "auto" (default; tiles when the memory planner says an untiled pass would not fit in
      90% of free GPU memory, or above `tile_above_pixels` output pixels when set), True, or False.
      Tiles are `tile_sample_min` pixels with stride `tile_sample_stride` and linearly blended
      overlaps, as diffusers' `enable_tiling()` (256 / 192). Tiled output differs from untiled at
      the seams (the mid-block attention is global), as it does in diffusers.
    - `untiled_oom`: output pixels of the smallest untiled decode that ran out of memory and was retried
      tiled (`runtime.oom.vae_decode`); "auto" then tiles decodes that large without trying again
      (an OOM costs a garbage collection and the allocator's cache). None: try; a pipeline's
      `configure` resets it.
    """

    fast: bool = True
    tiling: bool | str = "auto"
    tile_sample_min: int = 256
    tile_sample_stride: int = 192
    tile_above_pixels: int | None = None
    untiled_oom: int | None = None

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        if len(cfg.temperal_downsample) < len(cfg.dim_mult) - 1:
            raise ValueError(
                f"vae config: temperal_downsample {cfg.temperal_downsample} needs {len(cfg.dim_mult) - 1} entries"
            )
        self.cfg = cfg
        self.z_dim = cfg.z_dim
        self.spatial_compression_ratio = 2 ** (len(cfg.dim_mult) - 1)
        self.encoder = Encoder(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_dim * 2, cfg.z_dim * 2, 1)
        self.post_quant_conv = nn.Conv2d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) in [-1, 1] -> (mean, logvar), each (B, z, H/8, W/8); logvar clamped to [-30, 20]."""
        if x.ndim != 4:
            raise ValueError(f"QwenImageVAE.encode expects (B, C, H, W) images, got shape {tuple(x.shape)}")
        if self._want_tiling(x.shape[0], x.shape[2], x.shape[3], x.dtype, encode=True):
            h = self.tiled_encode(x)
        else:
            h = self._encode_tile(x)  # (B, 2z, H/8, W/8)
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(B, z, h, w) latents -> (B, 3, 8h, 8w) images clamped to [-1, 1]."""
        if z.ndim != 4:
            raise ValueError(f"QwenImageVAE.decode expects (B, z, h, w) latents, got shape {tuple(z.shape)}")
        if self.decode_tiles(z):
            return self.tiled_decode(z).clamp(-1.0, 1.0)
        return self.decode_untiled(z)

    def decode_tiles(self, z: torch.Tensor) -> bool:
        """Whether `decode(z)` tiles (see `tiling`)."""
        r = self.spatial_compression_ratio
        return self._want_tiling(z.shape[0], z.shape[2] * r, z.shape[3] * r, z.dtype, encode=False)

    def decode_untiled(self, z: torch.Tensor) -> torch.Tensor:
        """`decode` in one piece, whatever `tiling` says (what `runtime.cuda_graphs.DecodeGraphs` captures)."""
        return self._decode_tile(z).clamp(-1.0, 1.0)

    # ------------------------------------------------------------ fast path and tiling
    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        return channels_last_input(self, t)

    def _encode_tile(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 2z, H/8, W/8), contiguous
        x = self._prepare(x)
        h = self.encoder.forward_fast(x) if self.fast else self.encoder(x)
        return self.quant_conv(h).contiguous()

    def _decode_tile(self, z: torch.Tensor) -> torch.Tensor:  # (B, z, h, w) -> (B, 3, 8h, 8w), unclamped
        z = self._prepare(self.post_quant_conv(z))
        return (self.decoder.forward_fast(z) if self.fast else self.decoder(z)).contiguous()

    def _want_tiling(self, b: int, height: int, width: int, dtype: torch.dtype, encode: bool) -> bool:
        """Whether this call tiles: `tiling` True/False, or "auto" from `tile_above_pixels` / the memory planner."""
        if self.tiling is True or self.tiling is False:
            return self.tiling
        if self.tiling != "auto":
            raise ValueError(f"vae.tiling must be True, False or 'auto', got {self.tiling!r}")
        if height <= self.tile_sample_min and width <= self.tile_sample_min:
            return False
        if self.tile_above_pixels is not None:
            return height * width > self.tile_above_pixels
        if not encode and self.untiled_oom is not None and height * width >= self.untiled_oom:
            return True
        dev = next(self.parameters()).device
        if dev.type != "cuda":
            return False
        from qwenfast.runtime.memory import default_budget, vae_activation_bytes

        need = vae_activation_bytes(self.cfg, b, height, width, dtype, encode=encode, fast=self.fast)
        return need > default_budget(dev, include_allocated=False)

    def tiled_decode(self, z: torch.Tensor) -> torch.Tensor:
        """Decode overlapping latent tiles one at a time and blend the seams linearly (unclamped output).

        Same tiles, blend and crop as diffusers' `AutoencoderKLQwenImage.tiled_decode` (tiles of
        `tile_sample_min` pixels every `tile_sample_stride`; each tile blends into the one above and the
        one to its left over the overlap). Only the previous row of decoded tiles is kept, and each
        finished (stride x stride) piece is written straight into the output, so peak memory is one
        row of tiles plus the image, whatever the size.
        """
        r = self.spatial_compression_ratio
        tmin, stride = self.tile_sample_min // r, self.tile_sample_stride // r  # latent units
        blend = self.tile_sample_min - self.tile_sample_stride  # pixels
        return self._tiled(
            z, self._decode_tile, tmin, stride, self.tile_sample_stride, blend, r, self.cfg.input_channels
        )

    def tiled_encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode overlapping image tiles and blend the latent seams: (B, 3, H, W) -> (B, 2z, H/8, W/8) raw
        (before the mean/logvar split), as diffusers' `tiled_encode`."""
        r = self.spatial_compression_ratio
        smin, sstride = self.tile_sample_min, self.tile_sample_stride
        blend = smin // r - sstride // r
        return self._tiled(x, self._encode_tile, smin, sstride, sstride // r, blend, 1 / r, 2 * self.z_dim)

    @staticmethod
    def _tiled(x, fn, tmin: int, stride: int, out_stride: int, blend: int, ratio: float, out_ch: int):
        """Shared tile loop. x: (B, C, H, W); tiles x[..., i:i+tmin, j:j+tmin] every `stride` (input
        units); fn(tile) is `ratio` times larger; `out_stride` / `blend` are in output units."""
        B, _, H, W = x.shape
        oh, ow = int(H * ratio), int(W * ratio)
        out = None
        prev_row: list[torch.Tensor] | None = None
        for oi, i in enumerate(range(0, H, stride)):
            row: list[torch.Tensor] = []
            for oj, j in enumerate(range(0, W, stride)):
                tile = fn(x[:, :, i : i + tmin, j : j + tmin])
                if out is None:
                    out = torch.empty((B, out_ch, oh, ow), dtype=tile.dtype, device=tile.device)
                if prev_row is not None:
                    tile = _blend(prev_row[oj], tile, blend, dim=2)
                if oj > 0:
                    tile = _blend(row[oj - 1], tile, blend, dim=3)
                row.append(tile)
                y0, x0 = oi * out_stride, oj * out_stride
                piece = tile[:, :, :out_stride, :out_stride][:, :, : oh - y0, : ow - x0]
                out[:, :, y0 : y0 + piece.shape[2], x0 : x0 + piece.shape[3]] = piece
            prev_row = row
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction through the posterior mode, like diffusers' `forward(sample_posterior=False)`."""
        return self.decode(self.encode(x)[0])


def _blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """diffusers' `blend_v` (dim 2) / `blend_h` (dim 3), in place on b: the first `extent` rows/columns of
    b become a's last ones * (1 - y/extent) + b's * y/extent. Returns b."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    ramp = torch.arange(extent, device=b.device, dtype=torch.float32) / extent  # y / extent
    shape = [1, 1, 1, 1]
    shape[dim] = extent
    ramp = ramp.view(shape)
    head = b.narrow(dim, 0, extent)
    tail = a.narrow(dim, a.shape[dim] - extent, extent)
    head.copy_(tail.float() * (1 - ramp) + head.float() * ramp)
    return b


def convert_vae_tensor(key: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """One diffusers `AutoencoderKLQwenImage` tensor -> (key, tensor) in our layout, or None to drop it.

    - `...time_conv.*`: dropped (never applied to a single frame).
    - 5D causal-conv weights (O, I, T, kh, kw): the last temporal slice, the only one that sees the
      frame after the causal front padding -> (O, I, kh, kw). For T == 1 that is slice 0.
    - RMS-norm gammas (C, 1, 1, 1): -> (C, 1, 1). Attention-norm gammas are already (C, 1, 1).
    Everything else (biases, 2D resample / attention convs) is unchanged. Keys are never renamed.
    """
    if "time_conv" in key.split("."):
        return None
    if t.ndim == 5:
        return key, t[:, :, -1].contiguous()
    if key.endswith(".gamma") and t.ndim == 4:
        return key, t.reshape(t.shape[0], 1, 1)
    return key, t


def convert_vae_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole diffusers VAE state dict -> a state dict for `QwenImageVAE.load_state_dict(strict=True)`."""
    out = {}
    for key, t in sd.items():
        converted = convert_vae_tensor(key, t)
        if converted is not None:
            out[converted[0]] = converted[1]
    return out
