"""The VAE's key names in Wan / ComfyUI single files <-> diffusers' `AutoencoderKLQwenImage` names
(loading/single_file.py reads the files; tests write Wan files with the inverse map)."""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["wan_to_diffusers_vae_keys", "diffusers_to_wan_vae_keys"]


_RES = (("residual.0.", "norm1."), ("residual.2.", "conv1."), ("residual.3.", "norm2."), ("residual.6.", "conv2."),
        ("shortcut.", "conv_shortcut."))  # fmt: skip


def _swap(tail: str, pairs) -> str | None:
    for old, new in pairs:
        if tail.startswith(old):
            return new + tail[len(old) :]
    return None


def wan_to_diffusers_vae_keys(keys: Collection[str]) -> tuple[dict[str, str], list[str]]:
    """Wan / ComfyUI VAE keys -> diffusers `AutoencoderKLQwenImage` keys; (mapping, keys not understood).

    Wan keeps the decoder's up path as one flat list `decoder.upsamples.N` (resnets of up block 0, its
    upsampler, resnets of block 1, ...); diffusers groups it as `up_blocks.B.resnets.J` /
    `up_blocks.B.upsamplers.0`. The grouping is read from the keys, so any depth / num_res_blocks works.
    The encoder's `downsamples.N` list keeps its flat numbering as `down_blocks.N`.
    """
    kinds = {}
    for k in keys:
        if m := re.match(r"decoder\.upsamples\.(\d+)\.(residual|shortcut|resample|time_conv)\.", k):
            kinds[int(m.group(1))] = "up" if m.group(2) in ("resample", "time_conv") else "res"
    place, b, j = {}, 0, 0
    for n in sorted(kinds):
        if kinds[n] == "res":
            place[n], j = f"decoder.up_blocks.{b}.resnets.{j}", j + 1
        else:
            place[n], b, j = f"decoder.up_blocks.{b}.upsamplers.0", b + 1, 0
    out, unknown = {}, []
    for k in keys:
        new = _wan_key(k, place)
        if new is None:
            unknown.append(k)
        else:
            out[k] = new
    return out, unknown


def _wan_key(k: str, place: dict[int, str]) -> str | None:
    top = _swap(k, (("conv1.", "quant_conv."), ("conv2.", "post_quant_conv.")))
    if top:
        return top
    side, _, rest = k.partition(".")
    if side not in ("encoder", "decoder"):
        return None
    simple = _swap(rest, (("conv1.", "conv_in."), ("head.0.", "norm_out."), ("head.2.", "conv_out.")))
    if simple:
        return f"{side}.{simple}"
    if m := re.match(r"middle\.([012])\.(.+)", rest):
        i, tail = int(m.group(1)), m.group(2)
        if i == 1:
            return f"{side}.mid_block.attentions.0.{tail}"
        res = _swap(tail, _RES)
        return res and f"{side}.mid_block.resnets.{i // 2}.{res}"
    if side == "encoder" and (m := re.match(r"downsamples\.(\d+)\.(.+)", rest)):
        return f"encoder.down_blocks.{m.group(1)}.{_swap(m.group(2), _RES) or m.group(2)}"
    if side == "decoder" and (m := re.match(r"upsamples\.(\d+)\.(.+)", rest)) and int(m.group(1)) in place:
        base, tail = place[int(m.group(1))], m.group(2)
        return f"{base}.{_swap(tail, _RES) if '.resnets.' in base else tail}"
    return None


def diffusers_to_wan_vae_keys(keys: Collection[str]) -> dict[str, str]:
    """The inverse of `wan_to_diffusers_vae_keys` (diffusers key -> Wan key); used to write Wan files in tests."""
    inv = tuple((new, old) for old, new in _RES)
    blocks: dict[int, list[int]] = {}  # up block -> [number of resnets, has upsampler]
    for k in keys:
        if m := re.match(r"decoder\.up_blocks\.(\d+)\.(?:resnets\.(\d+)|(upsamplers)\.0)\.", k):
            e = blocks.setdefault(int(m.group(1)), [0, 0])
            e[0] = max(e[0], int(m.group(2)) + 1) if m.group(2) else e[0]
            e[1] = e[1] or bool(m.group(3))
    start, n = {}, 0
    for b in sorted(blocks):
        start[b], n = n, n + blocks[b][0] + blocks[b][1]
    out = {}
    for k in keys:
        new = _swap(k, (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2.")))
        side, _, rest = k.partition(".")
        if new is None:
            new = _swap(rest, (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")))
            new = new and f"{side}.{new}"
        if new is None and (m := re.match(r"mid_block\.(resnets|attentions)\.(\d)\.(.+)", rest)):
            i = 1 if m.group(1) == "attentions" else 2 * int(m.group(2))
            new = f"{side}.middle.{i}.{_swap(m.group(3), inv) if i != 1 else m.group(3)}"
        if new is None and (m := re.match(r"down_blocks\.(\d+)\.(.+)", rest)):
            new = f"{side}.downsamples.{m.group(1)}.{_swap(m.group(2), inv) or m.group(2)}"
        if new is None and (m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)):
            new = f"{side}.upsamples.{start[int(m.group(1))] + int(m.group(2))}.{_swap(m.group(3), inv)}"
        if new is None and (m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest)):
            b = int(m.group(1))
            new = f"{side}.upsamples.{start[b] + blocks[b][0]}.{m.group(2)}"
        if new is None:
            raise KeyError(f"not a diffusers Qwen-Image VAE key: {k}")
        out[k] = new
    return out
