"""qwenfast: fast Qwen-Image inference that gives the same images as diffusers.

    from qwenfast import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained("/models/Qwen-Image", device="cuda")
    image = pipe("a red fox in the snow", num_inference_steps=50).images[0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from .pipeline.text_to_image import QwenImagePipeline

__version__ = "0.1.0"
__all__ = ["QwenImagePipeline", "QwenImageEditPipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
           "QwenImageEditInpaintPipeline", "EngineOptions", "from_pretrained", "__version__"]  # fmt: skip
_LAZY = {"QwenImagePipeline": "text_to_image", "QwenImageEditPipeline": "edit", "QwenImageImg2ImgPipeline": "img2img",
         "QwenImageInpaintPipeline": "inpaint", "QwenImageEditInpaintPipeline": "inpaint"}  # fmt: skip


def from_pretrained(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    task: str | None = None,
    **kwargs: Any,
) -> QwenImagePipeline:  # a QwenImageEditPipeline (a subclass) for edit models
    """Load any Qwen-Image diffusers folder with the right pipeline class (from `model_index.json`):
    text-to-image -> `QwenImagePipeline`, Edit / Edit-2509 / Edit-2511 -> `QwenImageEditPipeline`.
    `task`: "img2img" or "inpaint" on a text-to-image folder, "edit-inpaint" (or "inpaint") on an
    edit folder picks that task's class instead. `kwargs`: engine options (`options=EngineOptions(...)`,
    or `offload=`, `fp8=`, `cuda_graphs=`)."""
    from .pipeline.auto import from_pretrained as load

    return load(path, device=device, dtype=dtype, task=task, **kwargs)


def __getattr__(name):  # lazy, so `qwenfast --help` does not import torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".pipeline.{_LAZY[name]}", __name__), name)
    if name == "EngineOptions":
        from .options import EngineOptions

        return EngineOptions
    raise AttributeError(name)
