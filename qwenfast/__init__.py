"""qwenfast: fast Qwen-Image inference that gives the same images as diffusers.

    from qwenfast import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained("/models/Qwen-Image", device="cuda")
    image = pipe("a red fox in the snow", num_inference_steps=50).images[0]
"""

__version__ = "0.1.0"
__all__ = ["QwenImagePipeline", "QwenImageEditPipeline", "from_pretrained", "__version__"]


def from_pretrained(path, device=None, dtype=None):
    """Load any Qwen-Image diffusers folder with the right pipeline class (from `model_index.json`):
    text-to-image -> `QwenImagePipeline`, Edit / Edit-2509 / Edit-2511 -> `QwenImageEditPipeline`."""
    from pathlib import Path

    from .loading.diffusers_folder import PIPELINE_CLASSES, read_json

    kind = PIPELINE_CLASSES.get(read_json(Path(path) / "model_index.json").get("_class_name"))
    cls = __getattr__("QwenImageEditPipeline" if kind in ("edit", "edit-plus") else "QwenImagePipeline")
    return cls.from_pretrained(path, device=device, dtype=dtype)


def __getattr__(name):  # lazy, so `qwenfast --help` does not import torch
    if name == "QwenImagePipeline":
        from .pipeline.text_to_image import QwenImagePipeline

        return QwenImagePipeline
    if name == "QwenImageEditPipeline":
        from .pipeline.edit import QwenImageEditPipeline

        return QwenImageEditPipeline
    raise AttributeError(name)
