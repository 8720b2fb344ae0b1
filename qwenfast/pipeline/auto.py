"""`from_pretrained(path, task=None)`: the right pipeline class for a model folder, from its
`model_index.json` and the task; `for_task(pipe, task)`: the same loaded model under another task's class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..loading.diffusers_folder import PIPELINE_CLASSES, read_json

# task -> (module, class); which folder kinds serve which tasks is FAMILY below
_CLASSES = {
    "txt2img": ("text_to_image", "QwenImagePipeline"),
    "img2img": ("img2img", "QwenImageImg2ImgPipeline"),
    "inpaint": ("inpaint", "QwenImageInpaintPipeline"),
    "edit": ("edit", "QwenImageEditPipeline"),
    "edit-inpaint": ("inpaint", "QwenImageEditInpaintPipeline"),
}
FAMILY = {"text-to-image": ("txt2img", "img2img", "inpaint"), "edit": ("edit", "edit-inpaint")}
ALIASES = {"text-to-image": "txt2img", "t2i": "txt2img"}


def _family(kind: str | None) -> str:
    return "edit" if kind in ("edit", "edit-plus") else "text-to-image"


def task_class(kind: str | None, task: str | None = None) -> type:
    """The class running `task` on a folder of `kind` ("text-to-image", "edit", "edit-plus"). None = the
    folder's own task (text-to-image or edit); "inpaint" on an edit model means edit-inpaint."""
    fam = _family(kind)
    task = ALIASES.get(task, task) if task is not None else FAMILY[fam][0]
    if fam == "edit" and task == "inpaint":
        task = "edit-inpaint"
    if task not in _CLASSES:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(_CLASSES)}")
    if task not in FAMILY[fam]:
        other = "an edit model (Qwen-Image-Edit, -2509, -2511)" if fam == "text-to-image" else "a text-to-image model"
        raise ValueError(f"task {task!r} needs {other}; this {fam} model serves {', '.join(FAMILY[fam])}")
    import importlib

    module, name = _CLASSES[task]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def pipeline_class(path: str | Path, task: str | None = None) -> type:
    """`QwenImagePipeline` for text-to-image folders, `QwenImageEditPipeline` for Edit / 2509 / 2511;
    with `task`, the class of that task (see `task_class`)."""
    return task_class(PIPELINE_CLASSES.get(read_json(Path(path) / "model_index.json").get("_class_name")), task)


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, task: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """Load any Qwen-Image diffusers folder with the right pipeline class; `task`: "txt2img" | "img2img" |
    "inpaint" (text-to-image folders), "edit" | "edit-inpaint" (edit folders); None = the folder's own.
    `kwargs` as the class's `from_pretrained` (`options=`, `offload=`, `fp8=`, `cuda_graphs=`)."""
    return pipeline_class(path, task).from_pretrained(path, device=device, dtype=dtype, **kwargs)


def for_task(pipe: Any, task: str) -> Any:
    """`pipe`'s loaded model under the class of `task`, sharing everything with `pipe`: weights, engine
    options, LoRAs, captured graphs, caches (the two objects share one state, so a `configure` or
    `load_lora` on either is seen by both). What the server and the CLI use to inpaint with a loaded
    text-to-image or edit pipeline without loading it twice."""
    kind = "edit" if hasattr(pipe, "mode") else "text-to-image"
    cls = task_class(kind, task)
    if isinstance(pipe, cls) and type(pipe) is cls:
        return pipe
    view = cls.__new__(cls)
    view.__dict__ = pipe.__dict__  # one state, two classes: nothing to keep in sync
    return view
