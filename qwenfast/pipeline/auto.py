"""`from_pretrained(path, task=None)`: the right pipeline class for a model folder, from its
`model_index.json` and the task; `for_task(pipe, task)`: the same loaded model under another task's class.

One folder serves several tasks: a Qwen-Image text-to-image folder runs text-to-image, img2img,
inpainting and (with a ControlNet) the ControlNet pipelines; an edit folder runs edits and
edit-inpainting. `task=` picks among them; a `controlnet=` argument (as in diffusers) implies the
ControlNet pipeline. Qwen-Image-2.1 folders get `QwenImage21Pipeline` (text-to-image and edits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..loading.diffusers_folder import PIPELINE_CLASSES, read_json
from .tasks import ALIASES, TASKS, for_task, task_class  # noqa: F401 - re-exported


def pipeline_class(path: str | Path, task: str | None = None, controlnet: bool = False) -> type:
    """The class for a folder: its kind's default task, or `task` where the folder can run it."""
    name = read_json(Path(path) / "model_index.json").get("_class_name")
    if name == "QwenImage21Pipeline":
        if ALIASES.get(task, task) not in (None, "text-to-image", "edit") or controlnet:
            raise ValueError(f"{path} is a Qwen-Image-2.1 model; it runs text-to-image and edits, not {task!r}")
        import importlib  # by name: qwenimage21 imports base, which imports tasks (not this module)

        return importlib.import_module(f"{__package__}.qwenimage21").QwenImage21Pipeline
    try:
        return task_class(PIPELINE_CLASSES.get(name), task, controlnet)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, task: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """Load any Qwen-Image diffusers folder with the right pipeline class; `task` where one folder
    serves several (see `TASKS`); `kwargs` as the class's `from_pretrained` (`options=`, `offload=`,
    `fp8=`, `cuda_graphs=`, and `controlnet=` for the ControlNet pipelines)."""
    from .diffusers_compat import HUB_ARGS, resolve_model_path

    path = resolve_model_path(kwargs.pop("pretrained_model_name_or_path", path),
                              {k: kwargs[k] for k in HUB_ARGS if k in kwargs})  # a hub repo id -> its folder
    cls = pipeline_class(path, task, controlnet=kwargs.get("controlnet") is not None)
    if kwargs.get("controlnet") is not None and "controlnet" not in cls.kind:
        raise ValueError(f"controlnet= was given but {cls.__name__} takes no ControlNet (task={task!r})")
    return cls.from_pretrained(path, device=device, dtype=dtype, **kwargs)
