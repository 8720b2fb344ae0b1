"""`from_pretrained(path)`: the right pipeline class for a model folder, from its `model_index.json`.

One folder can serve several tasks (a Qwen-Image text-to-image folder runs text-to-image, and with a
ControlNet the ControlNet pipelines): `task=` picks among them; a `controlnet=` argument (as in
diffusers) implies the ControlNet pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..loading.diffusers_folder import PIPELINE_CLASSES, read_json

# task -> (module, class); the folder kinds each task runs on
TASKS = {
    "text-to-image": ("text_to_image", "QwenImagePipeline", ("text-to-image",)),
    "edit": ("edit", "QwenImageEditPipeline", ("edit", "edit-plus")),
    "controlnet": ("controlnet", "QwenImageControlNetPipeline", ("text-to-image", "controlnet")),
    "controlnet-inpaint": ("controlnet", "QwenImageControlNetInpaintPipeline", ("text-to-image", "controlnet-inpaint")),
    "layered": ("layered", "QwenImageLayeredPipeline", ("layered",)),
}
# the task a folder kind runs when none is asked for
DEFAULT_TASK = {"text-to-image": "text-to-image", "edit": "edit", "edit-plus": "edit", "controlnet": "controlnet",
                "controlnet-inpaint": "controlnet-inpaint", "layered": "layered"}  # fmt: skip


def pipeline_class(path: str | Path, task: str | None = None, controlnet: bool = False) -> type:
    """The class for a folder: its kind's default task, or `task` where the folder can run it
    (Qwen-Image-2.1 folders: `QwenImage21Pipeline`, which does text-to-image and edits)."""
    import importlib

    name = read_json(Path(path) / "model_index.json").get("_class_name")
    if name == "QwenImage21Pipeline":
        if task not in (None, "text-to-image", "edit") or controlnet:
            raise ValueError(f"{path} is a Qwen-Image-2.1 model; it runs text-to-image and edits, not {task!r}")
        from .qwenimage21 import QwenImage21Pipeline

        return QwenImage21Pipeline
    kind = PIPELINE_CLASSES.get(name)
    if task is None:
        task = "controlnet" if controlnet and kind == "text-to-image" else DEFAULT_TASK.get(kind, "text-to-image")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    module, name, kinds = TASKS[task]
    if kind is not None and kind not in kinds:
        ok = [t for t, (_, _, k) in TASKS.items() if kind in k]
        raise ValueError(f"{path} is a Qwen-Image {kind} model; it runs the tasks {ok}, not {task!r}")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, task: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """Load any Qwen-Image diffusers folder with the right pipeline class; `task` where one folder
    serves several (see `TASKS`); `kwargs` as the class's `from_pretrained` (`options=`, `offload=`,
    `fp8=`, `cuda_graphs=`, and `controlnet=` for the ControlNet pipelines)."""
    cls = pipeline_class(path, task, controlnet=kwargs.get("controlnet") is not None)
    if kwargs.get("controlnet") is not None and "controlnet" not in cls.kind:
        raise ValueError(f"controlnet= was given but {cls.__name__} takes no ControlNet (task={task!r})")
    return cls.from_pretrained(path, device=device, dtype=dtype, **kwargs)
