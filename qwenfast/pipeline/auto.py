"""The registry of pipeline classes, and loading through it: `from_pretrained(path, task=None)` (a model
folder), `from_single_files(..., task=)` (ComfyUI files); `for_task(pipe, task)`, the same loaded
model under another task's class.

One folder serves several tasks: a Qwen-Image text-to-image folder runs text-to-image, img2img,
inpainting and (with a ControlNet) the ControlNet pipelines; an edit folder runs edits and
edit-inpainting; a Qwen-Image-2.1 folder runs text-to-image and edits in one class. Which class runs
what is each class's own declaration (`folder_kinds`, `needs`, `CAPABILITIES`; pipeline/tasks.py);
`PIPELINES` lists the classes, and its order decides a folder's default class. The CLI and the server
load through here and read `pipe.capabilities`, so a new pipeline class is one entry below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..loading.diffusers_folder import PIPELINE_CLASSES, inspect_folder, read_json
from ..loading.folder21 import PIPELINE_CLASS as PIPELINE_CLASS_21
from .controlnet import QwenImageControlNetInpaintPipeline, QwenImageControlNetPipeline
from .edit import QwenImageEditPipeline
from .img2img import QwenImageImg2ImgPipeline
from .inpaint import QwenImageEditInpaintPipeline, QwenImageInpaintPipeline
from .layered import QwenImageLayeredPipeline
from .pipeline21 import QwenImage21Pipeline
from .state import state_of
from .tasks import ALIASES, Capabilities, default_class, describe, folder_tasks, task_class  # noqa: F401 - re-exported
from .text_to_image import QwenImagePipeline

PIPELINES = (
    QwenImagePipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImageEditPipeline,
    QwenImageEditInpaintPipeline,
    QwenImageControlNetPipeline,
    QwenImageControlNetInpaintPipeline,
    QwenImageLayeredPipeline,
    QwenImage21Pipeline,
)


def folder_kind(path: str | Path) -> str | None:
    """The kind of model a folder holds, from its `model_index.json` (None: not a Qwen-Image pipeline
    name; the loader then says what is wrong). Raises CheckpointError without a readable index."""
    name = read_json(Path(path) / "model_index.json").get("_class_name")
    return "qwen-image-2.1" if name == PIPELINE_CLASS_21 else PIPELINE_CLASSES.get(name)


def check_folder(path: str | Path) -> tuple[str | None, list[str]]:
    """(the folder's kind or None, what is missing or broken: [] when it loads), without loading it."""
    try:
        kind = folder_kind(path)
    except CheckpointError as e:
        return None, [str(e) + " (a diffusers model folder has model_index.json at its top)"]
    if kind is None:
        return inspect_folder(Path(path))  # names the unknown _class_name
    return kind, default_class(kind).check_folder(Path(path))


def pipeline_class(path: str | Path | None, task: str | None = None, controlnet: bool = False) -> type:
    """The class for a folder (None: no folder, as for single files or the embedded demo): its kind's
    default, or the class of `task` where the folder runs it (else a ValueError naming what does)."""
    try:
        return task_class(None if path is None else folder_kind(path), task, controlnet)
    except ValueError as e:
        raise ValueError(f"{path}: {e}" if path is not None else str(e)) from None


def from_pretrained(
    path: str | Path | None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    task: str | None = None,
    **kwargs: Any,
) -> Any:
    """Load any Qwen-Image diffusers folder (or hub repo id) with the right pipeline class; `task` where
    one folder serves several; None path: the embedded demo model of the task's class. `kwargs` as the
    class's `from_pretrained` (`options=`, `offload=`, `fp8=`, `cuda_graphs=`, and `controlnet=` for
    the ControlNet pipelines)."""
    from .diffusers_compat import HUB_ARGS, resolve_model_path

    path = resolve_model_path(
        kwargs.pop("pretrained_model_name_or_path", path), {k: kwargs[k] for k in HUB_ARGS if k in kwargs}
    )  # a hub repo id -> its folder
    cls = pipeline_class(path, task, controlnet=kwargs.get("controlnet") is not None)
    if kwargs.get("controlnet") is not None and "controlnet" not in cls.needs:
        raise ValueError(f"controlnet= was given but {cls.__name__} takes no ControlNet (task={task!r})")
    return cls.from_pretrained(path, device=device, dtype=dtype, **kwargs)


def from_single_files(
    transformer: str | Path,
    vae: str | Path,
    text_encoder: str | Path,
    tokenizer: str | Path | None = None,
    *,
    task: str = "text-to-image",
    **kwargs: Any,
) -> Any:
    """ComfyUI single files (bf16 or FP8) under the class of `task` (single files do not say which model
    they hold; `mode="edit"` for Qwen-Image-Edit v1 files); `kwargs` as `QwenImagePipeline.from_single_files`."""
    runs = [c for c in PIPELINES if ALIASES.get(task, task) in c.CAPABILITIES.tasks]
    cls = next((c for c in runs if c.CAPABILITIES.single_files), None)
    if cls is None:
        task_class(None, task)  # an unknown task: say so
        raise ValueError(
            f"task {task!r} loads from a model folder only (no single files); give --model / a folder"
        )
    return cls.from_single_files(transformer, vae, text_encoder, tokenizer, **kwargs)


def stand_in(name: str, settings: dict[str, Any]) -> Any:
    """A pipeline of the class named `name` over a loaded model's `settings()` and no weights: it answers
    `output_size`, `size_note`, `capabilities` and `for_task` as the loaded pipeline does, and runs
    nothing. What Ray Serve's ingress holds in place of its engine replicas' pipelines."""
    cls = next((c for c in PIPELINES if c.__name__ == name), None)
    if cls is None:
        raise ValueError(f"no registered pipeline class {name!r}")
    obj = cls.__new__(cls)
    vars(state_of(obj)).update(settings)
    return obj


def for_task(pipe: Any, task: str) -> Any:
    """`pipe.for_task(task)`: `pipe`'s loaded model under the class of `task` (pipeline/state.py)."""
    return pipe.for_task(task)
