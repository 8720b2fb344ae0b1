"""The Hugging Face diffusers folder layout (Qwen/Qwen-Image, -2512, -Edit, ...).

```
model_index.json                 {"_class_name": "QwenImagePipeline", "transformer": [...], ...}
transformer/config.json          + diffusion_pytorch_model.safetensors or sharded + .index.json
vae/config.json                  + diffusion_pytorch_model.safetensors
text_encoder/config.json         + model.safetensors or sharded + model.safetensors.index.json
tokenizer/                       tokenizer.json / vocab.json + merges.txt, tokenizer_config.json
scheduler/scheduler_config.json
processor/                       (edit pipelines only)
```
`inspect_folder` is shared by the loader and `qwenfast doctor`, so both report the same problems.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import ConfigError, SchedulerConfig, TransformerConfig, VAEConfig
from .weights import (
    CheckpointError,
    QKVFuser,
    check_weight_files,
    iter_safetensors,
    load_streaming,
    weight_files,
)

if TYPE_CHECKING:
    from ..models.transformer import QwenImageTransformer
    from ..models.vae import QwenImageVAE

PIPELINE_CLASSES = {
    "QwenImagePipeline": "text-to-image",
    "QwenImageEditPipeline": "edit",
    "QwenImageEditPlusPipeline": "edit-plus",
    "QwenImageControlNetPipeline": "controlnet",  # a Qwen-Image folder + controlnet/
    "QwenImageControlNetInpaintPipeline": "controlnet-inpaint",
    "QwenImageLayeredPipeline": "layered",  # Qwen-Image-Layered: RGBA VAE, processor/ for captions
}
REQUIRED = {
    "transformer": ("config.json", "diffusion_pytorch_model"),
    "vae": ("config.json", "diffusion_pytorch_model"),
    "text_encoder": ("config.json", "model"),
    "scheduler": ("scheduler_config.json", None),
    "tokenizer": (None, None),
}


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def inspect_folder(path: Path) -> tuple[str | None, list[str]]:
    """(pipeline kind or None, list of problems). An empty list means the folder looks complete."""
    path = Path(path)
    if not path.is_dir():
        return None, [f"{path} is not a folder"]
    try:
        index = read_json(path / "model_index.json")
    except CheckpointError as e:
        return None, [str(e) + " (a diffusers model folder has model_index.json at its top)"]
    cls = index.get("_class_name")
    kind = PIPELINE_CLASSES.get(cls)
    problems = []
    if kind is None:
        problems.append(
            f"model_index.json: _class_name {cls!r} is not a Qwen-Image pipeline {sorted(PIPELINE_CLASSES)}"
        )
    needed = dict(REQUIRED)
    if kind in ("edit", "edit-plus", "layered"):
        needed["processor"] = (None, None)
    if kind in ("controlnet", "controlnet-inpaint"):
        needed["controlnet"] = ("config.json", "diffusion_pytorch_model")
    for comp, (cfg_name, stem) in needed.items():
        d = path / comp
        if not d.is_dir():
            problems.append(f"missing folder {comp}/")
            continue
        if cfg_name and not (d / cfg_name).is_file():
            problems.append(f"missing file {comp}/{cfg_name}")
        if stem:  # shards present, headers and file lengths sound (no tensor data read)
            problems.extend(check_weight_files(d, stem))
        if comp == "tokenizer" and not ((d / "tokenizer.json").is_file() or (d / "vocab.json").is_file()):
            problems.append("tokenizer/ has neither tokenizer.json nor vocab.json")
    return kind, problems


def load_transformer(
    folder: Path, device: torch.device | str, dtype: torch.dtype, fp8: bool = False
) -> QwenImageTransformer:
    """`fp8`: the block Linears are quantised to FP8 tensor by tensor as they stream in (no bf16 model
    on the device first); bitwise what `enable_fp8()` makes of the resident bf16 model."""
    from ..kernels.fp8_linear import quantize_model
    from ..models.transformer import QwenImageTransformer, fuse_qkv_key
    from .fp8_weights import FP8Weights

    folder = Path(folder)
    cfg = _config(TransformerConfig, folder / "config.json")
    with torch.device("meta"):
        model = QwenImageTransformer(cfg)
        if fp8:
            quantize_model(model, empty=True, dtype=dtype)
    convert = QKVFuser(fuse_qkv_key)
    if fp8:
        convert = FP8Weights(model, dtype, convert, fuse_qkv_key)
    items = iter_safetensors(weight_files(folder, "diffusion_pytorch_model"), device)
    return load_streaming(model, items, dtype=dtype, where=str(folder), convert=convert)


def load_vae(folder: Path, device: torch.device | str, dtype: torch.dtype) -> QwenImageVAE:
    from ..models.vae import QwenImageVAE, convert_vae_tensor

    folder = Path(folder)
    cfg = _config(VAEConfig, folder / "config.json")
    with torch.device("meta"):
        model = QwenImageVAE(cfg)
    items = iter_safetensors(weight_files(folder, "diffusion_pytorch_model"), device)
    return load_streaming(model, items, dtype=dtype, where=str(folder), convert=convert_vae_tensor)


def load_scheduler_config(folder: Path) -> SchedulerConfig:
    return _config(SchedulerConfig, Path(folder) / "scheduler_config.json")


def _config(cls, path: Path):
    try:
        return cls.from_dict(read_json(path))
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except TypeError as e:
        raise CheckpointError(f"{path}: malformed config ({e})") from e
