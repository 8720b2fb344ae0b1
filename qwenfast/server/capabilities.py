"""What the served model can do, in the API's terms: which endpoints answer, which tasks POST
/v1/images/edits runs, how many images one request may carry, whether uploads keep their alpha.

Why one place: the endpoints, /health, /v1/models, /metrics, the web page (through /health) and Ray
Serve's ingress (which holds no pipeline, only an engine replica's `describe()`) must agree on it.

The server keeps no table of model kinds: everything here is read from the pipeline's own declaration,
`pipe.capabilities` (pipeline/tasks.py; for Ray, the replica's, sent in its description). This module
only names it as the API does: generations run the "text-to-image" task, edits the "edit" task, and a
`mask` or `strength` on an edit request the inpainting tasks ("inpaint" and "img2img" on a text-to-image
model, "edit-inpaint" on an edit model: wherever the model inpaints).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Served:
    model_type: (
        str  # the pipeline's: "qwen-image", "qwen-image-edit", "qwen-image-edit-plus", "qwen-image-2.1"
    )
    kind: str  # /health's "kind": "text-to-image", "edit" or "text-to-image+edit"
    generations: bool  # POST /v1/images/generations runs
    edits: bool  # POST /v1/images/edits runs reference edits (the "edit" task)
    inpaint: bool  # ... and masked / strength requests (img2img, inpaint, edit-inpaint)
    tasks: tuple[str, ...]  # what /health lists ("txt2img" is the API's name of text-to-image)
    max_images: int  # the model's own limit of input images per edit request
    rgba: bool  # uploads keep their alpha channel (the model sees it and answers RGBA)
    request_cache: bool  # a request may ask for a step-cache preset (`cache`)
    lora: bool  # requests may name LoRAs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def capabilities(pipe: Any) -> Served:
    """The served model's capabilities, from `pipe.capabilities` (a local pipeline, a `Mirrored` one,
    or Ray's `RemotePipe`, which carries its replica's)."""
    caps = pipe.capabilities
    generations, edits = "text-to-image" in caps.tasks, "edit" in caps.tasks
    return Served(
        caps.model_type,
        "+".join(k for k, on in (("text-to-image", generations), ("edit", edits)) if on),
        generations=generations,
        edits=edits,
        inpaint=caps.mask,
        tasks=tuple("txt2img" if t == "text-to-image" else t for t in caps.tasks),
        max_images=caps.max_images,
        rgba=caps.rgba,
        request_cache=caps.step_cache,
        lora=caps.lora,
    )
