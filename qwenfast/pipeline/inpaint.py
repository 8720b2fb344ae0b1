"""Inpainting: `QwenImageInpaintPipeline` (text-to-image models) and `QwenImageEditInpaintPipeline`
(edit models), with diffusers 0.42.1's arguments and images (`pipeline_qwenimage_inpaint.py`,
`pipeline_qwenimage_edit_inpaint.py`).

Mask semantics are diffusers': white (>= 50% grey after the resize) = repaint, black = keep; soft
edges are binarised at half grey, as diffusers' mask processor does. Inpainting is img2img
(`img2img.py`: strength -> first step, noised image latents as the start) plus one per-step hook of
the denoise core: after each step the kept region is put back at the next noise level
(`img2img.MaskBlend`). Edit inpainting also feeds the image's latents as the reference tokens, as
the edit model expects. diffusers' `masked_image_latents` is accepted and unused (diffusers
computes it but its loop never reads it); `padding_mask_crop` is not supported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import QwenImageOutput
from .diffusers_compat import DiffusersCall
from .edit import QwenImageEditPipeline, load_images
from .img2img import (
    ImageLatents,
    QwenImageImg2ImgPipeline,
    check_strength,
    image_tensor,
    inpaint_start,
    latent_mask,
    mask_tensor,
    tile_rows,
)
from .sampling import StepCallback, pack_latents
from .tasks import Capabilities
from .text_to_image import log


def _no_crop(padding_mask_crop) -> None:
    if padding_mask_crop is not None:
        raise ValueError(
            "`padding_mask_crop` is not supported by qwenfast; crop the image and the mask to the "
            "region first, inpaint, and paste the result back"
        )


class QwenImageInpaintPipeline(QwenImageImg2ImgPipeline):
    """Inpainting with a text-to-image model: `pipe(prompt, image=im, mask_image=m, strength=0.85)`.

    diffusers' `QwenImageInpaintPipeline` arguments (in its order) and images. `mask_image`: white /
    1 = repaint, black / 0 = keep (PIL / path / array / tensor, or a list matching the images; read
    as diffusers' mask processor reads them, see `images.py`); it is resized to the output size like
    the image. The output is height x width (default: the model's default size, as diffusers).
    """

    CAPABILITIES = Capabilities("qwen-image", tasks=("inpaint",), max_images=1, mask=True, single_files=True)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float | None = None,
        image=None,
        mask_image=None,
        masked_image_latents=None,
        height: int | None = None,
        width: int | None = None,
        padding_mask_crop: int | None = None,
        strength: float = 0.6,
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
    ) -> QwenImageOutput | tuple:
        _no_crop(padding_mask_crop)
        a = {k: v for k, v in locals().items() if k != "self"}
        return self._img2img(a, a.pop("mask_image"), inpaint=True)


class QwenImageEditInpaintPipeline(QwenImageEditPipeline):
    """Inpainting with an edit model: `pipe(image, "make it a cat", mask_image=m, strength=1.0)`.

    One image; the output follows its aspect at the model's area (~1024²), as diffusers (`height` and
    `width` are ignored there too). On Edit v1 folders this is diffusers' pipeline exactly; on
    Edit-2509/2511 folders the prompt and reference image follow those models' preprocessing
    ("Picture 1:", VL image at ~384²), which diffusers has no inpainting pipeline for. The mask is
    read as diffusers' mask processor reads it (`images.py`).
    """

    CAPABILITIES = Capabilities(
        "qwen-image-edit-plus",
        tasks=("edit-inpaint",),
        max_images=1,
        mask=True,
        single_files=True,
        variant="edit-plus",
    )  # answered per folder: `_capabilities_of`

    def output_size(self, call_args: dict) -> tuple[int, int]:
        """(height, width): the image's aspect at the model's VAE area, whatever height/width say."""
        return super().output_size({"image": call_args["image"]})

    @torch.no_grad()
    def __call__(
        self,
        image=None,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        mask_image=None,
        masked_image_latents=None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        padding_mask_crop: int | None = None,
        strength: float = 0.6,
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
    ) -> QwenImageOutput | tuple:
        _no_crop(padding_mask_crop)
        if image is None:
            raise ValueError("`image` is required (the picture to inpaint)")
        images = load_images(image)
        if len(images) != 1:
            raise ValueError(f"edit inpainting takes exactly 1 image and 1 mask, got {len(images)} images")
        if latents is not None:  # diffusers 0.42.1 fails on it too
            raise ValueError("`latents` is not supported for inpainting; give `generator` (a seed) instead")
        vl_images, vae_in, _ = self.prepare_images(images)
        out_h, out_w = self.output_size({"image": images})
        if (height is not None and height != out_h) or (width is not None and width != out_w):
            log.info(
                "edit inpainting follows the image's size (%dx%d); height/width are ignored", out_w, out_h
            )
        d = self.defaults
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        cfg_scale = d["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale
        n = num_images_per_prompt
        h, w = self._check(out_h, out_w, steps, n, output_type, max_sequence_length, sigmas)
        check_strength(strength, len(sigmas) if sigmas is not None else steps)
        mask = mask_tensor(mask_image, out_h, out_w)  # (k, 1, 8h, 8w)
        if mask.shape[0] != 1:
            raise ValueError(f"edit inpainting takes exactly 1 image and 1 mask, got {mask.shape[0]} masks")
        with DiffusersCall(
            self, guidance_scale, attention_kwargs, callback_on_step_end, callback_on_step_end_tensor_inputs
        ) as call:
            cond, uncond, k = self._prompt_conds(
                prompt,
                negative_prompt,
                cfg_scale,
                n,
                None,
                prompt_embeds,
                prompt_embeds_mask,
                negative_prompt_embeds,
                negative_prompt_embeds_mask,
                encode=lambda texts: self.encode_edit_prompt(texts, vl_images, n),
            )
            B = k * n
            if isinstance(generator, list) and len(generator) != B:
                raise ValueError(f"got {len(generator)} generators for a batch of {B} images")
            z = ImageLatents.encode(
                self, image_tensor(vae_in, 8 * h, 8 * w), generator
            )  # (1, 16, h, w): a sample
            packed = pack_latents(
                tile_rows(z, B, "images")
            )  # the reference tokens and the kept region's target
            lmask = latent_mask(mask, h, w, B, self.device, self.dtype)
            out = self._generate(
                B=B,
                h=h,
                w=w,
                cond=cond,
                uncond=uncond,
                cfg_scale=cfg_scale,
                steps=steps,
                generator=generator,
                latents=None,
                output_type=output_type,
                sigmas=sigmas,
                scheduler_overrides=scheduler_overrides,
                callback=callback,
                ref=(packed, [(1, h // 2, w // 2)]),
                start=inpaint_start(packed, lmask, strength),
                step_end=call.step_end,
            )
        return call.output(out, return_dict)
