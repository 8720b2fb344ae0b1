"""Nearest 2x upsample followed by a 3x3 conv (padding 1), computed on the LOW-resolution input.

Why (sub-pixel decomposition): the VAE decoder's upsamplers run `conv3x3(nearest2x(x))`. The
upsampled tensor is 4x the input, written once and read 9 times by the conv, and 9 multiply-adds per
output pixel hit values that are copies of each other. Output pixel (2i+a, 2j+b) only sees low-res
rows {i-1, i} (a=0) or {i, i+1} (a=1) and likewise columns, so each of the four phases (a, b) is a
2x2 conv on the low-res input whose taps are sums of the 3x3 taps:

    rows, a=0: up rows (2i-1, 2i, 2i+1) -> low rows (i-1, i, i)   => taps [w0, w1 + w2] on (i-1, i)
    rows, a=1: up rows (2i, 2i+1, 2i+2) -> low rows (i, i+1, i+1) => taps [w0 + w1, w2] on (i, i+1)

(the conv's zero padding of the upsampled image is the zero padding of the low-res one). The four
phase kernels are stacked into ONE 2x2 conv with 4*Cout outputs run with padding 1 on the
(B, Cin, H, W) input: its (H+1, W+1) output holds every phase, phase (a, b) at offset (a, b).
Multiply-adds drop from 36 to 16 per low-res pixel and channel pair, and no upsampled tensor exists;
one strided copy interleaves the phases into the (B, Cout, 2H, 2W) result (same memory format as x).

Numerics: the summed taps are formed in fp32 and rounded once to the weight dtype, so results equal
the reference up to summation order (fp32: ~1e-6 relative); in bf16 they are as close as two cuDNN
algorithms are to each other, not bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["subpixel_weights", "upsample_conv", "upsample_conv_ref"]

# R[a] maps the 3 vertical taps of the 3x3 kernel to the 2 low-res taps of phase a.
_R = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])  # (2, 2, 3)


def subpixel_weights(w: torch.Tensor) -> torch.Tensor:
    """(Cout, Cin, 3, 3) conv weight -> (4*Cout, Cin, 2, 2): phases (a, b) in order 00, 01, 10, 11."""
    if w.dim() != 4 or tuple(w.shape[2:]) != (3, 3):
        raise ValueError(f"subpixel_weights expects a (Cout, Cin, 3, 3) weight, got {tuple(w.shape)}")
    R = _R.to(w.device)
    k = torch.einsum("ayk,oikl,bxl->aboiyx", R, w.float(), R)  # (2, 2, Cout, Cin, 2, 2)
    return k.reshape(4 * w.shape[0], w.shape[1], 2, 2).to(w.dtype)


def upsample_conv_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, add: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Plain torch: `conv2d(interpolate(x, 2, nearest), w, bias, padding=1)`; (B,Cin,H,W) -> (B,Cout,2H,2W);
    plus `add`'s four (B, Cout, H, W) phase planes interleaved (`pixel_shuffle`) when given."""
    y = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, bias, padding=1)
    if add is None:
        return y
    return y + F.pixel_shuffle(torch.stack(add, dim=2).flatten(1, 2), 2)


def upsample_conv(
    x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor | None, add: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The same as `upsample_conv_ref(x, w, bias, add)` given `w4 = subpixel_weights(w)`; no upsampled tensor.

    x: (B, Cin, H, W) in any memory format -> (B, Cout, 2H, 2W) in x's memory format. `add`: four
    (B, Cout, H, W) tensors (any strides), the values added to phase (a, b) = 00, 01, 10, 11, i.e.
    to output pixel (2i+a, 2j+b): a residual that is a nearest/duplicating upsample of a low-res
    tensor (2.1's VAE shortcut) joins the interleaving copies instead of costing a 4x tensor and an
    add pass of its own. Each output value is rounded once, as in `conv(...) + shortcut`.
    """
    B, _, H, W = x.shape
    co = w4.shape[0] // 4
    y = F.conv2d(x, w4, bias.repeat(4) if bias is not None else None, padding=1)  # (B, 4Co, H+1, W+1)
    y = y.unflatten(1, (4, co))  # (B, 4, Co, H+1, W+1)
    fmt = (
        torch.channels_last
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        else torch.contiguous_format
    )
    out = torch.empty((B, co, 2 * H, 2 * W), dtype=y.dtype, device=y.device, memory_format=fmt)
    o6 = out.unflatten(3, (W, 2)).unflatten(2, (H, 2))  # (B, Co, H, 2, W, 2), a view
    for a in (0, 1):
        for b in (0, 1):
            src, dst = y[:, 2 * a + b, :, a : a + H, b : b + W], o6[:, :, :, a, :, b]
            if add is None:
                dst.copy_(src)
            else:
                torch.add(src, add[2 * a + b], out=dst)
    return out
