"""What makes a qwenfast pipeline a drop-in for diffusers 0.42.1's Qwen-Image pipelines beyond the
images themselves: the call arguments diffusers scripts pass (`guidance_scale`, `attention_kwargs`,
`callback_on_step_end`, `return_dict`), the pipeline methods and properties they use (`.to()`,
`enable_model_cpu_offload`, `set_progress_bar_config`, `interrupt`, `num_timesteps`, ...) and the
`from_pretrained` keyword arguments (`torch_dtype=`, hub ids).

Each argument does what it does in diffusers, or is refused with an error that names it and says
what to do. None of this touches the sampling loop: `callback_on_step_end` and `interrupt` are a
step-end hook of the denoise core (`sampling.StepEnd`), LoRA `scale` re-weights the fused LoRAs
for one call (`LoraManager`), and the rest is bookkeeping around the call. docs/diffusers.md lists
what is accepted, what is refused and why.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .sampling import StepEnd, TextCond

log = logging.getLogger("qwenfast")

# the tensors diffusers' Qwen-Image pipelines hand a step-end callback (`_callback_tensor_inputs`)
CALLBACK_TENSOR_INPUTS = ("latents", "prompt_embeds")
# names the attention processors take themselves: diffusers fails on them ("got multiple values")
_PROCESSOR_ARGS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "image_rotary_emb")


class DiffusersCall:
    """One pipeline call's diffusers arguments, as a context around the call:

        with DiffusersCall(self, guidance_scale, attention_kwargs, cb, cb_inputs) as call:
            out = self._generate(..., step_end=call.step_end)
        return call.output(out, return_dict)

    - `guidance_scale`: only guidance-distilled transformers use it, and qwenfast loads none (their
      config is refused at load time), so it is ignored with diffusers' warning (`warn_guidance=False`:
      the ControlNet inpainting pipeline, which ignores it silently in diffusers).
    - `attention_kwargs`: `scale` multiplies the strength of every loaded LoRA for this call (PEFT's
      `scale_lora_layers`, which diffusers applies); without LoRAs it changes nothing, as in diffusers.
      `attention_mask` is refused as diffusers' processor refuses it; other keys are ignored with a
      warning, as diffusers' attention ignores them.
    - `callback_on_step_end(pipe, i, t, callback_kwargs) -> dict` runs after each step; a returned
      `latents` / `prompt_embeds` replaces them for the following steps; `pipe._interrupt = True`
      (from the callback or another thread) ends the loop after the current step. The step count is
      `pipe.num_timesteps`, the step's timestep `pipe.current_timestep`, as in diffusers.
    """

    def __init__(
        self,
        pipe,
        guidance_scale: float | None = None,
        attention_kwargs: dict | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        *,
        warn_guidance: bool = True,
    ) -> None:
        self.pipe = pipe
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise TypeError(
                f"callback_on_step_end must be callable (pipe, step, timestep, callback_kwargs) -> dict, "
                f"got {type(callback_on_step_end).__name__}"
            )
        inputs = list(callback_on_step_end_tensor_inputs or ())
        bad = [k for k in inputs if k not in CALLBACK_TENSOR_INPUTS]
        if bad:  # diffusers' check_inputs message
            raise ValueError(
                f"`callback_on_step_end_tensor_inputs` has to be in {list(CALLBACK_TENSOR_INPUTS)}, "
                f"but found {bad}"
            )
        self.callback, self.inputs = callback_on_step_end, inputs
        self.guidance_scale = guidance_scale
        if guidance_scale is not None and warn_guidance:
            log.warning(
                "guidance_scale is passed as %s, but ignored since the model is not guidance-distilled.",
                guidance_scale,
            )
        self.attention_kwargs = dict(attention_kwargs or {})
        self.lora_scale = self._check_attention_kwargs(self.attention_kwargs)
        self._restore: list[tuple[dict, float, str]] | None = None

    def _check_attention_kwargs(self, kw: dict) -> float:
        """The LoRA scale of `attention_kwargs` (1.0 when not given); refuses what diffusers refuses."""
        if not isinstance(kw, dict):
            raise TypeError(
                f"attention_kwargs must be a dict (e.g. {{'scale': 0.8}}), got {type(kw).__name__}"
            )
        scale = kw.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"attention_kwargs['scale'] (the LoRA scale) must be a number, got {scale!r}")
        if "attention_mask" in kw and getattr(self.pipe, "_attention_mask_refused", True):
            raise ValueError(
                "attention_kwargs['attention_mask'] is not accepted (diffusers' Qwen-Image attention "
                "refuses it too): padding masks come from prompt_embeds_mask"
            )
        clash = [k for k in _PROCESSOR_ARGS if k in kw]
        if clash:
            raise TypeError(
                f"attention_kwargs {clash} are arguments the attention computes itself; remove them"
            )
        ignored = sorted(k for k in kw if k not in ("scale", "attention_mask"))
        if ignored:
            log.warning(
                "attention_kwargs %s are not used by Qwen-Image's attention and are ignored "
                "(as diffusers ignores them); only 'scale' (the LoRA scale) has an effect",
                ignored,
            )
        return float(scale)

    # ------------------------------------------------------------ the call
    def __enter__(self) -> DiffusersCall:
        p = self.pipe
        p._interrupt = False
        p._guidance_scale, p._attention_kwargs = self.guidance_scale, self.attention_kwargs
        p._current_timestep, p._num_timesteps = None, None
        m = getattr(p, "_lora_manager", None)
        if self.lora_scale != 1.0 and m is not None and m.active:
            # by name: a dict source matches the active LoRA of that name (LoraManager.set)
            self._restore = [({}, a.strength, a.name) for a in m.active.values()]
            p.set_loras([(src, s * self.lora_scale, n) for src, s, n in self._restore])
        return self

    def __exit__(self, *exc) -> None:
        self.pipe._current_timestep = None
        if self._restore is not None:
            self.pipe.set_loras(self._restore)
            self._restore = None

    def step_end(self, i: int, n: int, t: torch.Tensor, state: StepEnd) -> StepEnd:
        """The denoise core's step-end hook for the whole batch (see `sampling.denoise`)."""
        p = self.pipe
        p._num_timesteps, p._current_timestep = n, t
        if self.callback is None:
            return StepEnd(state.latents, state.cond, bool(p._interrupt))
        given = {"latents": state.latents}
        if "prompt_embeds" in self.inputs:  # a copy: an in-place change must not reach the prompt cache
            given["prompt_embeds"] = state.cond.emb.clone()
        kwargs = {k: given[k] for k in self.inputs}
        out = self.callback(p, i, t, kwargs)
        if not isinstance(out, dict):
            raise TypeError(
                f"callback_on_step_end must return a dict (diffusers' convention: return "
                f"callback_kwargs, with any tensor you changed), got {type(out).__name__}"
            )
        latents = out.get("latents", given["latents"])
        cond = state.cond
        emb = out.get("prompt_embeds", given.get("prompt_embeds"))
        if emb is not None:
            if not isinstance(emb, torch.Tensor) or tuple(emb.shape) != tuple(cond.emb.shape):
                raise ValueError(
                    f"callback_on_step_end returned prompt_embeds of shape {tuple(getattr(emb, 'shape', ()))}; "
                    f"they must keep the shape {tuple(cond.emb.shape)} (the padding mask stays)"
                )
            cond = TextCond(emb.to(cond.emb.device, cond.emb.dtype), cond.mask)
        if not isinstance(latents, torch.Tensor):
            raise TypeError(
                f"callback_on_step_end returned latents of type {type(latents).__name__}, not a tensor"
            )
        return StepEnd(latents, cond, bool(p._interrupt))

    @staticmethod
    def output(out, return_dict: bool):
        """diffusers' `return_dict=False`: a one-tuple of the images."""
        return out if return_dict else (out.images,)


class DiffusersMethods:
    """Pipeline methods and properties diffusers scripts use (mixed into `PipelineBase`)."""

    _interrupt = False
    _guidance_scale = None
    _attention_kwargs: dict | None = None
    _num_timesteps = None
    _current_timestep = None
    _attention_mask_refused = True  # diffusers' 1.x attention raises on it; 2.1's ignores it

    @property
    def interrupt(self) -> bool:
        """Set `pipe._interrupt = True` (in a step-end callback, or from another thread) to end the
        denoising after the current step, as in diffusers; each call starts with it False."""
        return self._interrupt

    @property
    def guidance_scale(self):
        return self._guidance_scale

    @property
    def attention_kwargs(self) -> dict | None:
        return self._attention_kwargs

    @property
    def num_timesteps(self) -> int | None:
        return self._num_timesteps

    @property
    def current_timestep(self):
        return self._current_timestep

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """diffusers' progress bar settings: `disable=True` turns the per-call bar off; other keys are
        tqdm's (`desc`, `leave`, `position`, ...)."""
        self.progress_bar = not kwargs.pop("disable", False)
        self._progress_kwargs = kwargs

    def _progress(self) -> bool | dict:
        """What the denoise core's `progress` gets: False, or the tqdm arguments."""
        return dict(getattr(self, "_progress_kwargs", {})) if self.progress_bar else False

    def to(self, *args: Any, **kwargs: Any):
        """diffusers' `pipe.to("cuda")` / `pipe.to(device, dtype)`; returns the pipeline.

        Moves every model to `device` (qwenfast loads onto the GPU already, so this is usually a
        no-op). A dtype other than the loaded one is refused: load with `torch_dtype=` instead."""
        device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
        kwargs.pop("silence_dtype_warnings", None)
        if kwargs:
            raise TypeError(f"to() got unexpected keyword arguments {sorted(kwargs)}")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (str, torch.device)):
                device = a
            else:
                raise TypeError(f"to() takes a device and/or a torch.dtype, got {a!r}")
        if dtype is not None and dtype != self.dtype:
            raise ValueError(
                f"this pipeline's weights are {self.dtype}; qwenfast does not cast a loaded pipeline to "
                f"{dtype}: load it with from_pretrained(..., torch_dtype={dtype})"
            )
        if device is not None:
            self._move_to(torch.device(device))
        return self

    def _move_to(self, dev: torch.device) -> None:
        from .common import resolve_device

        cur = self._compute_device
        if dev.type == cur.type and (dev.index is None or dev.index == (cur.index or 0)):
            return
        dev = resolve_device(dev)
        if self._options.offload != "none":
            raise ValueError(
                f"this pipeline offloads ({self._options.offload!r}) to {cur}; load it again with "
                f"device={str(dev)!r} instead of moving it"
            )
        if self._options.parallel is not None:
            raise ValueError("a pipeline with parallel options cannot be moved; load it on its device")
        for m in (self.transformer, self.vae, getattr(self, "controlnet", None)):
            if m is not None:
                m.to(dev)
        te = self.text_encoder
        te.model.to(dev)
        if hasattr(te, "_graphs"):
            te._graphs = None
        if hasattr(te, "clear_cache"):
            te.clear_cache()
        self._compute_device = dev
        self.release_graphs()

    def enable_model_cpu_offload(
        self, gpu_id: int | None = None, device: torch.device | str | None = None
    ) -> None:
        """diffusers' model offload -> qwenfast's `offload="model"` (text encoder and VAE in pinned host
        memory, brought to the GPU while they run). Same images; needs a GPU."""
        self.enable_offload("model", device=_offload_device(self, gpu_id, device), vae=True)

    def enable_sequential_cpu_offload(
        self, gpu_id: int | None = None, device: torch.device | str | None = None
    ) -> None:
        """diffusers' sequential offload -> qwenfast's `offload="blocks"` (the transformer blocks streamed
        from pinned host memory as well). Same images; needs a GPU."""
        dev = _offload_device(self, gpu_id, device)
        if self._options.offload == "none":
            self.enable_offload("model", device=dev, vae=True)
        self.enable_offload("blocks", device=dev)


def _offload_device(pipe, gpu_id: int | None, device) -> torch.device:
    dev = torch.device(device if device is not None else "cuda")
    if gpu_id is not None:
        dev = torch.device(dev.type, gpu_id)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            "CPU offload needs a CUDA GPU (the models live in host memory and run on the GPU); "
            "on a CPU-only machine leave it out"
        )
    return dev


# ---------------------------------------------------------------------------------------------
# from_pretrained keyword arguments

HUB_ARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies")
_NO_EFFECT = (
    "low_cpu_mem_usage",
    "disable_mmap",
    "silence_dtype_warnings",
)  # qwenfast streams weights anyway
_REFUSED = {
    "device_map": "qwenfast places the models itself: use device= (and offload='model' / 'blocks' for small GPUs)",
    "max_memory": "use offload='blocks' with EngineOptions(offload_budget=GiB)",
    "offload_folder": "qwenfast offloads to host memory: offload='model' or 'blocks'",
    "offload_state_dict": "qwenfast offloads to host memory: offload='model' or 'blocks'",
    "quantization_config": "use fp8=True (FP8 GEMMs on Hopper/Ada) instead",
    "custom_pipeline": "qwenfast runs its own Qwen-Image pipelines only",
    "custom_revision": "qwenfast runs its own Qwen-Image pipelines only",
    "trust_remote_code": "qwenfast runs its own Qwen-Image pipelines only",
    "use_onnx": "qwenfast reads .safetensors weights (see `qwenfast export` for ONNX)",
    "use_flashpack": "qwenfast reads .safetensors weights",
    "load_connected_pipeline": "not applicable to Qwen-Image",
    "provider": "ONNX only", "sess_options": "ONNX only", "provider_options": "ONNX only",
}  # fmt: skip
_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "processor")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def loading_args(cls_name: str, path, dtype, kwargs: dict) -> tuple[Any, Any]:
    """diffusers' `from_pretrained` keyword arguments -> (model folder, dtype); the rest refused.

    `torch_dtype=` (and `dtype=`, its newer name) is the weights' dtype. A path that is not a local
    folder but looks like a hub repo id ("Qwen/Qwen-Image") is downloaded with huggingface_hub, with
    the hub arguments (`cache_dir`, `revision`, `token`, `local_files_only`, ...) as diffusers takes
    them. Consumes `kwargs`; anything left is refused with what to do instead."""
    if "pretrained_model_name_or_path" in kwargs:  # diffusers' name of the first argument
        if path is not None:
            raise TypeError(f"{cls_name}.from_pretrained got the model path twice")
        path = kwargs.pop("pretrained_model_name_or_path")
    td = kwargs.pop("torch_dtype", None)
    if td is not None and dtype is not None and td != dtype:
        raise ValueError(
            f"{cls_name}.from_pretrained got dtype={dtype} and torch_dtype={td}; give one of them"
        )
    dtype = dtype if dtype is not None else td
    hub = {k: kwargs.pop(k) for k in HUB_ARGS if k in kwargs}
    for k in _NO_EFFECT:
        kwargs.pop(k, None)
    if kwargs.pop("use_safetensors", None) is False:
        raise ValueError("use_safetensors=False: qwenfast reads .safetensors weights only")
    variant = kwargs.pop("variant", None)
    if variant is not None:
        raise ValueError(
            f"variant={variant!r}: qwenfast reads the default weight files "
            "(diffusion_pytorch_model*.safetensors / model*.safetensors); give a folder holding them"
        )
    for k in list(kwargs):
        if k in _REFUSED:
            raise ValueError(f"{cls_name}.from_pretrained: `{k}` is not supported by qwenfast: {_REFUSED[k]}")
        if k in _COMPONENTS:
            raise ValueError(
                f"{cls_name}.from_pretrained: `{k}=` (a component object) is not supported: qwenfast "
                f"loads its own {k} from the model folder"
            )
    if kwargs:
        raise TypeError(f"{cls_name}.from_pretrained() got unexpected keyword arguments {sorted(kwargs)}")
    return resolve_model_path(path, hub), dtype


def resolve_model_path(path, hub: dict | None = None):
    """A local folder as it is; a hub repo id ("Qwen/Qwen-Image") -> its downloaded snapshot folder.
    None (the embedded demo model) stays None."""
    if path is None or Path(path).exists() or not isinstance(path, str) or not _REPO_ID.match(path):
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(
            f"{path!r} is not a local folder, and huggingface_hub (to download it as a hub repo) is not "
            "installed; pip install huggingface_hub, or pass a folder"
        ) from None
    try:
        return snapshot_download(path, **(hub or {}))
    except Exception as e:  # noqa: BLE001 - the hub raises many types; say what was tried
        raise ValueError(
            f"{path!r} is not a local folder, and downloading it as a Hugging Face hub repo failed: "
            f"{type(e).__name__}: {e}"
        ) from e
