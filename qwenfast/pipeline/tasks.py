"""Which pipeline class runs which task on which model folder, and `for_task`: a loaded pipeline under
another task's class. Imports the pipeline classes by name only (importlib), so that `base.py`
(`PipelineBase.for_task`) and `auto.py` can both use it without an import cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

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
        needs = {"text-to-image": "a text-to-image model (Qwen-Image, -2512)", "edit": "an edit model (Qwen-Image-Edit, "
                 "-2509, -2511)", "edit-plus": "an edit model", "layered": "Qwen-Image-Layered"}.get(kinds[0], kinds[0])  # fmt: skip
        raise ValueError(f"task {task!r} needs {needs}; this Qwen-Image {kind} model runs the tasks {ok}")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


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
