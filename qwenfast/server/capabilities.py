"""What the served model can do, read once from its pipeline: which endpoints answer, which tasks
POST /v1/images/edits runs, how many images one request may carry, whether uploads keep their alpha.

Why one place: the endpoints, /health, /v1/models, /metrics, the web page (through /health) and Ray
Serve's ingress (which holds no pipeline, only an engine replica's `describe()`) must agree on it.
Three model families are served today:

- Qwen-Image (text-to-image): generations; edits run img2img / inpainting on 1 image;
- Qwen-Image-Edit (v1, 2509, 2511): edits with 1 (v1) or 1-3 images, and edit-inpainting; no generations;
- Qwen-Image-2.1: one model for both: generations and edits with 1-10 images, RGBA kept; no
  inpainting and no per-request step cache (a server-wide `--cache` preset works).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    model_type: str  # "qwen-image", "qwen-image-edit", "qwen-image-edit-plus", "qwen-image-2.1"
    kind: str  # /health's "kind": "text-to-image", "edit" or "text-to-image+edit"
    generations: bool  # POST /v1/images/generations runs
    edits: bool  # POST /v1/images/edits runs reference edits (the "edit" task)
    inpaint: bool  # ... and masked / strength requests (img2img, inpaint, edit-inpaint)
    tasks: tuple[str, ...]  # what /health lists
    max_images: int  # the model's own limit of input images per edit request
    rgba: bool  # uploads keep their alpha channel (the model sees it and answers RGBA)
    request_cache: bool  # a request may ask for a step-cache preset (`cache`)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _edit_class():
    try:
        from ..pipeline.edit import QwenImageEditPipeline
    except ImportError:
        return None
    return QwenImageEditPipeline


def capabilities(pipe: Any) -> Capabilities:
    """The capabilities of `pipe`: a local pipeline (or `Mirrored`, which passes isinstance), or a
    `RemotePipe` whose `capabilities` dict an engine replica computed with this function."""
    desc = getattr(pipe, "capabilities", None)
    if isinstance(desc, dict):
        return Capabilities(**{**desc, "tasks": tuple(desc["tasks"])})
    from ..pipeline.qwenimage21 import MAX_IMAGES as MAX_21
    from ..pipeline.qwenimage21 import QwenImage21Pipeline

    if isinstance(pipe, QwenImage21Pipeline):
        return Capabilities("qwen-image-2.1", "text-to-image+edit", generations=True, edits=True, inpaint=False,
                            tasks=("txt2img", "edit"), max_images=MAX_21, rgba=True, request_cache=False)  # fmt: skip
    edit_cls = _edit_class()
    can_inpaint = hasattr(pipe, "for_task")  # img2img / inpainting with the loaded model (pipeline/tasks.py)
    if edit_cls is not None and isinstance(pipe, edit_cls):
        from ..pipeline.edit import MAX_IMAGES

        mode = getattr(pipe, "mode", "edit-plus")
        return Capabilities("qwen-image-" + mode, "edit", generations=False, edits=True, inpaint=can_inpaint,
                            tasks=("edit", "edit-inpaint")[: None if can_inpaint else 1],
                            max_images=MAX_IMAGES.get(mode, 3), rgba=False, request_cache=True)  # fmt: skip
    return Capabilities("qwen-image", "text-to-image", generations=True, edits=False, inpaint=can_inpaint,
                        tasks=("txt2img", "img2img", "inpaint")[: None if can_inpaint else 1], max_images=1,
                        rgba=False, request_cache=True)  # fmt: skip
