"""qwenfast: fast Qwen-Image inference that gives the same images as diffusers.

    from qwenfast import QwenImagePipeline
    pipe = QwenImagePipeline.from_pretrained("/models/Qwen-Image", device="cuda")
    image = pipe("a red fox in the snow", num_inference_steps=50).images[0]
"""

__version__ = "0.1.0"
__all__ = ["QwenImagePipeline", "__version__"]


def __getattr__(name):  # lazy, so `qwenfast --help` does not import torch
    if name == "QwenImagePipeline":
        from .pipeline.text_to_image import QwenImagePipeline

        return QwenImagePipeline
    raise AttributeError(name)
