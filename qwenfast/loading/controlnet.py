"""Loading Qwen-Image ControlNets: diffusers folders and the InstantX / ComfyUI single files.

Layouts (all hold diffusers' `QwenImageControlNetModel` key names, Q/K/V separate or fused):
- a diffusers ControlNet folder (InstantX/Qwen-Image-ControlNet-Union, -Inpainting on the Hub):
  `config.json` + `diffusion_pytorch_model.safetensors` (or shards + index);
- a pipeline folder's `controlnet/` subfolder (a saved `QwenImageControlNetPipeline`);
- a single `.safetensors` file, e.g. ComfyUI's `Qwen-Image-InstantX-ControlNet-Union.safetensors`
  (the InstantX weights without config.json), bare keys or prefixed `controlnet.` /
  `control_model.`; bf16 or FP8 (scaled or not, `fp8.plan_quantization`). The config is read from
  the tensor shapes: layers from `transformer_blocks.N`, heads from the Q-norm width, the inpainting
  mask channels from `controlnet_x_embedder`'s input width; RoPE axes from the head dim.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..config import ControlNetConfig
from .fp8 import plan_quantization, read_header
from .single_file import ASK, ROPE_AXES_BY_HEAD_DIM, Source, _make_config, _not_this, _split_prefix
from .weights import CheckpointError, QKVFuser, iter_safetensors, load_streaming, weight_files

log = logging.getLogger("qwenfast")

CONTROLNET_PREFIXES = ("controlnet.", "control_model.")
WEIGHTS_STEM = "diffusion_pytorch_model"


def controlnet_folder(path: Path) -> Path | None:
    """The folder holding the ControlNet's config.json (path itself or its `controlnet/`), else None."""
    for d in (path, path / "controlnet"):
        if (d / "config.json").is_file():
            return d
    return None


def load_controlnet(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    config: ControlNetConfig | dict | str | Path | None = None,
    axes_dims_rope: tuple[int, int, int] | None = None,
    model_class: type | None = None,
):
    """A diffusers ControlNet folder or a single file -> `QwenImageControlNetModel` (or `model_class`, a subclass of
    X

    `axes_dims_rope`: for single files whose head dim is not Qwen-Image's, the RoPE axes (not stored in
    the weights; a pipeline passes its transformer's, which the ControlNet must share)."""
    from ..models.controlnet import QwenImageControlNetModel
    from ..models.transformer import fuse_qkv_key
    from .diffusers_folder import read_json

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"ControlNet {p}: no such file or folder")
    fuser = QKVFuser(fuse_qkv_key)
    if p.is_dir():
        d = controlnet_folder(p)
        if d is None:
            raise CheckpointError(
                f"{p} holds no ControlNet: expected config.json + {WEIGHTS_STEM}.safetensors "
                "(a diffusers ControlNet folder such as InstantX/Qwen-Image-ControlNet-Union), "
                "a controlnet/ subfolder, or pass the .safetensors file itself"
            )
        raw = read_json(d / "config.json")
        cls = raw.get("_class_name", "QwenImageControlNetModel")
        if cls != "QwenImageControlNetModel":
            raise CheckpointError(
                f"{d}/config.json: {cls!r} is not a Qwen-Image ControlNet (QwenImageControlNetModel)"
            )
        cfg = _make_config(ControlNetConfig, {}, raw if config is None else config, "controlnet", d)
        items = iter_safetensors(weight_files(d, WEIGHTS_STEM), device)
        where, convert = str(d), fuser
    else:
        src, cfg = inspect_controlnet(p, config, axes_dims_rope)
        log.info("loading %s", src.describe())
        items, where = src.items(device, dtype), str(p)

        def convert(key: str, t: torch.Tensor):
            name = src.names.get(key)
            return None if name is None else fuser(name, t)

        convert.check_done = fuser.check_done
    with torch.device("meta"):
        model = (model_class or QwenImageControlNetModel)(cfg)
    return load_streaming(model, items, dtype=dtype, where=where, convert=convert)


def inspect_controlnet(path: Path | str, config=None, axes_dims_rope=None) -> tuple[Source, ControlNetConfig]:
    """Header, layout and config of a ControlNet single file (nothing loaded)."""
    header = read_header(path, "ControlNet")
    quant = plan_quantization(header)
    keys = [k for k in header.dtypes if k not in quant.aux]
    prefix, keys = _split_prefix(keys, CONTROLNET_PREFIXES)
    names = {k: k[len(prefix) :] for k in keys}
    shapes = {n: header.shapes[k] for k, n in names.items()}
    if "controlnet_x_embedder.weight" not in shapes or "controlnet_blocks.0.weight" not in shapes:
        raise CheckpointError(
            _not_this(
                header,
                keys,
                "a Qwen-Image ControlNet (InstantX layout)",
                (
                    "diffusers QwenImageControlNetModel names ('controlnet_x_embedder.weight', 'controlnet_blocks.N.weight', "
                    "'transformer_blocks.N.attn.to_q.weight', ...), bare or prefixed 'controlnet.'"
                ),
            )
        )
    inferred = infer_controlnet_config(shapes, header.path)
    if inferred["axes_dims_rope"] is ASK and axes_dims_rope is not None:
        inferred["axes_dims_rope"] = tuple(axes_dims_rope)
    cfg = _make_config(ControlNetConfig, inferred, config, "controlnet", header.path)
    layout = f"ControlNet ({'prefix ' + repr(prefix) if prefix else 'no prefix'}, {cfg.num_layers} layers"
    layout += (
        f", +{cfg.extra_condition_channels} condition channels)" if cfg.extra_condition_channels else ")"
    )
    return Source(header, quant, names, layout), cfg


def infer_controlnet_config(shapes: dict[str, tuple[int, ...]], path: Path | str = "") -> dict:
    """ControlNetConfig fields from tensor shapes (diffusers names; fused or separate Q/K/V)."""
    blocks = sorted({int(m.group(1)) for n in shapes if (m := re.match(r"transformer_blocks\.(\d+)\.", n))})
    if not blocks or blocks != list(range(len(blocks))):
        raise CheckpointError(f"{path}: ControlNet transformer blocks are missing or not numbered 0..N-1")
    need = (
        "img_in.weight",
        "txt_in.weight",
        "controlnet_x_embedder.weight",
        "transformer_blocks.0.attn.norm_q.weight",
    )
    missing = [k for k in need if k not in shapes]
    if missing:
        raise CheckpointError(f"{path}: cannot infer the ControlNet config, keys missing: {missing}")
    inner, in_channels = shapes["img_in.weight"]
    head_dim = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    return {
        "patch_size": 2,
        "in_channels": in_channels,
        "num_layers": len(blocks),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": shapes["txt_in.weight"][1],
        "extra_condition_channels": shapes["controlnet_x_embedder.weight"][1] - in_channels,
        "axes_dims_rope": ROPE_AXES_BY_HEAD_DIM.get(head_dim, ASK),  # not in the weights
    }
