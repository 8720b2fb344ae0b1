"""`from_pretrained(path, task=None)`: the right pipeline class for a model folder, from its
`model_index.json` and the task; `for_task(pipe, task)`: the same loaded model under another task's class.

One folder serves several tasks: a Qwen-Image text-to-image folder runs text-to-image, img2img,
inpainting and (with a ControlNet) the ControlNet pipelines; an edit folder runs edits and
edit-inpainting. `task=` picks among them; a `controlnet=` argument (as in diffusers) implies the
ControlNet pipeline. Qwen-Image-2.1 folders get `QwenImage21Pipeline` (text-to-image and edits).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from ..loading.diffusers_folder import PIPELINE_CLASSES, read_json

T2I, EDIT = ("text-to-image",), ("edit", "edit-plus")
# task -> (module, class, the folder kinds that run it)
TASKS = {
    "text-to-image": ("text_to_image", "QwenImagePipeline", T2I),
    "img2img": ("img2img", "QwenImageImg2ImgPipeline", T2I),
    "inpaint": ("inpaint", "QwenImageInpaintPipeline", T2I),
    "edit": ("edit", "QwenImageEditPipeline", EDIT),
    "edit-inpaint": ("inpaint", "QwenImageEditInpaintPipeline", EDIT),
    "controlnet": ("controlnet", "QwenImageControlNetPipeline", ("text-to-image", "controlnet")),
    "controlnet-inpaint": ("controlnet", "QwenImageControlNetInpaintPipeline", ("text-to-image", "controlnet-inpaint")),
    "layered": ("layered", "QwenImageLayeredPipeline", ("layered",)),
}
ALIASES = {"txt2img": "text-to-image", "t2i": "text-to-image"}
# the task a folder kind runs when none is asked for
DEFAULT_TASK = {"text-to-image": "text-to-image", "edit": "edit", "edit-plus": "edit", "controlnet": "controlnet",
                "controlnet-inpaint": "controlnet-inpaint", "layered": "layered"}  # fmt: skip


def task_class(kind: str | None, task: str | None = None, controlnet: bool = False) -> type:
    """The class running `task` on a folder of `kind` (None task: the folder's own; "inpaint" on an
    edit folder means edit-inpaint; `controlnet` True picks the ControlNet pipeline by default)."""
    if task is None:
        task = "controlnet" if controlnet and kind == "text-to-image" else DEFAULT_TASK.get(kind, "text-to-image")
    task = ALIASES.get(task, task)
    if task == "inpaint" and kind in EDIT:
        task = "edit-inpaint"
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    module, name, kinds = TASKS[task]
    if kind is not None and kind not in kinds:
        ok = [t for t, (_, _, k) in TASKS.items() if kind in k]
        raise ValueError(f"this is a Qwen-Image {kind} model; it runs the tasks {ok}, not {task!r}")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def pipeline_class(path: str | Path, task: str | None = None, controlnet: bool = False) -> type:
    """The class for a folder: its kind's default task, or `task` where the folder can run it."""
    name = read_json(Path(path) / "model_index.json").get("_class_name")
    if name == "QwenImage21Pipeline":
        if ALIASES.get(task, task) not in (None, "text-to-image", "edit") or controlnet:
            raise ValueError(f"{path} is a Qwen-Image-2.1 model; it runs text-to-image and edits, not {task!r}")
        from .qwenimage21 import QwenImage21Pipeline

        return QwenImage21Pipeline
    try:
        return task_class(PIPELINE_CLASSES.get(name), task, controlnet)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, task: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """Load any Qwen-Image diffusers folder with the right pipeline class; `task` where one folder
    serves several (see `TASKS`); `kwargs` as the class's `from_pretrained` (`options=`, `offload=`,
    `fp8=`, `cuda_graphs=`, and `controlnet=` for the ControlNet pipelines)."""
    cls = pipeline_class(path, task, controlnet=kwargs.get("controlnet") is not None)
    if kwargs.get("controlnet") is not None and "controlnet" not in cls.kind:
        raise ValueError(f"controlnet= was given but {cls.__name__} takes no ControlNet (task={task!r})")
    return cls.from_pretrained(path, device=device, dtype=dtype, **kwargs)


def for_task(pipe: Any, task: str) -> Any:
    """`pipe`'s loaded model under the class of `task`, sharing everything with `pipe`: weights, engine
    options, LoRAs, captured graphs, caches (the two objects share one state, so a `configure` or
    `load_lora` on either is seen by both). What the server and the CLI use to inpaint with a loaded
    text-to-image or edit pipeline without loading it twice."""
    kind = "edit" if hasattr(pipe, "mode") else "text-to-image"
    cls = task_class(kind, task)
    if type(pipe) is cls:
        return pipe
    view = cls.__new__(cls)
    view.__dict__ = pipe.__dict__  # one state, two classes: nothing to keep in sync
    return view
