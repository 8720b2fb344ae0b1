"""The Qwen-Image-2.1 VAE in plain torch: the same function as diffusers' `AutoencoderKLQwenImage21`
for single images (RGBA in and out, 16x spatial compression, 64 latent channels).

2.1's VAE is Wan-2.2's residual design specialised to one frame: its "causal 3D" convolutions are
2D convolutions already, and the temporal parts (time convolutions, the feature cache) never run on
a single frame. What a single frame still sees of time is kept exactly: the averaging shortcut of a
temporally-downsampling block pads one zero frame in front and averages it in, and the duplicating
shortcut of a temporally-upsampling block keeps the last of its two frames. Activations are 4D
(B, C, H, W). Parameter names are diffusers' (time convolutions are dropped at load time, unused).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from .vae import MidBlock, channels_last_input, subpixel_upsample, weight_key
from .vae import ResidualBlock as ResBlock
from .vae import RMSNorm as RMSNorm2d


@dataclass(frozen=True)
class VAE21Config:
    """`AutoencoderKLQwenImage21` config (vae/config.json)."""

    base_dim: int = 96
    decoder_base_dim: int | None = 144
    z_dim: int = 64
    dim_mult: tuple[int, ...] = (1, 2, 4, 8, 8)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = ()
    latents_std: tuple[float, ...] = ()
    is_residual: bool = True
    in_channels: int = 4
    out_channels: int = 4
    patch_size: int | None = None
    scale_factor_temporal: int | None = 8
    scale_factor_spatial: int | None = 16

    @property
    def scale_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    def __post_init__(self):
        if not self.is_residual or self.patch_size not in (None, 1) or self.attn_scales:
            raise ConfigError(
                "vae config: only the residual 2.1 VAE without patchify or attention scales is "
                "supported (is_residual=true, patch_size=null, attn_scales=[])"
            )
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ConfigError(f"vae config: latents_mean/latents_std must have z_dim={self.z_dim} entries")
        if self.scale_factor != (self.scale_factor_spatial or 16):
            raise ConfigError(
                f"vae config: dim_mult gives {self.scale_factor}x, scale_factor_spatial says "
                f"{self.scale_factor_spatial}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> VAE21Config:
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in names)
        if unknown:
            raise ConfigError(
                f"vae/config.json: unknown config fields {unknown}; is this Qwen-Image-2.1's VAE?"
            )
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def avg_down(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """diffusers' AvgDown3D on one frame: (ft - 1) zero frames in front, then the channel-group mean."""
    x = F.pad(x.unsqueeze(2), (0, 0, 0, 0, ft - 1, 0))  # (B, C, ft, H, W)
    B, C, T, H, W = x.shape
    x = x.view(B, C, 1, ft, H // fs, fs, W // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    return x.view(B, cout, C * ft * fs * fs // cout, 1, H // fs, W // fs).mean(dim=2).squeeze(2)


def avg_down_fast(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """`avg_down` in any memory format: pixel_unshuffle puts each (fs x fs) cell's values in the
    channel order (c, i, j) the reference flattens; a zero frame joins each channel's run for ft = 2.
    The same values averaged in the same order. (B, C, H, W) -> (B, cout, H/fs, W/fs)."""
    y = F.pixel_unshuffle(x, fs) if fs > 1 else x  # (B, C fs fs, h, w)
    if ft > 1:
        y5 = y.unflatten(1, (x.shape[1], fs * fs))  # (B, C, fs fs, h, w)
        B, C, s, h, w = y5.shape
        y = torch.cat([y5.new_zeros(()).expand(B, C, (ft - 1) * s, h, w), y5], 2).flatten(1, 2)
    return y.unflatten(1, (cout, y.shape[1] // cout)).mean(dim=2)


def dup_up(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """diffusers' DupUp3D on the first chunk: channel duplication to space (and time), last frame kept."""
    B, C, H, W = x.shape
    x = x.repeat_interleave(cout * ft * fs * fs // C, dim=1).view(B, cout, ft, fs, fs, 1, H, W)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous().view(B, cout, ft, H * fs, W * fs)
    return x[:, :, ft - 1]


def _dup_index(C: int, cout: int, ft: int, fs: int) -> torch.Tensor:
    """Source channel of output channel c, phase (i, j) of `dup_up`, in pixel_shuffle's order c fs fs + i fs + j."""
    s = fs * fs
    rep = cout * ft * s // C
    flat = (torch.arange(cout)[:, None] * ft + ft - 1) * s + torch.arange(s)[None]  # (cout, s), last frame
    return (flat // rep).flatten()


def dup_up_phases(owner: nn.Module, x: torch.Tensor, cout: int, ft: int) -> list[torch.Tensor]:
    """`dup_up(x, cout, ft, 2)` as its four phase planes (B, cout, H, W), phase (a, b) holding output
    pixels (2i+a, 2j+b) (what `upsample_conv`'s `add` takes). 2.1's blocks duplicate channels
    regularly, so each plane is a channel-strided view of x (no copy); other layouts gather. The
    plan (start, step or an index per phase) is cached on `owner`."""
    key = (x.shape[1], cout, ft, x.device)
    cached = owner.__dict__.get("_dup_plan")
    if cached is None or cached[0] != key:
        plan = []
        for col in _dup_index(x.shape[1], cout, ft, 2).view(cout, 4).unbind(1):  # (cout,) per phase
            start, step = int(col[0]), int(col[1] - col[0]) if cout > 1 else 1
            regular = step > 0 and torch.equal(col, start + step * torch.arange(cout))
            plan.append((start, step) if regular else col.to(x.device))
        cached = owner.__dict__["_dup_plan"] = (key, plan)
    return [x[:, p[0] :: p[1]][:, :cout] if isinstance(p, tuple) else x.index_select(1, p) for p in cached[1]]


class Resample(nn.Module):
    """`resample.1` is the convolution (after a 2x nearest-exact upsample, or a (0,1,0,1) pad + stride 2)."""

    def __init__(self, dim: int, mode: str, up_out: int | None = None):
        super().__init__()
        self.mode = mode
        if mode == "up":
            self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, up_out or dim // 2, 3, padding=1))
        else:
            self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, dim, 3, stride=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "up":
            x = F.interpolate(x.float(), scale_factor=2.0, mode="nearest-exact").type_as(x)
        else:
            x = F.pad(x, (0, 1, 0, 1))
        return self.resample[1](x)

    def forward_fast(self, x: torch.Tensor, add: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Upsamplers as sub-pixel convs on the low-res input (nearest-exact 2x = nearest 2x), with
        `add`'s phase planes (the block shortcut) joined in."""
        if self.mode == "up":
            return subpixel_upsample(self, self.resample[1], x, add)
        return self(x)


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n: int, temporal: bool, down: bool):
        super().__init__()
        self.cout, self.ft, self.fs = cout, 2 if temporal else 1, 2 if down else 1
        self.resnets = nn.ModuleList([ResBlock(cin if i == 0 else cout, cout) for i in range(n)])
        self.downsampler = Resample(cout, "down") if down else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = avg_down(x, self.cout, self.ft, self.fs)
        for r in self.resnets:
            x = r(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
        return x + shortcut

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = avg_down_fast(x, self.cout, self.ft, self.fs)
        for r in self.resnets:
            x = r.forward_fast(x)
        if self.downsampler is not None:
            x = self.downsampler.forward_fast(x)
        return x.add_(shortcut)  # a fresh conv output: add in place


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n: int, temporal: bool, up: bool):
        super().__init__()
        self.cout, self.ft, self.up = cout, 2 if temporal else 1, up
        self.resnets = nn.ModuleList([ResBlock(cin if i == 0 else cout, cout) for i in range(n + 1)])
        self.upsampler = Resample(cout, "up", cout) if up else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = dup_up(x, self.cout, self.ft, 2) if self.up else None
        for r in self.resnets:
            x = r(x)
        if self.upsampler is not None:
            x = self.upsampler(x)
        return x if shortcut is None else x + shortcut

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x
        for r in self.resnets:
            x = r.forward_fast(x)
        if self.upsampler is None:
            return x
        # the shortcut (x0 duplicated to 2x) is added while the upsampler interleaves its phases
        return self.upsampler.forward_fast(x, add=dup_up_phases(self, x0, self.cout, self.ft))


class Encoder(nn.Module):
    def __init__(self, cfg: VAE21Config):
        super().__init__()
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        last = len(cfg.dim_mult) - 1
        self.conv_in = nn.Conv2d(cfg.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            [
                DownBlock(
                    a, b, cfg.num_res_blocks, cfg.temperal_downsample[i] if i != last else False, i != last
                )
                for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))
            ]
        )
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm2d(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], 2 * cfg.z_dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        return self.conv_out(F.silu(self.norm_out(self.mid_block(x))))

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b.forward_fast(x)
        return self.conv_out(self.norm_out.forward_fast(self.mid_block.forward_fast(x), silu=True))


class Decoder(nn.Module):
    def __init__(self, cfg: VAE21Config):
        super().__init__()
        base = cfg.decoder_base_dim or cfg.base_dim
        dims = [base * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        tup = cfg.temperal_downsample[::-1]
        last = len(cfg.dim_mult) - 1
        self.conv_in = nn.Conv2d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList(
            [
                UpBlock(a, b, cfg.num_res_blocks, tup[i] if i != last else False, i != last)
                for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))
            ]
        )
        self.norm_out = RMSNorm2d(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], cfg.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(x))
        for b in self.up_blocks:
            x = b(x)
        return self.conv_out(F.silu(self.norm_out(x)))

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid_block.forward_fast(self.conv_in(x))
        for b in self.up_blocks:
            x = b.forward_fast(x)
        return narrow_conv(self, self.conv_out, self.norm_out.forward_fast(x, silu=True))


def narrow_conv(owner: nn.Module, conv: nn.Conv2d, x: torch.Tensor, pad_to: int = 32) -> torch.Tensor:
    """`conv(x)` for a conv with very few output channels (the RGBA output conv), on channels-last
    CUDA input with the output channels zero-padded to `pad_to` (cached on `owner`), then sliced:
    cuDNN picks a far better kernel (H200, 1024², 144 -> 4 channels: 0.6 ms instead of 4.3 ms).
    The same sums; only the accumulation order (rounding) may differ. Elsewhere: `conv(x)`."""
    co = conv.out_channels
    if not (x.is_cuda and co < 8 and x.is_contiguous(memory_format=torch.channels_last)):
        return conv(x)
    w = conv.weight
    key = weight_key(w)
    cached = owner.__dict__.get("_narrow")
    if cached is None or cached[0] != key:
        wp = w.new_zeros((pad_to, *w.shape[1:])).contiguous(memory_format=torch.channels_last)
        wp[:co] = w.detach()
        bp = w.new_zeros(pad_to)
        if conv.bias is not None:
            bp[:co] = conv.bias.detach()
        cached = owner.__dict__["_narrow"] = (key, wp, bp)
    return F.conv2d(x, cached[1], cached[2], conv.stride, conv.padding, conv.dilation, conv.groups)[:, :co]


class QwenImage21VAE(nn.Module):
    """encode: (B, 4, H, W) in [-1, 1] -> posterior mean (B, z, H/16, W/16); decode: the inverse, clamped.

    `fast` (default True), as for Qwen-Image's VAE (`models/vae.py`, whose resnet, norm and mid
    blocks this one shares): fused RMSNorm+SiLU kernels, sub-pixel upsampling convs, the block
    shortcuts as pixel (un)shuffles, and on CUDA channels-last activations and weights. False = the
    reference modules, op for op as diffusers."""

    fast: bool = True

    def __init__(self, cfg: VAE21Config):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quant_conv = nn.Conv2d(2 * cfg.z_dim, 2 * cfg.z_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg)
        self.tiling = False  # read by the OOM back-off (runtime/oom.py); 2.1 decodes untiled

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, logvar) of the posterior, (B, z, h, w) each."""
        x = channels_last_input(self, x)
        h = self.encoder.forward_fast(x) if self.fast else self.encoder(x)
        mean, logvar = self.quant_conv(h).contiguous().chunk(2, dim=1)
        return mean, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        z = channels_last_input(self, self.post_quant_conv(z))
        x = self.decoder.forward_fast(z) if self.fast else self.decoder(z)
        return x.contiguous().clamp(-1.0, 1.0)


def convert_vae21_key(key: str, t: torch.Tensor):
    """diffusers key -> ours; the temporal convolutions (unused on one frame) are dropped. 5D
    (B, C, T, kh, kw) weights from video-style exports are accepted when T == 1."""
    if ".time_conv." in key:
        return None
    if key.endswith(".weight") and t.dim() == 5 and t.shape[2] == 1:
        t = t[:, :, 0]
    if key.endswith(".gamma") and t.dim() == 4:  # (C, 1, 1, 1) channel gains of the 5D resnet norms
        t = t.reshape(t.shape[0], 1, 1)
    return key, t
