"""What each pipeline class can do (`Capabilities`), and the registry's answers from those declarations:
the class of (folder kind, task), the tasks of a folder or of a loaded model, the class of `for_task`.

Every pipeline class declares, as class-level data:
- `folder_kinds`: the model folders it loads (`model_index.json` kinds as `loading/` names them, plus
  "qwen-image-2.1"); the first registered class that loads a kind (and needs nothing more) is that
  folder's default;
- `needs`: what it takes beyond the folder's model (the ControlNet pipelines: a "controlnet");
- `checkpoints`: the released models it loads, as error messages name them;
- `CAPABILITIES`: its tasks and limits. Where a limit depends on the loaded folder (Edit v1 takes one
  image, Edit-2509/2511 up to three), the class declares the rule (`_capabilities_of`) and a loaded
  pipeline answers for its folder (`pipe.capabilities`), never by probing.

`pipeline/auto.py` lists the classes (`PIPELINES`, in registry order). The functions here read that list
by module name (`registered`): auto.py imports every pipeline module, each of which imports base.py,
whose `for_task` and `capabilities` call here; a static import would be a cycle. The CLI and the server
ask these functions and read the declarations; they keep no table of model kinds or tasks of their own.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, replace
from typing import Any

ALIASES = {"txt2img": "text-to-image", "t2i": "text-to-image"}


@dataclass(frozen=True)
class Capabilities:
    """What a pipeline class can do (`CAPABILITIES`), or a loaded model (`pipe.capabilities`: every task
    it runs through `for_task`, the largest image count and any mask among them)."""

    model_type: (
        str  # the model's name in the server's /health and /v1/models: "qwen-image", "qwen-image-2.1", ...
    )
    tasks: tuple[
        str, ...
    ]  # the tasks it runs, in registry order: "text-to-image", "img2img", "inpaint", "edit", ...
    max_images: int = 0  # input images one call takes at most (0: none)
    rgba: bool = False  # input images keep their alpha channel, outputs are RGBA
    mask: bool = False  # inpaints: a call takes a mask
    step_cache: bool = True  # the step cache preset may change from call to call (`configure(cache=...)`)
    lora: bool = True  # LoRAs: `load_lora`, `set_loras`
    row_loras: bool = (
        False  # each prompt its own LoRAs in one call (`enable_row_loras`, `loras=`; 8-bit weights)
    )
    parallel: tuple[str, ...] = ("cfg", "ulysses")  # the axes of `EngineOptions.parallel` it runs; () one GPU
    single_files: bool = False  # loads ComfyUI single files (`from_single_files`)
    size_multiple: int = 16  # output sides are multiples of this (twice the VAE's downscale)
    variant: str = ""  # the folder's variant where one class loads several (Edit: "edit" v1, "edit-plus")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Capabilities:
        """The inverse of `as_dict` (Ray Serve's ingress rebuilds a replica's answer from it)."""
        return cls(**{**d, "tasks": tuple(d["tasks"]), "parallel": tuple(d["parallel"])})


def registered() -> tuple[type, ...]:
    """Every pipeline class, in registry order (`pipeline/auto.py`; see the module docstring)."""
    return importlib.import_module(f"{__package__}.auto").PIPELINES


def known_tasks() -> list[str]:
    return list(dict.fromkeys(t for c in registered() for t in c.CAPABILITIES.tasks))


def _fits(cls: type, kind: str | None) -> bool:
    return kind is None or kind in cls.folder_kinds


def _resolve(task: str, available: list[str]) -> str:
    """`task` as the registry names it: its aliases, and "inpaint" where only "edit-inpaint" is available
    (an edit model's inpainting, which diffusers has no name for)."""
    task = ALIASES.get(task, task)
    return (
        "edit-inpaint"
        if task == "inpaint" and "inpaint" not in available and "edit-inpaint" in available
        else task
    )


def folder_tasks(kind: str) -> list[str]:
    """Every task a folder of `kind` runs (some with a ControlNet), in registry order."""
    return list(dict.fromkeys(t for c in registered() if _fits(c, kind) for t in c.CAPABILITIES.tasks))


def default_class(kind: str | None, controlnet: bool = False) -> type:
    """The class a folder of `kind` loads as when no task is asked for (`controlnet`: a ControlNet is given)."""
    fits = [c for c in registered() if _fits(c, kind)]
    if not fits:
        raise ValueError(f"no qwenfast pipeline loads a {kind!r} model folder")
    have = ("controlnet",) if controlnet else ()
    return next((c for c in fits if tuple(c.needs) == have), fits[0])


def describe(kind: str) -> str:
    """The models a folder of `kind` holds, as messages name them."""
    return default_class(kind).checkpoints


def task_class(kind: str | None, task: str | None = None, controlnet: bool = False) -> type:
    """The class running `task` on a folder of `kind` (None: no folder, e.g. single files). No task: the
    folder's own; a ValueError names what the task needs and what this folder runs instead."""
    if task is None:
        return default_class(kind, controlnet)
    task = _resolve(task, folder_tasks(kind) if kind is not None else [])
    runs = [c for c in registered() if task in c.CAPABILITIES.tasks]
    if not runs:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(known_tasks())}")
    for c in runs:
        if _fits(c, kind):
            return c
    raise ValueError(
        f"task {task!r} needs {runs[0].checkpoints}; this folder holds {describe(kind)}, which runs the "
        f"tasks {folder_tasks(kind)}"
    )


def view_class(cls: type, task: str) -> type:
    """The class `for_task(task)` gives for a pipeline of class `cls`: one that loads the same folders
    and needs nothing `cls` lacks (a text-to-image pipeline has no ControlNet to lend)."""
    task = _resolve(task, _reachable_tasks(cls))
    runs = [c for c in registered() if task in c.CAPABILITIES.tasks]
    if not runs:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(known_tasks())}")
    for c in runs:
        if _reaches(cls, c):
            return c
    raise ValueError(
        f"a loaded {cls.__name__} does not run {task!r}, which needs {runs[0].checkpoints}; it runs "
        f"{_reachable_tasks(cls)}"
    )


def _reaches(cls: type, other: type) -> bool:
    return bool(set(cls.folder_kinds) & set(other.folder_kinds)) and set(other.needs) <= set(cls.needs)


def _reachable(cls: type) -> list[type]:
    return [c for c in registered() if _reaches(cls, c)]


def _reachable_tasks(cls: type) -> list[str]:
    return list(dict.fromkeys(t for c in _reachable(cls) for t in c.CAPABILITIES.tasks))


def model_capabilities(pipe: Any) -> Capabilities:
    """A loaded model's capabilities: its class's declaration answered for its folder, with every task
    `for_task` reaches (registry order), the most images and any mask or per-row LoRAs among those tasks."""
    own = pipe._capabilities_of(type(pipe))
    others = [pipe._capabilities_of(c) for c in _reachable(type(pipe))]
    return replace(
        own,
        tasks=tuple(dict.fromkeys(t for c in others for t in c.tasks)),
        max_images=max(c.max_images for c in others),
        mask=any(c.mask for c in others),
        row_loras=any(c.row_loras for c in others),
    )
