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

from .about import DEMO_EDIT_MODEL, DEMO_MODEL, __version__  # plain values, no torch

__all__ = [
    "QwenImagePipeline",
    "QwenImageEditPipeline",
    "QwenImageEditPlusPipeline",
    "QwenImageControlNetPipeline",
    "QwenImageControlNetInpaintPipeline",
    "QwenImageLayeredPipeline",
    "QwenImageControlNetModel",
    "QwenImageMultiControlNetModel",
    "QwenImage21Pipeline",
    "QwenImageImg2ImgPipeline",
    "QwenImageInpaintPipeline",
    "QwenImageEditInpaintPipeline",
    "EngineOptions",
    "from_pretrained",
    "__version__",
    "DEMO_MODEL",
    "DEMO_EDIT_MODEL",
]
# public name -> module that defines it (imported on first use, so `qwenfast --help` does not import torch)
_LAZY = {
    "QwenImagePipeline": ".pipeline.text_to_image",
    "QwenImageEditPipeline": ".pipeline.edit",
    "QwenImageEditPlusPipeline": ".pipeline.edit",  # diffusers' name for Edit-2509/2511: the same class
    "QwenImageControlNetPipeline": ".pipeline.controlnet",
    "QwenImageControlNetInpaintPipeline": ".pipeline.controlnet",
    "QwenImageLayeredPipeline": ".pipeline.layered",
    "QwenImageControlNetModel": ".pipeline.controlnet",
    "QwenImageMultiControlNetModel": ".models.controlnet",
    "QwenImage21Pipeline": ".pipeline.pipeline21",
    "QwenImageImg2ImgPipeline": ".pipeline.img2img",
    "QwenImageInpaintPipeline": ".pipeline.inpaint",
    "QwenImageEditInpaintPipeline": ".pipeline.inpaint",
    "EngineOptions": ".options",
}


def from_pretrained(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    task: str | None = None,
    **kwargs: Any,
) -> QwenImagePipeline:  # a QwenImageEditPipeline (a subclass) for edit models
    """Load any Qwen-Image diffusers folder with the right pipeline class (from `model_index.json`):
    text-to-image -> `QwenImagePipeline`, Edit / Edit-2509 / Edit-2511 -> `QwenImageEditPipeline`,
    Qwen-Image-Layered -> `QwenImageLayeredPipeline`; `controlnet=...` (as in diffusers) or
    `task="controlnet"` / `"controlnet-inpaint"` -> the ControlNet pipelines; `task="img2img"` /
    `"inpaint"` (text-to-image folders), `"edit-inpaint"` (edit folders).
    `kwargs`: engine options (`options=EngineOptions(...)`, or `offload=`, `fp8=`, `cuda_graphs=`)."""
    from .pipeline.auto import from_pretrained as load

    return load(path, device=device, dtype=dtype, task=task, **kwargs)


def __getattr__(name):  # lazy, so `qwenfast --help` does not import torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)
