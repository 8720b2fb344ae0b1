"""The state of one loaded model, which every pipeline object over that model shares.

Why: one loaded folder runs several tasks, each a pipeline class of its own (diffusers' classes and
call signatures): a text-to-image folder runs `QwenImagePipeline`, `QwenImageImg2ImgPipeline` and
`QwenImageInpaintPipeline`, an edit folder `QwenImageEditPipeline` and `QwenImageEditInpaintPipeline`.
`pipe.for_task(task)` gives the loaded model under another task's class without loading it again: a
new, thin object of that class over the same `ModelState` (`view`).

What is shared: every attribute `SharedState` declares with `shared()` lives in the `ModelState`, not
in the object: the weights, the engine options and what is built on them (offload streamers, parallel
groups, captured CUDA graphs, LoRAs, caches), and the model's call defaults. So a `configure`,
`load_lora` or `apply_preset` through any object over the model is seen by all of them. What is not
shared: the state of the call running on one object (diffusers' `interrupt`, `num_timesteps`, ...),
which stays in that object.

Invariant (tests/test_capabilities.py): a loaded pipeline object holds nothing in its own `__dict__`
but its `ModelState` and that per-call state; a new attribute of a pipeline is declared here.
"""

from __future__ import annotations

import copy
from typing import Any


class ModelState:
    """The shared attributes of one loaded model: a plain namespace, read and written through `shared`."""


class shared:  # noqa: N801 - used like a field declaration, `transformer = shared()`
    """A pipeline attribute that lives in the object's `ModelState` (see the module docstring)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return vars(state_of(obj))[self.name]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r}") from None

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(state_of(obj), self.name, value)

    def __delete__(self, obj: Any) -> None:
        try:
            delattr(state_of(obj), self.name)
        except AttributeError:
            raise AttributeError(self.name) from None


def state_of(obj: Any) -> ModelState:
    """`obj`'s ModelState, made when it sets its first shared attribute (a constructor may set one
    before it calls its base class's, as the ControlNet pipeline sets `controlnet`)."""
    state = vars(obj).get("_model_state")
    if state is None:
        state = obj._model_state = ModelState()
    return state


def view(pipe: Any, cls: type) -> Any:
    """A `cls` object over `pipe`'s ModelState: nothing is loaded, configured or copied."""
    obj = cls.__new__(cls)
    obj._model_state = state_of(pipe)
    return obj


SETTINGS = ("model_path", "extra", "defaults", "scheduler_overrides", "sample_sigmas", "vae_scale_factor", "mode",
            "image_areas")  # fmt: skip


class SharedState:
    """Mixed into `PipelineBase`: the attributes of a loaded model (see the module docstring)."""

    # the model: set once by the constructors
    transformer = shared()
    vae = shared()
    text_encoder = shared()
    controlnet = shared()  # the ControlNet pipelines
    scheduler_config = shared()
    vae_scale_factor = shared()
    model_path = shared()
    extra = shared()  # the folder's qwenfast.json
    mode = shared()  # edit models: "edit" (Edit v1) or "edit-plus" (2509/2511)
    image_areas = shared()
    image_processor = shared()
    # call defaults (apply_preset, set_progress_bar_config)
    defaults = shared()
    scheduler_overrides = shared()
    sample_sigmas = shared()  # Qwen-Image-2.1
    progress_bar = shared()
    _progress_kwargs = shared()
    # engine options and what is built on them (configure, enable_offload, .to())
    _options = shared()
    _compute_device = shared()
    _ring = shared()
    _offload_vae = shared()
    _block_streamer = shared()
    _vae_offloader = shared()
    _parallel = shared()
    _fp8_layers = shared()
    memory_plan = shared()  # runtime.tiers.VramPlan of the last vram_gib planned (None: none)
    # captured graphs, LoRAs, caches
    _graphs = shared()
    _decode_graphs = shared()  # the per-image VAE decode's graphs (decode_per_image)
    _block_runners = (
        shared()
    )  # one block runner per step-cache policy (configure), so graphs survive a switch
    _lora_manager = shared()
    latent_cache_size = shared()
    _latent_cache = shared()  # edit models: reference latents
    _static_caches = shared()  # Qwen-Image-2.1: the KV caches its graphs read
    _row_adapters = shared()  # per-row LoRAs (pipeline/row_loras.py), once enabled
    _row_layout = shared()  # the adapters' layout the captured graphs were made with
    _step_cache_off = shared()  # inside `step_cache_bypassed()`: forwards skip the configured step cache

    def settings(self) -> dict[str, Any]:
        """The loaded model's plain settings (no weights, no runtime objects): what `output_size`,
        `size_note` and `capabilities` read, so that a stand-in of the class over them answers as this
        pipeline does (`pipeline.auto.stand_in`: Ray Serve's ingress, which holds no model)."""
        state = vars(state_of(self))
        return {k: copy.deepcopy(state[k]) for k in SETTINGS if k in state}

    def __copy__(self) -> Any:
        """`copy.copy(pipe)`: a pipeline over a shallow copy of the state (the same models and options
        objects), so that what is set on the copy afterwards leaves `pipe` alone, as for a plain object."""
        new = type(self).__new__(type(self))
        vars(new).update(vars(self))
        new._model_state = copy.copy(state_of(self))
        return new
