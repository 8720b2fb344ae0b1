"""`QwenImagePipeline`: text-to-image with diffusers' call signature and diffusers' images.

This file only turns a call into conditioning (prompt embeddings, negative prompts); the sampling
loop is `sampling.denoise` and everything around it (noise, OOM back-off, decode) is
`PipelineBase._generate`. Every speed trick lives in the options, the model or the runtime and can
be switched off without touching either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..options import EngineOptions
from .base import PipelineBase
from .common import (  # noqa: F401 - re-exported: the public names of this module before the split
    DEFAULT_MODEL,
    OUTPUT_TYPES,
    Device,
    DType,
    QwenImageOutput,
    as_prompt_list,
    engine_options,
    load_folder,
    negative_prompts,
    plan_before_load,
    postprocess,
    randn_tensor,
    resolve_device,
    resolve_dtype,
)
from .diffusers_compat import DiffusersCall, loading_args
from .sampling import StepCallback, TextCond, join_text  # noqa: F401
from .tasks import Capabilities

log = logging.getLogger("qwenfast")
Config = dict | str | Path | None  # fields, or a config.json path


class QwenImagePipeline(PipelineBase):
    """Text-to-image. `QwenImagePipeline.from_pretrained(path)(prompt).images[0]`."""

    folder_kinds = ("text-to-image",)
    checkpoints = "a text-to-image model (Qwen-Image, -2512)"
    CAPABILITIES = Capabilities("qwen-image", tasks=("text-to-image",), single_files=True, row_loras=True)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        device: Device = None,
        dtype: DType = None,
        offload: str | None = None,
        *,
        options: EngineOptions | None = None,
        fp8: bool | None = None,
        cuda_graphs: bool | None = None,
        cache: object = None,
        **kwargs: Any,
    ) -> QwenImagePipeline:
        """Load a diffusers-layout folder or hub repo id (None = the embedded tiny default model).

        `options`: the engine options (default: `EngineOptions.from_env()`); `offload`, `fp8` and
        `cuda_graphs` are shortcuts for the same fields. `offload`: "none" | "model" (text encoder in
        host memory, on the GPU only while encoding) | "blocks" (also the transformer blocks streamed
        from host memory). Offloaded parts are loaded to the CPU, so the GPU never holds them all.
        `kwargs`: diffusers' `from_pretrained` arguments (`torch_dtype=`, hub arguments; see
        `diffusers_compat.loading_args`, which refuses the others with what to do instead).
        """
        path, dtype = loading_args(cls.__name__, path, dtype, kwargs)
        opts = engine_options(
            options, {"offload": offload, "fp8": fp8, "cuda_graphs": cuda_graphs, "cache": cache}
        )
        f = load_folder(
            path if path is not None else DEFAULT_MODEL,
            device,
            dtype,
            opts.offload,
            cls.folder_kinds,
            "QwenImagePipeline runs text-to-image checkpoints (use QwenImageEditPipeline or `qwenfast edit`)",
            fp8=opts.fp8,
            options=opts,
        )
        return cls(
            f.transformer,
            f.vae,
            f.te,
            f.sched,
            model_path=str(f.path),
            defaults=f.extra.get("defaults"),
            options=f.options,
            device=f.device,
            extra=f.extra,
        )

    @classmethod
    def from_single_files(
        cls,
        transformer: str | Path,
        vae: str | Path,
        text_encoder: str | Path,
        tokenizer: str | Path | None = None,
        device: Device = None,
        dtype: DType = None,
        scheduler: str | Path | dict | None = None,
        *,
        transformer_config: Config = None,
        vae_config: Config = None,
        text_encoder_config: Config = None,
        options: EngineOptions | None = None,
        **kwargs: Any,
    ) -> QwenImagePipeline:
        """Load ComfyUI-style single files (bf16 or FP8) + a tokenizer folder; see `qwenfast.loading.single_file`.

        Configs are inferred from the tensors; `*_config` (dict of fields, or a config.json path) override
        them for non-standard sizes. `scheduler` defaults to Qwen-Image's scheduler config. Engine
        options as for `from_pretrained`; with `fp8=True` an FP8 file's block weights load as they are
        stored (with their scales) and bf16 ones are quantised while streaming: no bf16 copy on the GPU.
        With `int8=True` an FP8 file loads the same way and each block layer is then requantised to INT8
        (cards without FP8 GEMMs: runtime/arch.py).
        """
        from ..loading.fp8 import stores_fp8
        from ..loading.single_file import load_single_files
        from ..loading.sizes import files_sizes

        dev = resolve_device(device)
        opts = engine_options(options, kwargs)
        opts, _ = plan_before_load(
            opts, lambda: files_sizes(transformer, vae, text_encoder, resolve_dtype(dtype, dev)), dev, dtype
        )
        # int8 from an FP8 file: its e4m3 weights load as stored and become INT8 layer by layer (no bf16 copy)
        as_fp8 = opts.fp8 or (opts.int8 and stores_fp8(transformer))
        c = load_single_files(
            transformer,
            vae,
            text_encoder,
            tokenizer,
            device=dev,
            dtype=resolve_dtype(dtype, dev),
            scheduler=scheduler,
            transformer_config=transformer_config,
            vae_config=vae_config,
            text_encoder_config=text_encoder_config,
            fp8=as_fp8,
            offload=opts.offload,
        )
        return cls(
            c.transformer,
            c.vae,
            c.text_encoder,
            c.scheduler_config,
            model_path=c.model_path,
            options=opts,
            device=dev,
        )

    # ---------------------------------------------------------------- generation
    def output_size(self, call_args: dict) -> tuple[int, int]:
        """(height, width) in pixels that a call with these arguments generates."""
        d = self.defaults
        return call_args.get("height") or d["height"], call_args.get("width") or d["width"]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ("latents",),
        max_sequence_length: int = 512,
        scheduler_overrides: dict | None = None,
        callback: StepCallback | None = None,
        loras: list[list[tuple[str, float]]] | None = None,
    ) -> QwenImageOutput | tuple:
        """Text-to-image with diffusers' arguments, in diffusers' order (see docs/diffusers.md).
        `prompt_embeds` (B, L, D) (+ `prompt_embeds_mask` (B, L), 1 = real token) replace `prompt`,
        as in diffusers: conditioning encoded elsewhere (a ComfyUI CONDITIONING, say); likewise
        `negative_prompt_embeds`. qwenfast's own: `scheduler_overrides` (scheduler config fields for
        this call), `callback(i, n, latents)` after each step (previews), and `loras`: per prompt its
        [(name, strength), ...], each row of the batch with its own (after `enable_row_loras`)."""
        d = self.defaults
        height = d["height"] if height is None else height
        width = d["width"] if width is None else width
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        h, w = self._check(
            height, width, steps, num_images_per_prompt, output_type, max_sequence_length, sigmas
        )
        with DiffusersCall(
            self, guidance_scale, attention_kwargs, callback_on_step_end, callback_on_step_end_tensor_inputs
        ) as call:
            cond, uncond, k = self._prompt_conds(
                prompt,
                negative_prompt,
                cfg_scale,
                num_images_per_prompt,
                max_sequence_length,
                prompt_embeds,
                prompt_embeds_mask,
                negative_prompt_embeds,
                negative_prompt_embeds_mask,
            )
            out = self._generate(
                B=k * num_images_per_prompt,
                h=h,
                w=w,
                cond=cond,
                uncond=uncond,
                cfg_scale=cfg_scale,
                steps=steps,
                generator=generator,
                latents=latents,
                output_type=output_type,
                sigmas=sigmas,
                scheduler_overrides=scheduler_overrides,
                callback=callback,
                step_end=call.step_end,
                forward_for=self._rows_forward(loras, k, num_images_per_prompt),
            )
        return call.output(out, return_dict)
