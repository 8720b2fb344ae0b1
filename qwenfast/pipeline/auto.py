"""`from_pretrained(path)`: the right pipeline class for a model folder, from its `model_index.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..loading.diffusers_folder import PIPELINE_CLASSES, read_json


def pipeline_class(path: str | Path) -> type:
    """`QwenImagePipeline` for text-to-image folders, `QwenImageEditPipeline` for Edit / 2509 / 2511,
    `QwenImage21Pipeline` for Qwen-Image-2.1."""
    name = read_json(Path(path) / "model_index.json").get("_class_name")
    if name == "QwenImage21Pipeline":
        from .qwenimage21 import QwenImage21Pipeline

        return QwenImage21Pipeline
    kind = PIPELINE_CLASSES.get(name)
    if kind in ("edit", "edit-plus"):
        from .edit import QwenImageEditPipeline

        return QwenImageEditPipeline
    from .text_to_image import QwenImagePipeline

    return QwenImagePipeline


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """Load any Qwen-Image diffusers folder with the right pipeline class; `kwargs` as the class's
    `from_pretrained` (`options=`, `offload=`, `fp8=`, `cuda_graphs=`)."""
    return pipeline_class(path).from_pretrained(path, device=device, dtype=dtype, **kwargs)
