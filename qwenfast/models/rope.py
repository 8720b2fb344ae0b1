"""RoPE of the Qwen-Image transformers: 3-axis (frame, height, width) angles for the image tokens, text
positions after the largest half-side, as diffusers computes them (the fp32 angles bitwise equal), kept on
the device per shape so a step copies nothing from the host (and CUDA graphs read fixed tables)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch


def _axis_angles(pos: torch.Tensor, dim: int, theta: float = 10000.0) -> torch.Tensor:
    # Same expression as diffusers' rope_params, so the fp32 angles are bitwise equal.
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float32).div(dim))
    return torch.outer(pos.to(torch.float32), inv)  # (S, dim/2)


def _centred(n: int) -> torch.Tensor:
    # scale_rope: positions -(n - n//2) .. n//2 - 1, image centred on the origin
    return torch.arange(-(n - n // 2), n // 2)


@lru_cache(maxsize=64)
def _rope_tables_cpu(
    axes: tuple[int, int, int],
    img_shapes: tuple[tuple[int, int, int], ...],
    txt_len: int,
    layer3d: bool = False,
):
    parts, max_idx = [], 0
    last = len(img_shapes) - 1
    for idx, (f, h, w) in enumerate(img_shapes):
        # Layered (layer3d): the last image is the condition image, at frame position -1
        frames = torch.full((f,), -1) if layer3d and idx == last else torch.arange(idx, idx + f)
        grid = torch.meshgrid(frames, _centred(h), _centred(w), indexing="ij")
        ang = [_axis_angles(g.reshape(-1), d) for g, d in zip(grid, axes)]
        parts.append(torch.cat(ang, dim=-1))  # (f*h*w, D/2)
        max_idx = max(max_idx, h // 2, w // 2)
    if layer3d:
        max_idx = max(max_idx, last)
    img = torch.cat(parts, dim=0)
    tpos = torch.arange(max_idx, max_idx + txt_len)
    txt = torch.cat([_axis_angles(tpos, d) for d in axes], dim=-1)  # (L_txt, D/2)
    return img.cos(), img.sin(), txt.cos(), txt.sin()


def rope_tables(
    axes: Sequence[int],
    img_shapes: Sequence[Sequence[int]],
    txt_len: int,
    device: torch.device | str,
    layer3d: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(img_cos, img_sin, txt_cos, txt_sin), each (S, head_dim/2) fp32 on `device`.

    `img_shapes` lists (frames, h, w) in patch units for every image whose tokens are in the
    sequence (the noise image first, then reference images for edit models); text positions start
    after the largest half-side, as in diffusers.
    """
    key = (tuple(axes), tuple(tuple(int(v) for v in s) for s in img_shapes), int(txt_len), bool(layer3d))
    dkey = (key, str(torch.device(device)))
    if dkey not in _ROPE_DEVICE:  # cached on the device: no host copy per step (and CUDA-graph safe)
        if len(_ROPE_DEVICE) >= 64:
            _ROPE_DEVICE.pop(next(iter(_ROPE_DEVICE)))
        _ROPE_DEVICE[dkey] = tuple(t.to(device) for t in _rope_tables_cpu(*key))
    return _ROPE_DEVICE[dkey]


_ROPE_DEVICE: dict = {}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x (B, S, H, D) by the angles in cos/sin (S, D/2)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, S, H, D/2, 2)
    xe, xo = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([xe * c - xo * s, xe * s + xo * c], dim=-1)
    return out.flatten(-2).type_as(x)
